"""Top-k / top-p on the device in one launch: `filter_logits` turns logits into the tempered,
filtered logits that the fused sampling kernels (`fused_verify`, `fused_sample`) then read at
temperature 1, so that requests with top-k / top-p take the fused path too instead of the sort,
softmax, cumsum and scatter of `probs_from_logits`.

    y, t = filter_logits(logits, temperature, top_k, top_p)
    softmax(y / t) == probs_from_logits(logits, temperature, top_k, top_p)   (sampled rows)

Sampled rows (temperature > 0): y = logits / T (IEEE division, as torch) where the token is kept,
-inf where top-k or top-p drops it, t = 1. Greedy rows: y = logits, t = 0 (the kernels take the
argmax). Kept tokens, as `probs_from_logits` defines them (ties in rank order: lower index
first, its sort being stable):

* top-k (k > 0): the k tokens of largest tempered logit;
* top-p (p < 1), over the top-k-renormalised distribution: a token is kept while the mass ranked
  strictly before it is < p (rank 0 always).

No sort: one program per row searches thresholds over an order-preserving int32 key of the
tempered logit (-0 folded into +0), 4 bits per pass with 16 probes at once (8 passes for 32
bits): for top-k the largest key with >= k tokens at or above it; for top-p the smallest kept key
whose mass above it is < p * Z (unnormalised masses exp(y - max), Z their sum over the top-k
set), then the ties at each threshold are kept in index order (a running count across chunks).
Top-k's set equals the torch path's exactly; top-p's boundary sums run in another order than
torch's cumsum, so a token whose prefix mass is within rounding of p can go the other way (as
for the fused kernels' own sums).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dspark.kernels.decode_fused import _div

_MIN_KEY = tl.constexpr(-2147483648)      # int32 min: every key is >= it


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _key(t):
    """Order-preserving int32 key of fp32 t (as int64): t < t' <=> key < key'; -0 == +0."""
    t = tl.where(t == 0.0, 0.0, t)
    b = t.to(tl.int32, bitcast=True)
    return (b ^ ((b >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _chunk(out_row, c, V, BLOCK: tl.constexpr):
    """(tempered logits, keys, valid) of chunk c of the row already written to out_row."""
    offs = c + tl.arange(0, BLOCK)
    ok = offs < V
    t = tl.load(out_row + offs, mask=ok, other=float("-inf"))
    return t, _key(t), ok


@triton.jit
def _top_k_kept(key, ok, kappa, need_eq, seen_eq):
    """Top-k membership of one chunk: key > kappa, or key == kappa among the first need_eq such
    tokens of the row (seen_eq of them in earlier chunks); and the new seen_eq."""
    eq = ok & (key == kappa)
    rank = seen_eq + tl.cumsum(eq.to(tl.int64), 0) - 1                # 0-based among the ties
    kept = ok & ((key > kappa) | (eq & (rank < need_eq)))
    return kept, seen_eq + tl.sum(eq.to(tl.int64), 0)


@triton.jit
def _filter_kernel(logits_ptr, stride_l, out_ptr, stride_o, temp_ptr, topk_ptr, topp_ptr, teff_ptr,
                   V, HAS_K: tl.constexpr, HAS_P: tl.constexpr, EXACT: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0)
    l_row = logits_ptr + row.to(tl.int64) * stride_l
    out_row = out_ptr + row.to(tl.int64) * stride_o
    T = tl.load(temp_ptr + row)
    greedy = T <= 0
    tl.store(teff_ptr + row, tl.where(greedy, 0.0, 1.0))
    div = tl.where(greedy, 1.0, T)
    for c in range(0, V, BLOCK):                       # tempered logits (greedy rows: as-is)
        offs = c + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(l_row + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_row + offs, _div(x, div, EXACT), mask=ok)
    k = V
    if HAS_K:
        k = tl.load(topk_ptr + row).to(tl.int32)
        k = tl.where((k <= 0) | (k > V), V, k)
    p = 1.0
    if HAS_P:
        p = tl.load(topp_ptr + row).to(tl.float32)
    j16 = tl.arange(0, 16).to(tl.int64)
    if (T > 0) & ((k < V) | (p < 1.0)):
        # top-k threshold kappa: the largest key with >= k tokens at or above it
        kappa = tl.full([], _MIN_KEY, tl.int64)
        need_eq = tl.full([], V, tl.int64)
        if k < V:
            for d in tl.static_range(8):
                w = tl.full([], 1, tl.int64) << (28 - 4 * d)
                probes = kappa + j16 * w
                cnt = tl.zeros([16], dtype=tl.int64)
                for c in range(0, V, BLOCK):
                    _, key, ok = _chunk(out_row, c, V, BLOCK)
                    ge = ok[:, None] & (key[:, None] >= probes[None, :])
                    cnt += tl.sum(ge.to(tl.int64), 0)
                jb = tl.max(tl.where(cnt >= k, j16, 0), 0)             # probe 0 always holds
                kappa += jb * w
            gt = tl.zeros([], dtype=tl.int64)
            for c in range(0, V, BLOCK):
                _, key, ok = _chunk(out_row, c, V, BLOCK)
                gt += tl.sum((ok & (key > kappa)).to(tl.int64), 0)
            need_eq = k - gt
        # softmax statistics of the top-k set (its max is the row max: rank 0 is kept)
        m = tl.full([], float("-inf"), tl.float32)
        for c in range(0, V, BLOCK):
            t, _, ok = _chunk(out_row, c, V, BLOCK)
            m = tl.maximum(m, tl.max(t, 0))
        z = tl.zeros([], dtype=tl.float32)
        seen = tl.zeros([], dtype=tl.int64)
        for c in range(0, V, BLOCK):
            t, key, ok = _chunk(out_row, c, V, BLOCK)
            kept, seen = _top_k_kept(key, ok, kappa, need_eq, seen)
            z += tl.sum(tl.where(kept, tl.exp(t - m), 0.0), 0)
        # top-p: kappa_f = the largest key whose mass strictly above is still >= p * z
        pz = p * z
        star = tl.full([], _MIN_KEY, tl.int64)            # keys >= star: all kept by top-p
        mass_above = tl.zeros([], dtype=tl.float32)
        if p < 1.0:
            kf = tl.full([], _MIN_KEY, tl.int64)          # the mass above MIN_KEY is z >= pz
            for d in tl.static_range(8):
                w = tl.full([], 1, tl.int64) << (28 - 4 * d)
                probes = kf + j16 * w
                a = tl.zeros([16], dtype=tl.float32)
                seen = tl.zeros([], dtype=tl.int64)
                for c in range(0, V, BLOCK):
                    t, key, ok = _chunk(out_row, c, V, BLOCK)
                    kept, seen = _top_k_kept(key, ok, kappa, need_eq, seen)
                    e = tl.where(kept, tl.exp(t - m), 0.0)
                    a += tl.sum(tl.where(key[:, None] > probes[None, :], e[:, None], 0.0), 0)
                jb = tl.max(tl.where(a >= pz, j16, 0), 0)
                kf += jb * w
            # star = the smallest kept key above kappa_f; mass_above = the kept mass above it
            star = tl.full([], 2147483647, tl.int64)
            seen = tl.zeros([], dtype=tl.int64)
            for c in range(0, V, BLOCK):
                t, key, ok = _chunk(out_row, c, V, BLOCK)
                kept, seen = _top_k_kept(key, ok, kappa, need_eq, seen)
                star = tl.minimum(star, tl.min(tl.where(kept & (key > kf), key, 2147483647), 0))
            seen = tl.zeros([], dtype=tl.int64)
            for c in range(0, V, BLOCK):
                t, key, ok = _chunk(out_row, c, V, BLOCK)
                kept, seen = _top_k_kept(key, ok, kappa, need_eq, seen)
                mass_above += tl.sum(tl.where(kept & (key > star), tl.exp(t - m), 0.0), 0)
        # write: dropped tokens -inf; the ties at star kept in index order while the mass
        # before them stays < p * z
        seen = tl.zeros([], dtype=tl.int64)
        seen_star = tl.zeros([], dtype=tl.int64)
        for c in range(0, V, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            t, key, ok = _chunk(out_row, c, V, BLOCK)
            kept, seen = _top_k_kept(key, ok, kappa, need_eq, seen)
            tie = kept & (key == star)
            r = seen_star + tl.cumsum(tie.to(tl.int64), 0) - 1
            seen_star += tl.sum(tie.to(tl.int64), 0)
            e = tl.exp(t - m)
            before = mass_above + r.to(tl.float32) * e           # the mass ranked before a tie
            keep = kept & ((key > star) | (tie & ((r == 0) | (before < pz))))
            tl.store(out_row + offs, tl.where(keep, t, float("-inf")), mask=ok)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor,
                  top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                  block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y fp32 [N, V], t fp32 [N]) from logits [N, V] (any float dtype, unit column stride) and
    per-row temperature [N], top_k [N] (<= 0: off) / top_p [N] (>= 1: off), either may be None
    (off for every row): see the module docstring. Rows need at least one finite logit."""
    N, V = logits.shape
    dev = logits.device
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    y = torch.empty(N, V, dtype=torch.float32, device=dev)
    t_eff = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return y, t_eff
    vec = lambda t, dt: t.to(device=dev, dtype=dt).reshape(N).contiguous()  # noqa: E731
    temp = vec(temperature, torch.float32)
    k = vec(top_k, torch.int64) if top_k is not None else temp
    p = vec(top_p, torch.float32) if top_p is not None else temp
    interp = _interpreting()
    BLOCK = block or (256 if interp else 1024)
    _filter_kernel[(N,)](logits, logits.stride(0), y, y.stride(0), temp, k, p, t_eff, V,
                         HAS_K=top_k is not None, HAS_P=top_p is not None, EXACT=not interp,
                         BLOCK=BLOCK, num_warps=4)
    return y, t_eff
