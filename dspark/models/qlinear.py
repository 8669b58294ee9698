"""Keep FP8 block-scaled weights and FP4 routed experts quantized in memory (spec §5.2).

    model, drafter = build_quantized_models(path, cfg, dtype, device, with_drafter=True)
    print(format_memory_report(memory_report(model, drafter)))

* `QuantLinear` replaces an `nn.Linear` whose checkpoint tensor is fp8 / fp4. Its buffers are named
  like the checkpoint (`weight` = raw e4m3 codes or packed int8 FP4, `scale` = e8m0 bytes), so a
  `load_checkpoint(..., keep_quantized=True)` dict loads with `load_state_dict(strict=True,
  assign=True)`. `forward(x)` computes `x W^T` from the quantized bytes (`fp8_linear` /
  `fp4_linear`: Triton on CUDA, exact dequantize-then-F.linear on CPU) in x.dtype.
  `.weight` is the raw tensor, never the logical one: code that needs the logical weight calls
  `dequantized(dtype)` (debug) — the model calls the module instead of `F.linear(x, m.weight)`.
* `QuantMoE` (set as the class of a MoE whose routed experts are FP4) runs the routed experts
  from the packed weights; gate and shared expert are unchanged. Small batches (T*k <=
  `grouped_max_pairs`, Triton backend, i.e. CUDA under "auto") take `fp4_moe_grouped`: two
  fixed-shape Triton launches, no host sync, CUDA-graph capturable; larger batches (and the CPU
  torch backend) take the per-expert `fp4_moe` loop. The grouped kernels read one
  `FP4ExpertStack` per MoE: `stack_experts()` (at load on CUDA, else at first use) copies the
  experts' codes / scales into [E, ...] tensors and re-points every expert QuantLinear's buffers
  at views of them, so no lasting extra memory (peak during the copy: + one layer's routed
  experts, ~3.3 GB for V4-Flash).
* Tensor parallelism: `dspark/distributed` builds QuantLinears of each rank's local shape from the
  rank's codes and scale tiles (splits on 128-blocks; `sharding.check_quantized_split`).
"""
from __future__ import annotations

import torch
from torch import nn

from dspark.kernels.fp4_moe import (GROUPED_MAX_PAIRS, FP4ExpertStack, fp4_linear, fp4_moe,
                                    fp4_moe_grouped, grouped_serves, stack_fp4_experts)
from dspark.kernels.fp8_gemm import fp8_linear, fp8_linear_grouped
from dspark.cuda import side_stream
from dspark.models.deepseek_v4.moe import MoE
from dspark.formats.quant import (FP8_BLOCK, dequant_fp4_experts, dequant_fp8_blocks,
                                 fp4_scale_shape, fp8_scale_shape)

QUANT_KINDS = ("fp8", "fp4")


class QuantLinear(nn.Module):
    """Bias-free linear layer y = x W^T with W stored as FP8 (128x128 e8m0 tiles) or packed FP4
    (1x32 e8m0 groups). Buffers start on the meta device; load them with load_state_dict(assign)."""

    def __init__(self, in_features: int, out_features: int, kind: str,
                 compute_dtype: torch.dtype = torch.bfloat16, backend: str = "auto"):
        super().__init__()
        if kind not in QUANT_KINDS:
            raise ValueError(f"QuantLinear: kind={kind!r}; use one of {QUANT_KINDS}")
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        self.compute_dtype, self.backend = compute_dtype, backend
        if kind == "fp8":
            w = torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device="meta")
            s = torch.empty(fp8_scale_shape(out_features, in_features), dtype=torch.float8_e8m0fnu,
                            device="meta")
        else:
            if in_features % 2:
                raise ValueError(f"FP4 weights need an even number of input features, got {in_features}")
            w = torch.empty(out_features, in_features // 2, dtype=torch.int8, device="meta")
            s = torch.empty(fp4_scale_shape(out_features, in_features), dtype=torch.float8_e8m0fnu,
                            device="meta")
        self.register_buffer("weight", w)
        self.register_buffer("scale", s)

    @classmethod
    def from_tensors(cls, weight: torch.Tensor, scale: torch.Tensor, kind: str,
                     compute_dtype=torch.bfloat16, backend: str = "auto") -> "QuantLinear":
        out_f, in_f = weight.shape[0], weight.shape[1] * (2 if kind == "fp4" else 1)
        m = cls(in_f, out_f, kind, compute_dtype, backend)
        m.load_state_dict({"weight": weight, "scale": scale}, strict=True, assign=True)
        return m

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "fp8":
            return fp8_linear(x, self.weight, self.scale, self.backend)
        return fp4_linear(x, self.weight, self.scale, self.backend)

    def dequantized(self, dtype=None) -> torch.Tensor:
        """The logical weight [out, in] (debugging / reference; allocates the full tensor)."""
        dtype = dtype or self.compute_dtype
        if self.kind == "fp8":
            return dequant_fp8_blocks(self.weight, self.scale, dtype)
        return dequant_fp4_experts(self.weight, self.scale, dtype)

    def grouped(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """Grouped projection (attention `wo_a`): x [T, G, in] -> [T, G, out/G], group g using
        weight rows g*out/G .. (g+1)*out/G — the einsum "tgi,gri->tgr" of the reference.
        FP8 with 128-aligned groups (V4-Flash: 1024 rows per group): few tokens on the Triton
        backend in one skinny launch for all groups (`fp8_linear_grouped`), else one fp8_linear per
        group on the row slice of the weight and its scale tiles; otherwise the weight is
        de-quantized per call."""
        R = self.out_features // groups
        if self.kind == "fp8":
            y = fp8_linear_grouped(x, self.weight, self.scale, groups, self.backend)
            if y is not None:                          # few tokens on the GPU: one launch
                return y
        if self.kind == "fp8" and R % FP8_BLOCK == 0:
            rb = R // FP8_BLOCK
            outs = [fp8_linear(x[:, g], self.weight[g * R:(g + 1) * R],
                               self.scale[g * rb:(g + 1) * rb], self.backend)
                    for g in range(groups)]
            return torch.stack(outs, dim=1)
        wa = self.dequantized(x.dtype).view(groups, R, -1)
        return torch.einsum("tgi,gri->tgr", x, wa)


class QuantMoE(MoE):
    """MoE whose routed experts hold packed FP4 QuantLinears: routed part via `fp4_moe_grouped`
    (small batches on the Triton backend) or the per-expert `fp4_moe` loop."""

    # batches of up to this many (token, slot) pairs take the grouped kernels (their GPU tests
    # passed on the H200: V4-Flash shapes == the torch path, CUDA graph replay == eager);
    # `QuantMoE.grouped_max_pairs = 0` forces the per-expert loop for every QuantMoE
    grouped_max_pairs = GROUPED_MAX_PAIRS

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        # the shared expert depends on x alone: on CUDA it runs on a side stream, its FP8 GEMVs
        # overlapping the router and the routed experts' gate/up kernel (side_stream.py). The
        # side stream forks here, but its kernels are queued after the router's: a CUDA graph
        # launches branches in the order they were captured, and the router is on the critical
        # path (H200 timeline: queued second it started ~7 us late, behind the shared GEMV)
        side = side_stream.fork(x.device, 1)
        # with high-priority side lanes (side_stream.SIDE_PRIORITY) the router runs
        # on one too: on the main stream it would wait behind the shared expert's GEMV
        router = side_stream.fork(x.device, 6)
        with side_stream.on(router):
            idx, w = self.gate(x, token_ids)
        side_stream.join(router)
        with side_stream.on(side):
            shared = self.shared_experts(x)
        first = self.experts[0].w1
        limit = self.experts[0].limit
        # the same shape-only test the draft pass decides its CUDA-graph buckets by (DraftPass)
        if x.dim() == 2 and self.takes_grouped(x.shape[0], x.device):
            # the down kernel adds the shared expert's output and rounds to x.dtype itself
            return fp4_moe_grouped(x, idx, w, self.fp4_stack(), limit, add=shared,
                                   out_dtype=x.dtype, add_stream=side)
        experts = [((e.w1.weight, e.w1.scale), (e.w3.weight, e.w3.scale),
                    (e.w2.weight, e.w2.scale)) for e in self.experts]
        out = fp4_moe(x, idx, w, experts, limit, backend=first.backend, grouped=False)
        side_stream.join(side)
        out += shared                        # fp32 += x.dtype: added in fp32, no cast launch
        return out.to(x.dtype)

    def takes_grouped(self, tokens: int, device) -> bool:
        """Whether `forward` on `tokens` tokens of `device` takes the grouped kernels (no host
        sync: CUDA-graph capturable), from the shapes alone: the test `forward` makes, asked
        before capturing a graph of that many rows."""
        cap = self.grouped_max_pairs
        return bool(cap) and grouped_serves(tokens * self.gate.topk, device,
                                            self.experts[0].w1.backend, cap)

    def fp4_stack(self) -> FP4ExpertStack:
        """The experts' stacked weights, (re)built when missing or when the experts' buffers no
        longer point into it (weights reassigned, module moved: cheap check on the first and last
        expert only; in-place updates of the views need nothing)."""
        st = getattr(self, "_fp4_stack", None)
        if st is not None:
            e0, e1 = self.experts[0], self.experts[len(self.experts) - 1]
            if (e0.w1.weight.data_ptr() == st.w13.data_ptr()
                    and e1.w2.scale.data_ptr() == st.s2[-1].data_ptr()):
                return st
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("QuantMoE: the FP4 expert stack must be built before CUDA graph "
                               "capture (run one eager step first, or call stack_experts())")
        return self.stack_experts()

    def stack_experts(self) -> FP4ExpertStack:
        """Copy the routed experts' packed codes and e8m0 scales into one `FP4ExpertStack` and make
        every expert QuantLinear's `weight` / `scale` a view of it (same dtypes and shapes), so the
        per-expert path and the grouped kernels share one copy of the weights. The old per-expert
        tensors are freed once nothing else references them."""
        experts = [((e.w1.weight, e.w1.scale), (e.w3.weight, e.w3.scale),
                    (e.w2.weight, e.w2.scale)) for e in self.experts]
        with torch.inference_mode(False), torch.no_grad():
            st = stack_fp4_experts(experts)
            inter = st.w13.shape[1] // 2
            for i, e in enumerate(self.experts):
                for lin, w, s in ((e.w1, st.w13[i, :inter], st.s13[i, :inter]),
                                  (e.w3, st.w13[i, inter:], st.s13[i, inter:]),
                                  (e.w2, st.w2[i], st.s2[i])):
                    lin._buffers["weight"] = w.view(lin.weight.dtype)
                    lin._buffers["scale"] = s.view(lin.scale.dtype)
        del experts
        self._fp4_stack = st
        return st


def stack_rows(linears) -> "QuantLinear | None":
    """One FP8 QuantLinear whose rows are those of `linears` in order (same input width, every
    row count a multiple of 128, so the 128 x 128 scale tiles stack too); each linear's buffers
    are re-pointed at its views of it (no lasting extra memory, same bytes). None when they do
    not qualify. Linears that read the same input then run as one GEMM launch (few-token steps
    are launch- and latency-bound: one launch over their rows instead of one each)."""
    if not linears or not all(isinstance(m, QuantLinear) and m.kind == "fp8"
                              and not m.weight.is_meta for m in linears):
        return None
    K = linears[0].in_features
    if any(m.in_features != K or m.out_features % FP8_BLOCK for m in linears):
        return None
    with torch.inference_mode(False), torch.no_grad():    # (cat of uint8 views: any device)
        w = torch.cat([m.weight.view(torch.uint8) for m in linears]).view(linears[0].weight.dtype)
        s = torch.cat([m.scale.view(torch.uint8) for m in linears]).view(linears[0].scale.dtype)
    first = linears[0]
    r = 0
    for m in linears:
        n = m.out_features
        m._buffers["weight"] = w[r:r + n]
        m._buffers["scale"] = s[r // FP8_BLOCK:(r + n) // FP8_BLOCK]
        r += n
    return QuantLinear.from_tensors(w, s, "fp8", first.compute_dtype, first.backend)


def fuse_same_input_linears(root: nn.Module) -> int:
    """Row-stack the FP8 projections that read the same activation: attention wq_a + wkv, and
    w1 + w3 of every dense SwiGLU expert (the shared experts). The fused module is kept outside
    the module tree (no state_dict key, no double count in memory_report); Attention.project_q_kv
    and Expert.forward use it. Call it once the model is on its device and in its dtype (a
    later .to() would move the linears but not the stacks). Returns how many were stacked."""
    from dspark.models.deepseek_v4.attention import Attention
    from dspark.models.deepseek_v4.moe import Expert
    n = 0
    for m in root.modules():
        pair = ((m.wq_a, m.wkv) if isinstance(m, Attention)
                else (m.w1, m.w3) if isinstance(m, Expert) else None)
        fused = stack_rows(pair) if pair is not None else None
        if fused is not None:
            m.__dict__["_fused_rows"] = fused
            n += 1
    return n


def quantize_modules(root: nn.Module, kinds: dict, compute_dtype: torch.dtype,
                     backend: str = "auto") -> list[str]:
    """Replace every `nn.Linear` named in `kinds` {module path: "fp8" | "fp4"} under `root` by a
    meta-device QuantLinear of the same shape; MoEs whose routed experts all became FP4 become
    QuantMoE. Returns the replaced paths."""
    done = []
    for path, kind in kinds.items():
        parent_path, _, leaf = path.rpartition(".")
        parent = root.get_submodule(parent_path) if parent_path else root
        lin = getattr(parent, leaf)
        if not isinstance(lin, nn.Linear):
            raise TypeError(f"{path}: expected an nn.Linear to quantize, found {type(lin).__name__}")
        setattr(parent, leaf, QuantLinear(lin.in_features, lin.out_features, kind, compute_dtype,
                                          backend))
        done.append(path)
    for m in root.modules():
        if type(m) is MoE and all(isinstance(e.w1, QuantLinear) and e.w1.kind == "fp4" and
                                  isinstance(e.w2, QuantLinear) and isinstance(e.w3, QuantLinear)
                                  for e in m.experts):
            m.__class__ = QuantMoE
    return done


def drafter_param_name(ckpt_name: str) -> str:
    """DSparkDrafter.param_name extended to `.scale` entries (mapped like their `.weight`)."""
    from dspark.models.drafter import DSparkDrafter
    if ckpt_name.endswith(".scale"):
        return DSparkDrafter.param_name(ckpt_name[:-len(".scale")] + ".weight")[:-len("weight")] + "scale"
    return DSparkDrafter.param_name(ckpt_name)


def build_quantized_models(path: str, cfg, dtype: torch.dtype, device, with_drafter: bool,
                           progress: bool = False, backend: str = "auto"):
    """(model, drafter | None) with fp8 / fp4 checkpoint weights kept quantized; every other
    tensor exactly as `load_checkpoint` returns it (bf16 kinds as `dtype`, fp32 params fp32)."""
    from dspark.models.deepseek_v4.model import DeepseekV4Model
    from dspark.models.deepseek_v4.weights import tensor_inventory
    from dspark.models.drafter import DSparkDrafter
    from dspark.models.loader import load_checkpoint

    inv = tensor_inventory(cfg)
    weights = load_checkpoint(path, cfg, dtype=dtype, device=device, progress=progress,
                              keep_quantized=True)
    with torch.device("meta"):
        model = DeepseekV4Model(cfg)
        drafter = DSparkDrafter(cfg) if with_drafter else None
    strip = lambda n: n[:-len(".weight")]  # noqa: E731
    quantize_modules(model, {strip(n): s.kind for n, s in inv.items()
                             if s.kind in QUANT_KINDS and not n.startswith("mtp.")}, dtype, backend)
    model.load_state_dict({k: v for k, v in weights.items() if not k.startswith("mtp.")},
                          strict=True, assign=True)
    if drafter is not None:
        quantize_modules(drafter, {strip(drafter_param_name(n)): s.kind for n, s in inv.items()
                                   if s.kind in QUANT_KINDS and n.startswith("mtp.")}, dtype, backend)
        drafter.load_state_dict({drafter_param_name(k): v for k, v in weights.items()
                                 if k.startswith("mtp.")}, strict=True, assign=True)
    del weights
    for root in (model, drafter):
        if root is not None:
            fuse_same_input_linears(root)
    if torch.device(device).type == "cuda" and QuantMoE.grouped_max_pairs:
        # stacked FP4 experts for the grouped small-batch MoE kernels (views: no lasting extra
        # memory), built now so a first step under CUDA graph capture finds them ready
        for root in (model, drafter):
            for m in (root.modules() if root is not None else ()):
                if isinstance(m, QuantMoE):
                    m.stack_experts()
    return model.eval(), (drafter.eval() if drafter is not None else None)


# ---- memory report -------------------------------------------------------------------------

_DTYPE_LABEL = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16",
                torch.int64: "int64", torch.int32: "int32", torch.float8_e4m3fn: "fp8"}


def memory_report(*roots) -> dict:
    """Bytes of weights held by the given modules, by storage format: "fp8" / "fp4" (QuantLinear
    codes + their e8m0 scales), then plain tensors by dtype ("bf16", "fp32", "int64", ...), and
    "total". Tensors shared between modules are counted once; meta tensors are skipped."""
    seen, out = set(), {}

    def add(label, t):
        if t is None or t.is_meta:
            return
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.nbytes)
        if key in seen:
            return
        seen.add(key)
        out[label] = out.get(label, 0) + t.nbytes

    for root in roots:
        if root is None:
            continue
        for m in root.modules():
            if isinstance(m, QuantLinear):
                add(m.kind, m.weight)
                add(m.kind, m.scale)
        for m in root.modules():
            if isinstance(m, QuantLinear):
                continue
            for t in list(m._parameters.values()) + list(m._buffers.values()):
                if t is not None:
                    add(_DTYPE_LABEL.get(t.dtype, str(t.dtype).replace("torch.", "")), t)
    order = ["fp8", "fp4", "bf16", "fp16", "fp32", "int64"]
    rep = {k: out[k] for k in order if k in out}
    rep.update({k: v for k, v in out.items() if k not in rep})
    rep["total"] = sum(out.values())
    return rep


def format_memory_report(rep: dict) -> str:
    unit, div = ("GB", 1e9) if rep["total"] >= 1e8 else ("MB", 1e6)
    parts = [f"{v / div:.2f} {unit} {k}" for k, v in rep.items() if k != "total"]
    return f"weights: {', '.join(parts)} (total {rep['total'] / div:.2f} {unit})"
