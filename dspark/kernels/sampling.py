"""Speculative verification from target logits in one Triton kernel (one program per request).

The torch path (`probs_from_logits` + `verify`) launches a few hundred tiny kernels per step: the
integer hash behind `uniforms` alone is dozens of int64 elementwise ops. At small batch that
launch overhead, not the bytes, is the cost of a sampled step. `fused_verify` computes the same
thing as

    verify(draft_tokens, draft_probs,
           probs_from_logits(logits.flatten(0, 1), temperature.repeat_interleave(γ+1)).view(R, γ+1, V),
           lengths, seeds, positions)

for requests without top-k / top-p, with softmax statistics taken chunk by chunk over V:

  1. for rows i = 0, 1, ...: online max / sum of exp(logits / T) (and the argmax for greedy
     rows), then the accept test of draft i, which needs p only at the draft token; stop at the
     first rejection or after ℓ accepts, so row a (corrected or bonus) has its statistics too;
  2. over row a: total of the residual max(0, p - q) and of p;
  3. over row a again: inverse-CDF search with a running cdf carried across chunks.

`fused_sample` is the draft side: one Markov step's `probs_from_logits` + `sample_from_probs` in
one launch per step (softmax written out as q, inverse-CDF draw in the same pass).

Uniforms come from the same integer hash as `dspark.sampling.uniforms`, bit for bit. Sums run in
a different order than torch's (and on GPU exp / division are Triton's few-ulp versions), so the
corrected / bonus token can differ from the torch path only when u lands within rounding of a cdf
boundary (and an accept test only when u*q is within rounding of p): rare, and either outcome is
a correct sample.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.formats.sampling import (_M32, Q_FLOOR, RESIDUAL_EPS, Purpose, VerifyResult,
                                     _check, _mix32)

# Lowest start for the running max: finite, so a chunk of -inf logits gives exp(-inf - m) = 0
# instead of exp(-inf + inf) = nan, and below any finite tempered logit.
_MAX_FLOOR = tl.constexpr(-3.0e38)


def hash_start(purpose: int) -> int:
    """The purpose-only start state of `uniforms`' hash, a host constant as there. The formula is
    restated from `uniforms` (which keeps it inline); test_hash_is_bit_identical_to_uniforms
    fails if the two drift apart."""
    return _mix32(_mix32((0x9E3779B9 * (int(purpose) + 1)) & _M32))


@triton.jit
def _mix32_jit(x):
    # `dspark.formats.sampling._mix32` in int64: inputs < 2**32 and multipliers < 2**31, so
    # every product fits in int64 exactly and the results match torch's bit for bit.
    m32 = tl.full([], 0xFFFFFFFF, tl.int64)
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & m32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & m32
    return x ^ (x >> 15)


@triton.jit
def _uniform(start, seed, position):
    """`uniforms(seed, position, purpose)` for int64 seed / position, start = hash_start(purpose)."""
    m32 = tl.full([], 0xFFFFFFFF, tl.int64)
    h = _mix32_jit(start ^ (seed & m32))
    h = _mix32_jit(h ^ ((seed >> 32) & m32))
    h = _mix32_jit(h ^ ((position >> 32) & m32))
    h = _mix32_jit(h ^ (position & m32))
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _row_stats(row_ptr, stride_v, V, t, BLOCK_V: tl.constexpr):
    """(max, sum of exp(x - max)) of x = logits / t over one row, and the first argmax of the raw
    logits (what `probs_from_logits` puts the one-hot of a greedy row on)."""
    m = tl.full([], _MAX_FLOOR, tl.float32)
    s = tl.zeros([], tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.zeros([], tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        ok = offs < V
        logit = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=ok, other=float("-inf"))
        logit = logit.to(tl.float32)
        chunk_best = tl.max(logit, 0)
        chunk_idx = tl.min(tl.where(logit == chunk_best, offs, V), 0)
        # strictly greater: an equal maximum in a later chunk keeps the first index
        best_idx = tl.where(chunk_best > best, chunk_idx, best_idx)
        best = tl.maximum(best, chunk_best)
        x = logit / t
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    return m, s, best_idx


@triton.jit
def _dist_chunk(row_ptr, stride_v, q_row_ptr, offs, V, resid_end, t, m, s, x_a,
                HAS_Q: tl.constexpr):
    """p = softmax(logits / t) (0 past V) and the residual max(0, p - q) on one chunk of row a;
    the residual is 0 from index resid_end on (V: all of it, 0: none). q is the draft row, or a
    point mass at x_a without HAS_Q."""
    # one comparison against a bound instead of `mask & scalar_flag`: Triton's interpreter
    # rejects masks broadcast from a scalar
    ok = offs < V
    in_resid = offs < resid_end
    logit = tl.load(row_ptr + offs.to(tl.int64) * stride_v, mask=ok, other=float("-inf"))
    p = tl.exp(logit.to(tl.float32) / t - m) / s
    if HAS_Q:
        q = tl.load(q_row_ptr + offs, mask=in_resid, other=0.0)
    else:
        q = tl.where(offs == x_a, 1.0, 0.0)
    resid = tl.where(in_resid, tl.maximum(p - q, 0.0), 0.0)
    return p, resid


@triton.jit
def _cdf_chunk(w, positive, offs, V, target, carry, first, last_positive):
    """One chunk of an inverse-CDF search over weights w (running sum `carry` from the chunks
    before): the first index whose cdf exceeds `target` among `positive` entries, and the last
    positive index (the fallback when rounding leaves the total below target)."""
    cdf = carry + tl.cumsum(w, 0)
    first = tl.minimum(first, tl.min(tl.where((cdf > target) & positive, offs, V), 0))
    last_positive = tl.maximum(last_positive, tl.max(tl.where(positive, offs, -1), 0))
    return carry + tl.sum(w, 0), first, last_positive


@triton.jit
def _fused_verify_kernel(
        tok_ptr, stride_tok_r,
        q_ptr, stride_q_r, stride_q_i,
        logit_ptr, stride_l_r, stride_l_i, stride_l_v,
        temp_ptr, len_ptr, seed_ptr, pos_ptr,
        acc_out_ptr, next_out_ptr,
        V, G, accept_start, residual_start,
        Q_FLOOR: tl.constexpr, RESIDUAL_EPS: tl.constexpr,
        HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + r)
    greedy = temp <= 0
    t = tl.where(greedy, 1.0, temp)     # probs_from_logits divides greedy rows by 1 too
    ell = tl.load(len_ptr + r).to(tl.int32)
    seed = tl.load(seed_ptr + r)
    anchor = tl.load(pos_ptr + r)
    logits_r = logit_ptr + r * stride_l_r

    # 1. accept tests, row by row; (m, s, argmax) always describe row a when the loop ends
    a = tl.zeros([], tl.int32)
    m, s, am = _row_stats(logits_r, stride_l_v, V, t, BLOCK_V)
    go = ell > 0
    while go:
        row_i = logits_r + a * stride_l_i
        x = tl.load(tok_ptr + r * stride_tok_r + a)
        if greedy:
            px = tl.where(x == am, 1.0, 0.0)
        else:
            px = tl.exp(tl.load(row_i + x * stride_l_v).to(tl.float32) / t - m) / s
        if HAS_Q:
            qx = tl.maximum(tl.load(q_ptr + r * stride_q_r + a * stride_q_i + x), Q_FLOOR)
        else:
            qx = 1.0
        u = _uniform(accept_start, seed, anchor + 1 + a)
        accepted = u * qx < px      # u < min(1, p/q) without dividing by a tiny q
        if accepted:
            a += 1
            m, s, am = _row_stats(logits_r + a * stride_l_i, stride_l_v, V, t, BLOCK_V)
        go = accepted & (a < ell)
    tl.store(acc_out_ptr + r, a.to(tl.int64))

    # 2./3. the extra token from row a. A greedy row's p is one-hot, so both its residual and p
    # put all mass on the argmax: no pass needed.
    y = am.to(tl.int64)
    if temp > 0:
        row_ptr = logits_r + a * stride_l_i
        resid_on = a < ell
        resid_end = tl.where(resid_on, V, 0)
        qi = tl.minimum(a, G - 1)       # the rejected draft's row (unused after full acceptance)
        q_row_ptr = q_ptr + r * stride_q_r + qi * stride_q_i
        x_a = tl.load(tok_ptr + r * stride_tok_r + qi)
        total_p = tl.zeros([], tl.float32)
        total_r = tl.zeros([], tl.float32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            p, resid = _dist_chunk(row_ptr, stride_l_v, q_row_ptr, offs, V, resid_end, t, m,
                                   s, x_a, HAS_Q)
            total_p += tl.sum(p, 0)
            total_r += tl.sum(resid, 0)
        use_resid = resid_on & (total_r > RESIDUAL_EPS)
        u = _uniform(residual_start, seed, anchor + 1 + a)
        target = u * tl.where(use_resid, total_r, total_p)
        # first index whose cdf > target among positive entries; else the last positive one
        carry = tl.zeros([], tl.float32)
        first = tl.full([], V, tl.int32)
        last_positive = tl.full([], -1, tl.int32)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            p, resid = _dist_chunk(row_ptr, stride_l_v, q_row_ptr, offs, V, resid_end, t, m,
                                   s, x_a, HAS_Q)
            w = tl.where(use_resid, resid, p)
            carry, first, last_positive = _cdf_chunk(w, w > 0, offs, V, target, carry, first,
                                                     last_positive)
        y = tl.where(first < V, first, last_positive).to(tl.int64)
    tl.store(next_out_ptr + r, y)


def _as(v: torch.Tensor, dtype, device, shape=None) -> torch.Tensor:
    """v as a contiguous `dtype` tensor on `device` (of `shape` when given); v itself when it is
    one already (the conversions cost host time even as no-ops, and this runs every round)."""
    if (v.dtype == dtype and v.device == device and v.is_contiguous()
            and (shape is None or v.shape == shape)):
        return v
    v = v.to(device=device, dtype=dtype)
    return (v if shape is None else v.reshape(shape)).contiguous()


def fused_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 target_logits: torch.Tensor, temperature: torch.Tensor, lengths: torch.Tensor,
                 seeds: torch.Tensor, positions: torch.Tensor,
                 block_v: int | None = None) -> VerifyResult:
    """`verify` on `probs_from_logits(target_logits, temperature)` (no top-k / top-p), fused.
    Shapes: draft_tokens int64 [R, γ]; draft_probs fp32 [R, γ, V], or None when every draft is a
    point mass at its token (greedy drafts); target_logits [R, γ+1, V], any float dtype, any
    strides; temperature [R] (<= 0: greedy target row); lengths [R] in 0..γ; seeds, positions
    int64 [R] (anchor positions). block_v: V chunk per loop step (a power of two). No host sync."""
    _check(draft_tokens, target_logits, lengths)
    R, G = draft_tokens.shape
    V = target_logits.shape[2]
    dev = target_logits.device
    x = _as(draft_tokens, torch.int64, dev)
    q = None
    if draft_probs is not None:
        if draft_probs.shape != (R, G, V):
            raise ValueError(f"draft_probs must be [R, γ, V] = [{R}, {G}, {V}], "
                             f"got {tuple(draft_probs.shape)}")
        q = _as(draft_probs, torch.float32, dev)
    temp = _as(temperature, torch.float32, dev, (R,))
    lens, seeds = _as(lengths, torch.int64, dev, (R,)), _as(seeds, torch.int64, dev, (R,))
    positions = _as(positions, torch.int64, dev, (R,))
    accepted = torch.empty(R, dtype=torch.int64, device=dev)
    next_token = torch.empty(R, dtype=torch.int64, device=dev)
    if R == 0:
        return VerifyResult(accepted, next_token)
    if block_v is None:
        block_v = min(triton.next_power_of_2(V), 4096)
    q_arg = q if q is not None else x       # never read without HAS_Q
    q_strides = q.stride()[:2] if q is not None else (0, 0)
    _fused_verify_kernel[(R,)](
        x, x.stride(0), q_arg, q_strides[0], q_strides[1],
        target_logits, *target_logits.stride(),
        temp, lens, seeds, positions, accepted, next_token,
        V, G, hash_start(Purpose.ACCEPT), hash_start(Purpose.RESIDUAL),
        Q_FLOOR=Q_FLOOR, RESIDUAL_EPS=RESIDUAL_EPS, HAS_Q=q is not None, BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4)
    return VerifyResult(accepted, next_token)


@triton.jit
def _fused_sample_kernel(logit_ptr, stride_l_n, stride_l_v, temp_ptr, u_ptr, probs_ptr, tok_ptr, V,
                         BLOCK_V: tl.constexpr):
    """Row n: q = softmax(logits / T) written to probs[n] (one-hot at the first argmax when
    T <= 0), token = first index whose running sum of exp(logits / T - m) exceeds u * s among
    entries with q > 0 (else the last such entry), s the row's normaliser from pass 1."""
    n = tl.program_id(0).to(tl.int64)
    temp = tl.load(temp_ptr + n)
    greedy = temp <= 0
    t = tl.where(greedy, 1.0, temp)
    row = logit_ptr + n * stride_l_n
    m, s, am = _row_stats(row, stride_l_v, V, t, BLOCK_V)
    target = tl.load(u_ptr + n) * s
    carry = tl.zeros([], tl.float32)
    first = tl.full([], V, tl.int32)
    last_positive = tl.full([], -1, tl.int32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        ok = offs < V
        logit = tl.load(row + offs.to(tl.int64) * stride_l_v, mask=ok, other=float("-inf"))
        e = tl.exp(logit.to(tl.float32) / t - m)                 # 0 past V
        q = tl.where(greedy, tl.where(offs == am, 1.0, 0.0), e / s)
        tl.store(probs_ptr + n * V + offs, q, mask=ok)
        # the draw uses the unnormalised weights against u * s (same law as q); a token is
        # eligible only where the stored q is positive, so verify never sees q = 0 at a draft
        carry, first, last_positive = _cdf_chunk(e, q > 0, offs, V, target, carry, first,
                                                 last_positive)
    y = tl.where(first < V, first, last_positive)
    tl.store(tok_ptr + n, tl.where(greedy, am, y).to(tl.int64))


@triton.jit
def _uniforms_kernel(seed_ptr, pos_ptr, out_ptr, n, start, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    seed = tl.load(seed_ptr + offs, mask=ok, other=0)
    pos = tl.load(pos_ptr + offs, mask=ok, other=0)
    tl.store(out_ptr + offs, _uniform(start, seed, pos), mask=ok)


def uniforms_triton(seeds: torch.Tensor, positions: torch.Tensor, purpose: int) -> torch.Tensor:
    """`dspark.sampling.uniforms(seeds, positions, purpose)` bit for bit (broadcast int64 tensors
    of one device) in one launch instead of ~50 small integer kernels."""
    seeds, positions = torch.broadcast_tensors(seeds.to(torch.int64), positions.to(torch.int64))
    shape = seeds.shape
    seeds, positions = seeds.contiguous().view(-1), positions.contiguous().view(-1)
    out = torch.empty(seeds.shape, dtype=torch.float32, device=seeds.device)
    n = out.numel()
    if n:
        _uniforms_kernel[(triton.cdiv(n, 256),)](seeds, positions, out, n, hash_start(purpose),
                                                 BLOCK=256, num_warps=4)
    return out.view(shape)


def fused_sample(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                 block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q fp32 [N, V], tokens int64 [N]) = (probs_from_logits(logits, temperature),
    sample_from_probs(q, u)) without top-k / top-p, fused: logits [N, V] any float dtype, any
    row stride; temperature [N] (<= 0: one-hot at the first argmax); u [N] in [0, 1). The token
    equals the torch path's except when u lands within rounding of a cdf boundary. No host sync."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    N, V = logits.shape
    dev = logits.device
    temp = temperature.to(device=dev, dtype=torch.float32).reshape(N).contiguous()
    u = u.to(device=dev, dtype=torch.float32).reshape(N).contiguous()
    probs = torch.empty(N, V, dtype=torch.float32, device=dev)
    tokens = torch.empty(N, dtype=torch.int64, device=dev)
    if N == 0:
        return probs, tokens
    if block_v is None:
        block_v = min(triton.next_power_of_2(V), 4096)
    _fused_sample_kernel[(N,)](logits, logits.stride(0), logits.stride(1), temp, u, probs, tokens,
                               V, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4)
    return probs, tokens


__all__ = ["fused_sample", "fused_verify", "hash_start", "uniforms_triton"]
