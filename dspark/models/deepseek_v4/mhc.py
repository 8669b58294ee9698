"""mHC hyper-connections: n parallel residual streams mixed around every sub-block (spec §3.2).

All mixing math is fp32. `hc_pre` collapses the streams into the sub-block input and returns the
`post` weights and the Sinkhorn-normalised `comb` matrix that `hc_post` uses to expand the
sub-block output back into n streams.

Each public function dispatches: CUDA tensors go to the fused Triton kernels in
`dspark.kernels.mhc` (hc_pre: two launches instead of ~130 small ops with 20 Sinkhorn
iterations); anything else, and anything that needs gradients (the kernels have no backward),
runs the `*_reference` torch code below. `BACKEND` overrides this: "reference" forces torch
everywhere (the default with dspark.debug.REFERENCE_KERNELS), "triton" forces the kernels
everywhere (tests; CPU tensors then need TRITON_INTERPRET=1).
"""
from typing import NamedTuple

import torch

from dspark import debug

from .norm import fp32, rms_normalize

BACKENDS = ("auto", "reference", "triton")
BACKEND = "reference" if debug.REFERENCE_KERNELS else "auto"


def _kernels(*tensors):
    """The dspark.kernels.mhc module when the kernels should run on these tensors, else None."""
    if BACKEND not in BACKENDS:
        raise ValueError(f"mHC backend {BACKEND!r}: use one of {BACKENDS}")
    if BACKEND == "reference" or (BACKEND == "auto" and not tensors[0].is_cuda):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    from dspark.kernels import mhc   # imports triton: only where a kernel actually runs
    return mhc


class NextPre(NamedTuple):
    """hc_post's hint about the hc_pre (head False) / hc_head (head True) that reads its output
    next, with the arguments that call will get (the same objects: matched by identity). The
    kernels then finish that collapse (and its RMSNorm `norm`) in hc_post's own launch."""
    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    norm: object             # the RMSNorm module that reads the collapse
    hc_eps: float
    norm_eps: float
    head: bool = False


def hc_pre(X, fn, base, scale, n: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
           deferred: bool = False, norm=None):
    """Returns (u [T, D] in X.dtype, post [T, n] fp32, comb [T, n, n] fp32). deferred (the
    kernels): post / comb may still be in flight on a side stream, for a caller that only
    passes them to hc_post (which waits for them). norm: the RMSNorm module that reads u next;
    norm(u) is returned in u's place (the kernels apply it in the launch that makes u)."""
    k = _kernels(X, fn, base, scale, *(() if norm is None else (norm.weight,)))
    if k is None:
        u, post, comb = hc_pre_reference(X, fn, base, scale, n, sinkhorn_iters, hc_eps, norm_eps)
        return (u if norm is None else norm(u)), post, comb
    return k.hc_pre(X, fn, base, scale, n, sinkhorn_iters, hc_eps, norm_eps, deferred=deferred,
                    norm=norm)


def hc_expand(h: torch.Tensor, n: int, next_fn=None, ids: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The first layer's n streams: copies of the embedding h [T, D] -> [T, n, D]; with ids, h
    is the embedding table and token t's row h[ids[t]]. next_fn: the first hc_pre's fn or a
    `NextPre` (a hint, as in hc_post: the kernel then starts / finishes that collapse in the
    same launch; the result is the same)."""
    k = _kernels(h)
    if k is None:
        if ids is not None:
            h = torch.nn.functional.embedding(ids, h)
        return h.unsqueeze(1).expand(-1, n, -1).contiguous()
    return k.hc_expand(h, n, next_fn, ids)


def hc_post(o: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            next_fn=None) -> torch.Tensor:
    """X'[k] = post[k] * o + sum_j comb[j, k] * X[j]  (column k of comb feeds new stream k).

    next_fn: the fn of the hc_pre / hc_head that reads X' next, or a `NextPre` of that call (a
    hint: the kernels then start, or finish, that collapse in this launch; the result is the
    same)."""
    k = _kernels(X, o, post, comb)
    if k is None:
        return hc_post_reference(o, X, post, comb)
    return k.hc_post(o, X, post, comb, next_fn)


def hc_head(X, fn, base, scale, hc_eps: float, norm_eps: float, norm=None) -> torch.Tensor:
    """Final collapse of the streams: sigmoid-gated sum, no post/comb. Returns [T, D] (with
    `norm`, an RMSNorm module: its output, as hc_pre)."""
    k = _kernels(X, fn, base, scale, *(() if norm is None else (norm.weight,)))
    if k is None:
        u = hc_head_reference(X, fn, base, scale, hc_eps, norm_eps)
        return u if norm is None else norm(u)
    return k.hc_head(X, fn, base, scale, hc_eps, norm_eps, norm=norm)


# ---- torch reference ------------------------------------------------------------------------
def _mixes(X: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    # X [T, n, D] -> mu [T, rows]; RMS over the flattened n*D stream, then the fn projection
    flat = rms_normalize(X.flatten(1), eps)
    return flat @ fp32(fn).t()


def hc_pre_reference(X, fn, base, scale, n: int, sinkhorn_iters: int, hc_eps: float,
                     norm_eps: float):
    mu = _mixes(X, fn, norm_eps)
    base, scale = fp32(base), fp32(scale)
    pre = torch.sigmoid(scale[0] * mu[:, :n] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(scale[1] * mu[:, n:2 * n] + base[n:2 * n])
    comb = (scale[2] * mu[:, 2 * n:] + base[2 * n:]).view(-1, n, n)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    u = (pre.unsqueeze(-1) * X.float()).sum(1)
    return u.to(X.dtype), post, comb


def hc_post_reference(o, X, post, comb) -> torch.Tensor:
    mixed = torch.einsum("tjk,tjd->tkd", comb, X.float())
    return (post.unsqueeze(-1) * o.float().unsqueeze(1) + mixed).to(X.dtype)


def hc_head_reference(X, fn, base, scale, hc_eps: float, norm_eps: float) -> torch.Tensor:
    mu = _mixes(X, fn, norm_eps)
    pre = torch.sigmoid(fp32(scale)[0] * mu + fp32(base)) + hc_eps
    return (pre.unsqueeze(-1) * X.float()).sum(1).to(X.dtype)
