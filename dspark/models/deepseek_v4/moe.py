"""Mixture of experts (spec §3.8): sqrt-softplus scores, biased top-k or hash routing via
`tid2eid`, clamped SwiGLU experts in fp32, one shared expert."""
import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """SwiGLU with the asymmetric clamp: up in [-limit, limit], gate <= limit (fp32 math)."""

    def __init__(self, dim: int, inter: int, swiglu_limit: float):
        super().__init__()
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)
        self.limit = swiglu_limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        g = self.w1(x).float()
        u = self.w3(x).float()
        if self.limit > 0:
            u = u.clamp(-self.limit, self.limit)
            g = g.clamp(max=self.limit)
        h = F.silu(g) * u
        if weight is not None:               # the reference scales before w2
            h = h * weight.unsqueeze(-1)
        return self.w2(h.to(x.dtype))


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
        scores = torch.sqrt(F.softplus(F.linear(x.float(), self.weight.float())))
        if self.hash:
            idx = self.tid2eid[token_ids].long()
        else:
            idx = torch.topk(scores + self.bias.float(), self.topk, dim=-1).indices
        w = scores.gather(1, idx)
        w = w / w.sum(-1, keepdim=True)
        return idx, w * self.route_scale


class MoE(nn.Module):
    def __init__(self, cfg, hash_layer: bool):
        super().__init__()
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate = Gate(d, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                         hash_vocab=cfg.vocab_size if hash_layer else 0)
        self.experts = nn.ModuleList(Expert(d, inter, cfg.swiglu_limit)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(d, inter * cfg.n_shared_experts, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        idx, w = self.gate(x, token_ids)
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
        out += self.shared_experts(x).float()
        return out.to(x.dtype)
