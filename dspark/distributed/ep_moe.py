"""Expert-parallel MoE: rank r runs the routed experts e with e % N == r and its slice of the
shared expert; the fp32 partial outputs are summed over ranks by one all-reduce.

The exchange is a dense all-reduce of [T, D] partials, not an all-to-all of routed tokens:
every rank routes every token (the gate is replicated), so no token ids travel, the shapes
depend on T alone and the step stays capturable in a CUDA graph. At decode / verify sizes
(T <= a few hundred) the partials are a few hundred KB, where an all-reduce costs what an
all-to-all's two latency-bound launches would.

Routed experts of a step run in one of three ways, same math (fp32 activation, routing weight
before w2, each expert's output rounded to x.dtype before the fp32 sum):
* packed FP4 experts, Triton backend: `fp4_moe_grouped` over a stack of the rank's experts, whose
  expert map sends other ranks' experts to -1 (their pairs add 0): two fixed-shape launches;
* plain experts small enough for the single-device gathered / dense paths (MoE.routed_path's
  byte limits, over the rank's experts): slots routed elsewhere get routing weight 0 on the
  rank's first expert, so they add exactly 0; fixed shapes, no host sync;
* otherwise (prefill-size batches, large plain experts, FP4 on the torch backend) one GEMM pair
  per used local expert, grouped on the host (one device->host sync).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.cuda import side_stream
from dspark.kernels.fp4_moe import fp4_moe_grouped, grouped_applies
from dspark.models.deepseek_v4.moe import MoE


def _is_fp4(lin) -> bool:
    from dspark.models.qlinear import QuantLinear
    return isinstance(lin, QuantLinear) and lin.kind == "fp4"


class EPMoE(MoE):
    """MoE over this rank's routed experts (`experts` is a ModuleDict keyed by global expert id,
    so parameter names stay the checkpoint's) and its part of the shared expert.
    Set by `tp.shard_modules`: `_tp` (TPGroup), `_n_experts` (all experts), `_world`."""

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        if self._tp.world == 1:               # nothing to sum: the kernels round to x.dtype
            return self.partial(x, token_ids, x.dtype).to(x.dtype)
        return self._tp.all_reduce(self.partial(x, token_ids)).to(x.dtype)

    def partial(self, x: torch.Tensor, token_ids: torch.Tensor,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """This rank's [T, D] share (fp32; out_dtype: what the grouped FP4 kernels round it to):
        its routed experts' outputs + its shared-expert part."""
        if self._fp4_grouped(x):
            # as QuantMoE.forward: the shared expert on a side stream (CUDA), forked first but
            # queued after the router (which runs on a high-priority lane), overlapping the
            # routed gate/up kernel; the down kernel adds it (fp32 sum) and rounds to out_dtype
            side = side_stream.fork(x.device, 1) if self.shared_experts is not None else None
            router = side_stream.fork(x.device, 6)
            with side_stream.on(router):
                idx, w = self.gate(x, token_ids)
            side_stream.join(router)
            shared = None
            if self.shared_experts is not None:
                with side_stream.on(side):
                    shared = self.shared_experts(x)
            return fp4_moe_grouped(x, idx, w, self.fp4_stack(), self._local()[0].limit,
                                   add=shared, out_dtype=out_dtype, add_stream=side)
        idx, w = self.gate(x, token_ids)
        out = self.routed_fixed(x, idx, w)
        if out is None:
            out = self._routed_loop(x, idx, w)
        if self.shared_experts is not None:
            out += self.shared_experts(x)          # fp32 += x.dtype: added in fp32
        return out

    # ---- routed experts -------------------------------------------------------------------
    def _local(self) -> list:
        return list(self.experts.values())

    def routed_fixed(self, x, idx, w):
        """fp32 [T, D] partial by a fixed-shape path, or None when none applies (module doc)."""
        experts = self._local()
        if not experts or x.dim() != 2:
            return None
        first = experts[0]
        if _is_fp4(first.w1):
            if not self._fp4_grouped(x):
                return None
            return fp4_moe_grouped(x, idx, w, self.fp4_stack(), first.limit)
        stack = self._plain_stack()
        if stack is None:
            return None
        w13, w2 = stack
        E, I2, D = w13.shape
        T, k = idx.shape
        held = (idx % self._world) == self._rank
        local_idx = torch.where(held, idx // self._world, 0)
        local_w = torch.where(held, w, 0.0)
        expert_bytes = (I2 * D + w2[0].numel()) * w13.element_size()
        if T * k * expert_bytes <= self.gather_max_bytes:
            return self._routed_gathered(x, local_idx, local_w, w13, w2, first.limit)
        if T * E * (I2 + I2 // 2 + D) * 4 <= self.dense_max_bytes:
            return self._routed_dense(x, local_idx, local_w, w13, w2, first.limit)
        return None

    def _fp4_grouped(self, x) -> bool:
        """Packed FP4 experts whose step takes the grouped kernels (fp4_moe.grouped_applies
        for the step's T x k pairs: shape-only, decided before routing)."""
        experts = self._local()
        if not experts or not _is_fp4(experts[0].w1) or x.dim() != 2:
            return False
        pairs = torch.empty(x.shape[0], self.gate.topk, device="meta")
        return grouped_applies(x, pairs, experts[0].w1.backend)

    def fixed_shape_capable(self) -> bool:
        """Whether decode / verify steps take a fixed-shape routed path (no host sync), so that
        a CUDA graph can hold them: packed FP4 experts on the Triton backend, or plain experts
        whose stack fits (a rank without experts has nothing to route)."""
        experts = self._local()
        if not experts:
            return True
        w1 = experts[0].w1
        if _is_fp4(w1):
            backend = w1.backend if w1.backend != "auto" else (
                "triton" if w1.weight.is_cuda else "torch")
            return backend == "triton"
        return self._plain_stack() is not None

    def _routed_loop(self, x, idx, w):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self._n_experts)
        counts, starts = torch.stack([counts, torch.cumsum(counts, 0) - counts]).tolist()  # 1 sync
        tok, wf = order // idx.shape[1], w.flatten()
        for key, expert in self.experts.items():
            e = int(key)
            n, s = counts[e], starts[e]
            if n:
                sel, t = order[s:s + n], tok[s:s + n]
                out.index_add_(0, t, expert(x[t], wf[sel]).float())
        return out

    def _plain_stack(self):
        """(w13 [E_r, 2I, D], w2 [E_r, D, I]) of the rank's plain experts in global id order
        (local row of expert e = e // world), when they are nn.Linear and their stack fits
        MoE.stack_max_bytes (the single-device rule); cached, rebuilt when a weight changes."""
        experts = self._local()
        lins = [lin for e in experts for lin in (e.w1, e.w3, e.w2)]
        if not all(type(lin) is nn.Linear for lin in lins):
            return None
        w0 = experts[0].w1.weight
        if torch.is_grad_enabled() and w0.requires_grad:
            return None
        if len(experts) * 3 * w0.numel() * w0.element_size() > self.stack_max_bytes:
            return None
        try:
            key = tuple((lin.weight.data_ptr(), lin.weight._version) for lin in lins)
        except RuntimeError:                  # inference tensors have no version counter
            key = tuple(lin.weight.data_ptr() for lin in lins)
        cached = getattr(self, "_ep_stack_cache", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("EPMoE: the expert stack must be built before CUDA graph capture")
        with torch.no_grad():
            w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
            w2 = torch.stack([e.w2.weight for e in experts])
        self._ep_stack_cache = (key, (w13, w2))
        return w13, w2

    def fp4_stack(self):
        """The rank's packed FP4 experts as one FP4ExpertStack whose expert map covers all
        experts (-1: another rank's); every expert QuantLinear's buffers are re-pointed at views
        of it (as QuantMoE.stack_experts), so it costs no lasting extra memory."""
        st = getattr(self, "_fp4_stack", None)
        experts = self._local()
        if st is not None and experts[0].w1.weight.data_ptr() == st.w13.data_ptr():
            return st
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("EPMoE: the FP4 expert stack must be built before CUDA graph "
                               "capture (run one eager step first, or call fp4_stack())")
        from dspark.kernels.fp4_moe import stack_fp4_experts
        held = {int(k): e for k, e in self.experts.items()}
        table = [((e.w1.weight, e.w1.scale), (e.w3.weight, e.w3.scale), (e.w2.weight, e.w2.scale))
                 if (e := held.get(i)) is not None else None for i in range(self._n_experts)]
        with torch.inference_mode(False), torch.no_grad():
            st = stack_fp4_experts(table)
            inter = st.w13.shape[1] // 2
            for row, e in enumerate(held[i] for i in sorted(held)):
                for lin, wt, s in ((e.w1, st.w13[row, :inter], st.s13[row, :inter]),
                                   (e.w3, st.w13[row, inter:], st.s13[row, inter:]),
                                   (e.w2, st.w2[row], st.s2[row])):
                    lin._buffers["weight"] = wt.view(lin.weight.dtype)
                    lin._buffers["scale"] = s.view(lin.scale.dtype)
        self._fp4_stack = st
        return st
