"""Mixture of experts (spec §3.8): sqrt-softplus scores, biased top-k or hash routing via
`tid2eid`, clamped SwiGLU experts in fp32, one shared expert.

Two ways to run the routed experts, same math (fp32 activation, routing weight before w2, each
expert's output rounded to x.dtype before the fp32 sum):
* per used expert: group the tokens by expert, one GEMM pair per expert (any batch);
* gathered (few tokens, small experts — decode and verify of small models): the selected experts'
  weights are gathered from a cached [E, ...] stack and applied with two batched matmuls, a fixed
  ~15 ops with no host sync, instead of ~12 ops per used expert plus a `.tolist()` sync;
* dense (more tokens than the gather's copies of expert weights allow, small expert sets):
  every expert on every token with the routing weight zero off the route, the same fixed ops and
  no host sync. A CUDA graph cannot hold the per-expert loop's sync, so without this a verify
  step of many requests (64 x 6 tokens of the shipped pair) could not be captured.
Gathered and dense run on CUDA only by default (`gathered_devices`): there the decode step is
launch-bound, while on CPU the per-expert loop stays the bit-exact reference that the FP4
`QuantMoE` path reproduces (batched and per-expert GEMMs round differently, ~1e-7 relative).
"""
import torch
import torch.nn.functional as F
from torch import nn

from .norm import fp32, fused_backend, linear_fp32


def _invariant() -> bool:
    from dspark.kernels import invariant          # (imports triton: only where it runs)
    return invariant.on()


class Expert(nn.Module):
    """SwiGLU with the asymmetric clamp: up in [-limit, limit], gate <= limit (fp32 math)."""

    def __init__(self, dim: int, inter: int, swiglu_limit: float):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        fused = self.__dict__.get("_fused_rows")     # w1 + w3 row-stacked at load (quantized)
        if fused is not None:
            g, u = fused(x).split((self.w1.out_features, self.w3.out_features), dim=-1)
        else:
            g, u = self.w1(x), self.w3(x)
        if weight is None and g.dtype == x.dtype and fused_backend(g, u):
            from dspark.kernels import decode_fused as K      # imports triton: only where it runs
            if K.swiglu_supported(g, u):                      # one launch instead of 7
                return self.w2(K.swiglu(g, u, self.limit))
        h = clamped_swiglu(g.float(), u.float(), self.limit, weight)
        return self.w2(h.to(x.dtype))


def clamped_swiglu(g: torch.Tensor, u: torch.Tensor, limit: float,
                   weight: torch.Tensor | None = None) -> torch.Tensor:
    """silu(min(g, limit)) * clamp(u, ±limit) in fp32, times the routing weight if given."""
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if weight is not None:               # the reference scales before w2
        h = h * weight.unsqueeze(-1)
    return h


class Gate(nn.Module):
    def __init__(self, dim: int, n_experts: int, topk: int, route_scale: float,
                 hash_vocab: int = 0):
        super().__init__()
        self.topk, self.route_scale = topk, route_scale
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.hash = hash_vocab > 0
        if self.hash:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, topk, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(n_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor):
        """Returns (expert ids [T, k] int64, weights [T, k] fp32)."""
        if fused_backend(x, self.weight):
            from dspark.kernels import gate_route as G         # few tokens, 16-bit weight:
            if G.supported(x, self.weight):                    # GEMV + routing, one launch
                return G.gate_route(x, self.weight, self.topk, self.route_scale,
                                    **self._route_table(token_ids))[:2]
        # fp32 scores; on CUDA a bf16 GEMM with fp32 accumulation / output (linear_fp32): exact
        # products as in F.linear(x.float(), w.float()), no cast of x or fp32 weight copy
        logits = linear_fp32(x, self.weight)
        if logits.dim() == 2 and logits.stride(-1) == 1 and fused_backend(logits, x):
            from dspark.kernels import decode_fused as K      # scoring .. scaling: one launch
            return K.route(logits, self.topk, self.route_scale, **self._route_table(token_ids))
        scores = torch.sqrt(F.softplus(logits))
        if self.hash:
            idx = self.tid2eid[token_ids]
            idx = idx if idx.dtype == torch.long else idx.long()
        else:
            idx = torch.topk(scores + fp32(self.bias), self.topk, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        return idx, w * self.route_scale

    def _route_table(self, token_ids: torch.Tensor) -> dict:
        """The fused kernels' expert choice: the hash table and the token ids, or the bias."""
        if self.hash:
            return dict(tid2eid=self.tid2eid, token_ids=token_ids.reshape(-1))
        return dict(bias=fp32(self.bias))


class MoE(nn.Module):
    def __init__(self, cfg, hash_layer: bool):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(d, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                         hash_vocab=cfg.vocab_size if hash_layer else 0)
        self.experts = nn.ModuleList(Expert(d, inter, cfg.swiglu_limit)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(d, inter * cfg.n_shared_experts, cfg.swiglu_limit)

    # gathered path limits: bytes of expert weights gathered per call, and bytes of the cached
    # stack of all routed experts (a second copy of them, so only for small expert sets); dense
    # path limit: bytes of its fp32 activations ([T, E] x (2I gate/up + I + D out))
    gather_max_bytes = 32 << 20
    stack_max_bytes = 16 << 20
    dense_max_bytes = 256 << 20
    gathered_devices = ("cuda",)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x, token_ids)
        path, stack = self.routed_path(x.shape[0], idx.shape[1])
        if path == "gathered":
            out = self._routed_gathered(x, idx, w, *stack)
        elif path == "dense":
            out = self._routed_dense(x, idx, w, *stack)
        else:
            out = self._routed_per_expert(x, idx, w)
        out += self.shared_experts(x)        # fp32 += x.dtype: added in fp32, no cast launch
        return out.to(x.dtype)

    def _routed_per_expert(self, x, idx, w):
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        tok = order // idx.shape[1]
        start = 0
        for e, n in enumerate(counts):        # reference path: one GEMM pair per used expert
            if n:
                sel = order[start:start + n]
                t = tok[start:start + n]
                out.index_add_(0, t, self.experts[e](x[t], w.flatten()[sel]).float())
                start += n
        return out

    def _routed_gathered(self, x, idx, w, w13, w2, limit: float | None = None):
        """fp32 [T, D]: Σ_slots w2[e] · (weight · swiglu(w1[e] x, w3[e] x)) over the k slots
        (idx: rows of the stack; limit: the experts' clamp, default expert 0's)."""
        inter = w2.shape[-1]
        gu = torch.matmul(w13[idx], x[:, None, :, None]).squeeze(-1)        # [T, k, 2I] x.dtype
        g, u = gu.float().split(inter, dim=-1)
        limit = self.experts[0].limit if limit is None else limit
        h = clamped_swiglu(g, u, limit, w).to(x.dtype)
        y = torch.matmul(w2[idx], h.unsqueeze(-1)).squeeze(-1)              # [T, k, D] x.dtype
        return y.float().sum(1)

    def _routed_dense(self, x, idx, w, w13, w2, limit: float | None = None):
        """fp32 [T, D]: every expert on every token, its output zero where the token does not
        route to it, so the sum over experts adds what `_routed_gathered` adds over the slots
        (exactly, for k = 2: a two-term fp32 sum does not depend on its order)."""
        T, E, inter = x.shape[0], w13.shape[0], w2.shape[-1]
        weight = torch.zeros(T, E, dtype=torch.float32, device=x.device)
        weight.scatter_add_(1, idx, w.float())                               # [T, E]
        gu = torch.einsum("td,efd->tef", x, w13)                             # [T, E, 2I] x.dtype
        g, u = gu.float().split(inter, dim=-1)
        h = clamped_swiglu(g, u, self.experts[0].limit if limit is None else limit, weight)
        h = torch.where(weight.unsqueeze(-1) != 0, h, 0.0).to(x.dtype)       # off the route: 0
        y = torch.einsum("tei,edi->ted", h, w2)                              # [T, E, D] x.dtype
        return y.float().sum(1)

    def routed_path(self, tokens: int, k: int):
        """("gathered" | "dense", (w13, w2)) or ("loop", None): how `forward` runs the routed
        experts of `tokens` tokens with k slots each."""
        stack = self._expert_stack()
        if stack is None:
            return "loop", None
        w13, w2 = stack
        E, I2, D = w13.shape
        expert_bytes = (I2 * D + w2[0].numel()) * w13.element_size()
        if tokens * k * expert_bytes <= self.gather_max_bytes or _invariant():
            return "gathered", stack      # (batch-invariant mode: one path for every size)
        if tokens * E * (I2 + I2 // 2 + D) * 4 <= self.dense_max_bytes:
            return "dense", stack
        return "loop", None

    def _expert_stack(self):
        """(w13 [E, 2I, D], w2 [E, D, I]) when the experts are small plain linears on a device of
        `gathered_devices` and no gradients are wanted, else None. The stack is rebuilt whenever
        an expert weight was replaced or modified in place (data pointer / version counter), so
        it never serves stale weights."""
        experts = self.experts
        if not isinstance(experts, nn.ModuleList) or type(experts[0].w1) is not nn.Linear:
            return None                       # sharded or quantized experts
        w0 = experts[0].w1.weight
        if w0.device.type not in self.gathered_devices:
            return None
        if torch.is_grad_enabled() and w0.requires_grad:
            return None                       # the stack is detached: training needs the loop
        expert_bytes = 3 * w0.numel() * w0.element_size()
        if (len(experts) * expert_bytes > self.stack_max_bytes
                or not all(type(lin) is nn.Linear for e in experts for lin in (e.w1, e.w2, e.w3))):
            return None
        weights = [lin.weight for e in experts for lin in (e.w1, e.w3, e.w2)]
        try:
            key = tuple((t.data_ptr(), t._version) for t in weights)
        except RuntimeError:                  # inference tensors have no version counter
            key = None
        cached = getattr(self, "_stack_cache", None)
        if key is not None and cached is not None and cached[0] == key:
            return cached[1]
        with torch.no_grad():
            w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in experts])
            w2 = torch.stack([e.w2.weight for e in experts])
        if key is not None:
            self._stack_cache = (key, (w13, w2))
        return w13, w2
