"""Fused mHC hyper-connection kernels (spec §3.2): `hc_pre`, `hc_post` and `hc_head` in one or
two launches each, for any number of tokens T.

Same contract and fp32 math as the torch reference in ``dspark.models.deepseek_v4.mhc`` (which
dispatches here for CUDA tensors); ``n`` streams of width ``D``, ``K = n·D``:

    mu   = rms_normalize(X.flatten(1)) @ fnᵀ                          [T, R]  R = (2+n)·n or n
    pre  = sigmoid(scale[0]·mu[:, :n] + base[:n]) + hc_eps            [T, n]
    post = 2·sigmoid(scale[1]·mu[:, n:2n] + base[n:2n])               [T, n]
    comb = Sinkhorn(softmax_rows(scale[2]·mu[:, 2n:] + base[2n:]) + hc_eps)   [T, n, n]
    u    = Σ_i pre_i · X_i                                            [T, D]  (X.dtype)
    X'_k = post_k · o + Σ_j comb_jk · X_j                             (hc_post, X.dtype)

Launch 1 (`_mix_partials`): split-K over the flattened stream. Program (token block, K chunk)
accumulates Σ x·fnᵀ for its chunk with an exact fp32 ('ieee') dot, plus Σ x² — the RMS factor
is a per-token scalar, so it is applied to the finished dot products instead of to x
(mathematically the reference's normalise-then-project; only rounding differs, ~1e-7 relative).
Splitting K (up to 128 chunks) keeps the SMs busy at T = 1, where the cost is streaming fn (R·K
fp32); at large T the token blocks supply the parallelism and fewer, longer chunks are used.
Launch 2 (`_finish_pre`): program (token, D block) reduces the partials, applies the RMS factor,
the sigmoids, and collapses its D block of u. The Sinkhorn normalisation of the n×n comb runs in
registers by the D-block-0 program only (the others need `pre` alone), in the reference's order:
softmax over rows, + eps, column-normalise, then (iters − 1) × (row-, column-normalise).
Given the RMSNorm that reads u next (the model's attn_norm / ffn_norm / final norm) and few
tokens, one program per token makes u and normalises it (`norm_fusable`): one launch fewer per
sub-block.
`hc_post` is one launch: program (token, D block) writes all n output streams of its block.
Given the fn of the hc_pre / hc_head that reads its output next (``next_fn``, up to
POST_NEXT_MAX_T tokens), that launch also computes the next projection's split-K partials of its
block (split = D block) and leaves them on the output tensor; that hc_pre then starts at launch
2. In a decode step every hc_pre but the first follows an hc_post: 8 launches fewer for 4 layers.
Given a `NextPre` hint instead (the whole next call: fn, base, scale, its RMSNorm; the model's
blocks pass them), the program of each token that arrives last (an arrival counter, as the split-K
GEMVs use) then finishes that hc_pre / hc_head itself, u and its norm (launch 2's NORM form), and
the hc_pre only queues the Sinkhorn launch on its side lane: one launch fewer per sub-block again.
`hc_expand(table, n, hint, ids=)` does the same for the first layer with the embedding lookup in
its loads. H200 (benchmarks/results/bench_decode_mhc_finish_ab_h200.json, 4-layer V4-Flash
decode graph): the hc_post launch with the finish 6.0-6.6 us where hc_post + launch 2 took 2.8 +
3.3 us (+ a gap), device time per step 0.765 vs 0.768 ms with launch 2 of its own; the
embedding's own kernel (2.6 us) is gone. The finish is one program's serial tail (an acq_rel
arrival, then the streams' loads from L2 and two row reductions): most of what the launch saved.

bf16 outputs are rounded to nearest even by bit arithmetic (as in cache_write) so the interpreter,
whose float down-cast does not round correctly, gives the same bytes as the GPU.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dspark.cuda import pdl
from dspark.kernels import invariant
from dspark.kernels.cache_write import _bf16_round
from dspark.kernels.fp8_gemm import _arrival_counters
from dspark.cuda import side_stream

# launch 1 aims at ~256 programs (H200: 132 SMs) split between token blocks and K chunks
_TARGET_PROGRAMS = 256
_MAX_SPLITS = 128
_BLOCK_K = 64
_BLOCK_D = 256


@triton.jit
def _store_rounded(ptr, value, mask, OUT_BF16: tl.constexpr):
    if OUT_BF16:            # exact in bf16 afterwards, so the store's cast only truncates zeros
        value = _bf16_round(value)
    tl.store(ptr, value, mask=mask)


@triton.jit
def _mix_partials(x_ptr, fn_ptr, part_ptr, sq_ptr, T, K, R, CHUNK,
                  BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """part[s, t, r] = Σ_{k in chunk s} x[t, k]·fn[r, k];  sq[s, t] = Σ_{k in chunk s} x[t, k]²."""
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    r = tl.arange(0, BLOCK_R)
    t_ok = t < T
    r_ok = r < R
    acc = tl.zeros([BLOCK_T, BLOCK_R], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    k0 = pid_s * CHUNK
    for kk in range(0, CHUNK, BLOCK_K):
        k = k0 + kk + tl.arange(0, BLOCK_K)
        k_ok = k < K
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=t_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + r[:, None] * K + k[None, :], mask=r_ok[:, None] & k_ok[None, :],
                    other=0.0).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    row = pid_s * T + t
    tl.store(part_ptr + row[:, None] * BLOCK_R + r[None, :], acc, mask=t_ok[:, None])
    tl.store(sq_ptr + row, sq, mask=t_ok)


@triton.jit
def _pre_weights(part_ptr, sq_ptr, base_ptr, scale_ptr, t, T, S, K, norm_eps, hc_eps,
                 N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                 BLOCK_R: tl.constexpr, CACHE: tl.constexpr):
    """(pre [BLOCK_N] (0 past N), the RMS factor) of token t from its split-K partials; CACHE:
    the partials' load cache modifier (".cg" where other programs of this launch stored them)."""
    s = tl.arange(0, BLOCK_S)
    i = tl.arange(0, BLOCK_N)
    s_ok = s < S
    i_ok = i < N
    rows = (s * T + t) * BLOCK_R                                   # [BLOCK_S] partial rows
    sq = tl.sum(tl.load(sq_ptr + s * T + t, mask=s_ok, other=0.0, cache_modifier=CACHE), axis=0)
    inv_rms = tl.math.rsqrt(sq / K + norm_eps)
    pre_dot = tl.sum(tl.load(part_ptr + rows[:, None] + i[None, :],
                             mask=s_ok[:, None] & i_ok[None, :], other=0.0,
                             cache_modifier=CACHE), axis=0)
    pre = tl.sigmoid(tl.load(scale_ptr) * (pre_dot * inv_rms)
                     + tl.load(base_ptr + i, mask=i_ok, other=0.0)) + hc_eps
    return tl.where(i_ok, pre, 0.0), inv_rms


@triton.jit
def _store_u(u_ptr, x, pre, nw, t, d, d_ok, D, rms_eps, NORM: tl.constexpr,
             OUT_BF16: tl.constexpr):
    """u = Σ_i pre_i · x_i over the streams' block x [BLOCK_N, BLOCK_D] (fp32); NORM (x holds
    the whole row): RMSNorm(u) with the weight nw instead, as the model's RMSNorm computes it
    from the rounded u (norm_rope's op order: v · rsqrt(mean(v²) + eps) · w, rounded once)."""
    u = tl.sum(pre[:, None] * x, axis=0)
    if NORM:
        if OUT_BF16:
            u = _bf16_round(u)                  # the u the RMSNorm would read
        u = u * tl.math.rsqrt(tl.sum(u * u, axis=0) / D + rms_eps)   # (masked columns: 0)
        u = u * nw
    _store_rounded(u_ptr + t * D + d, u, d_ok, OUT_BF16)


@triton.jit
def _finish_pre(x_ptr, part_ptr, sq_ptr, base_ptr, scale_ptr, u_ptr, post_ptr, comb_ptr,
                T, D, S, K, norm_eps, hc_eps, sinkhorn_iters, nw_ptr, rms_eps,
                N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HEAD: tl.constexpr,
                OUT_BF16: tl.constexpr, U: tl.constexpr = True, NORM: tl.constexpr = False):
    """Reduce the split-K partials of token t, then u (its D block; unless not U) and, unless
    HEAD, post/comb (by the D-block-0 program). NORM (one program per token, BLOCK_D >= D):
    store RMSNorm(u) with the weight at nw_ptr instead of u, as the model's RMSNorm computes it
    from the rounded u (norm_rope's op order: v · rsqrt(mean(v²) + eps) · w, rounded once)."""
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    i = tl.arange(0, BLOCK_N)
    s_ok = s < S
    i_ok = i < N
    nw = 0.0
    if U:
        # the streams' block (and the norm weight) first: they depend on nothing here, so their
        # loads overlap the partials' instead of following the reductions (as in `_post`)
        d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        d_ok = d < D
        x = tl.load(x_ptr + (t * N + i[:, None]) * D + d[None, :],
                    mask=i_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        if NORM:
            nw = tl.load(nw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    pre, inv_rms = _pre_weights(part_ptr, sq_ptr, base_ptr, scale_ptr, t, T, S, K, norm_eps,
                                hc_eps, N, BLOCK_N, BLOCK_S, BLOCK_R, "")
    if U:
        _store_u(u_ptr, x, pre, nw, t, d, d_ok, D, rms_eps, NORM, OUT_BF16)

    if not HEAD:
        rows = (s * T + t) * BLOCK_R                               # [BLOCK_S] partial rows
        if pid_d == 0:
            post_dot = tl.sum(tl.load(part_ptr + rows[:, None] + N + i[None, :],
                                      mask=s_ok[:, None] & i_ok[None, :], other=0.0), axis=0)
            post = 2 * tl.sigmoid(tl.load(scale_ptr + 1) * (post_dot * inv_rms)
                                  + tl.load(base_ptr + N + i, mask=i_ok, other=0.0))
            tl.store(post_ptr + t * N + i, post, mask=i_ok)

            # comb[i, j] = mixes row 2N + i·N + j; partial tile [BLOCK_S, BLOCK_N, BLOCK_N]
            ij = i[:, None] * N + i[None, :]
            ij_ok = i_ok[:, None] & i_ok[None, :]
            comb_dot = tl.sum(tl.load(part_ptr + rows[:, None, None] + 2 * N + ij[None, :, :],
                                      mask=s_ok[:, None, None] & ij_ok[None, :, :], other=0.0),
                              axis=0)
            c = (tl.load(scale_ptr + 2) * (comb_dot * inv_rms)
                 + tl.load(base_ptr + 2 * N + ij, mask=ij_ok, other=0.0))
            c = tl.where(ij_ok, c, float("-inf"))
            # padded rows are all -inf: pivot 0 and divisor 1 keep them at exactly 0, not NaN
            row_max = tl.where(i_ok, tl.max(c, axis=1), 0.0)
            c = tl.exp(c - row_max[:, None])
            c = c / tl.where(i_ok, tl.sum(c, axis=1), 1.0)[:, None]
            c = tl.where(ij_ok, c + hc_eps, 0.0)                      # padding stays 0
            c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
            for _ in range(sinkhorn_iters - 1):
                c = c / (tl.sum(c, axis=1)[:, None] + hc_eps)
                c = c / (tl.sum(c, axis=0)[None, :] + hc_eps)
            tl.store(comb_ptr + t * N * N + ij, c, mask=ij_ok)


@triton.jit
def _post(o_ptr, x_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, part_ptr, sq_ptr, T, D, R,
          ids_ptr, base_ptr, scale_ptr, u_ptr, nw_ptr, cnt_ptr, S, norm_eps, hc_eps, rms_eps,
          N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, OUT_BF16: tl.constexpr,
          NEXT: tl.constexpr, BLOCK_R: tl.constexpr, EXPAND: tl.constexpr = False,
          GATHER: tl.constexpr = False, FINISH: tl.constexpr = False,
          BLOCK_S: tl.constexpr = 1, BLOCK_DF: tl.constexpr = 1, PDL: tl.constexpr = False):
    """out[t, k, d] = post[t, k]·o[t, d] + Σ_j comb[t, j, k]·X[t, j, d] for one D block
    (EXPAND: out[t, k, d] = o[t, d], the first layer's n copies of the embedding; X, post and
    comb unread; GATHER: o's row of token t is ids[t], the embedding table's row).

    NEXT: also this block's split-K partials of the next hc_pre / hc_head projection of the
    output (as stored), laid out as `_mix_partials` leaves them with split s = the D block:
    part[s, t, r] = Σ_{k, d in block} out[t, k, d]·fn[r, k·D + d], sq[s, t] = Σ out².
    FINISH (NEXT, BLOCK_DF >= D): the token's program that arrives last (counter cnt[t]) then
    also finishes that hc_pre / hc_head as `_finish_pre` (HEAD, NORM) would: pre from all the
    partials, u and its RMSNorm (weight nw, eps rms_eps) into u_ptr [T, D].
    PDL (FINISH): the GEMV that reads u may start (fetching its weights) now."""
    pdl.launch_dependents(PDL)
    t = tl.program_id(0)
    pid_d = tl.program_id(1)
    k = tl.arange(0, BLOCK_N)
    k_ok = k < N
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    ok = k_ok[:, None] & d_ok[None, :]
    if NEXT:
        # fn's block first: it depends on nothing, so its loads overlap the ones below (issued
        # after the store of `out` they would wait for it: one more memory round trip)
        r = tl.arange(0, BLOCK_R)
        w = tl.load(fn_ptr + r[:, None, None] * (N * D) + k[None, :, None] * D + d[None, None, :],
                    mask=(r < R)[:, None, None] & ok[None, :, :], other=0.0).to(tl.float32)
    o_row = t
    if GATHER:
        o_row = tl.load(ids_ptr + t)
    o = tl.load(o_ptr + o_row * D + d, mask=d_ok, other=0.0).to(tl.float32)
    if EXPAND:
        out = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32) + o[None, :]
    else:
        post = tl.load(post_ptr + t * N + k, mask=k_ok, other=0.0)
        mixed = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for j in tl.static_range(N):             # the reference einsum's sum over j, in order
            xj = tl.load(x_ptr + (t * N + j) * D + d, mask=d_ok, other=0.0).to(tl.float32)
            cj = tl.load(comb_ptr + (t * N + j) * N + k, mask=k_ok, other=0.0)
            mixed += cj[:, None] * xj[None, :]
        out = post[:, None] * o[None, :] + mixed
    if OUT_BF16:            # exact in bf16 afterwards, so the store's cast only truncates zeros
        out = _bf16_round(out)
    tl.store(out_ptr + (t * N + k[:, None]) * D + d[None, :], out, mask=ok)
    if NEXT:
        out = tl.where(ok, out, 0.0)
        part = tl.sum(tl.sum(w * out[None, :, :], axis=2), axis=1)            # [BLOCK_R]
        row = pid_d * T + t
        tl.store(part_ptr + row * BLOCK_R + r, part)
        tl.store(sq_ptr + row, tl.sum(tl.sum(out * out, axis=1), axis=0))
        if FINISH:
            tl.debug_barrier()                     # this program's stores before its arrival
            if tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu") == \
                    tl.num_programs(1) - 1:        # the token's streams are complete
                df = tl.arange(0, BLOCK_DF)
                df_ok = df < D
                # .cg: the streams and partials were stored by this launch's other programs
                xs = tl.load(out_ptr + (t * N + k[:, None]) * D + df[None, :],
                             mask=k_ok[:, None] & df_ok[None, :], other=0.0,
                             cache_modifier=".cg").to(tl.float32)
                nw = tl.load(nw_ptr + df, mask=df_ok, other=0.0).to(tl.float32)
                pre, _ = _pre_weights(part_ptr, sq_ptr, base_ptr, scale_ptr, t, T, S, N * D,
                                      norm_eps, hc_eps, N, BLOCK_N, BLOCK_S, BLOCK_R, ".cg")
                _store_u(u_ptr, xs, pre, nw, t, df, df_ok, D, rms_eps, True, OUT_BF16)
                tl.atomic_xchg(cnt_ptr + t, 0, sem="relaxed", scope="gpu")   # re-arm


def _mixes(X: torch.Tensor, fn: torch.Tensor):
    """Launch 1. Returns (partials [S, T, BLOCK_R] fp32, sum-of-squares partials [S, T], S, BLOCK_R)."""
    T, n, D = X.shape
    K, R = n * D, fn.shape[0]
    assert fn.shape == (R, K), f"fn {tuple(fn.shape)} does not match X {tuple(X.shape)}"
    fixed = invariant.on()                 # batch-invariant: tiles and splits of K alone
    BLOCK_T = 16 if T <= 128 or fixed else 64   # tl.dot needs ≥ 16 rows; larger T re-reads fn less
    BLOCK_R = max(16, triton.next_power_of_2(R))
    t_programs = 1 if fixed else triton.cdiv(T, BLOCK_T)
    splits = max(1, min(triton.cdiv(_TARGET_PROGRAMS, t_programs), _MAX_SPLITS,
                        triton.cdiv(K, _BLOCK_K)))
    t_programs = triton.cdiv(T, BLOCK_T)
    chunk = triton.cdiv(triton.cdiv(K, splits), _BLOCK_K) * _BLOCK_K
    S = triton.cdiv(K, chunk)
    part = torch.empty(S, T, BLOCK_R, dtype=torch.float32, device=X.device)
    sq = torch.empty(S, T, dtype=torch.float32, device=X.device)
    _mix_partials[(t_programs, S)](X, fn, part, sq, T, K, R, chunk,
                                   BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R, BLOCK_K=_BLOCK_K)
    return part, sq, S, BLOCK_R


def norm_fusable(X: torch.Tensor, norm) -> bool:
    """Whether the u launch also applies the RMSNorm `norm` that reads u next (few tokens, D up
    to 8192: one program holds a token's whole row)."""
    return (norm is not None and X.shape[0] <= post_next_max_t() and X.shape[2] <= 8192
            and norm.weight.shape == (X.shape[2],) and norm.weight.is_contiguous()
            and norm.weight.device == X.device)


def _collapse(X, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters, head: bool,
              deferred: bool = False, norm=None):
    """(u, post, comb); with `norm` (an RMSNorm module): (norm(u), post, comb), the norm in the
    u launch when `norm_fusable`. Not deferred (and not head) the one launch stays as tuned for
    the Sinkhorn chain, and the norm runs after it."""
    T, n, D = X.shape
    fuse = norm_fusable(X, norm) and (head or deferred)
    done = _finished_left_on(X, fn, base, scale, norm, head) if fuse else None
    left = _partials_left_on(X, fn)
    X, fn = X.contiguous(), fn.contiguous()
    u = done if done is not None else torch.empty(T, D, dtype=X.dtype, device=X.device)
    post = torch.empty(T, n, dtype=torch.float32, device=X.device)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=X.device)
    if T == 0:
        return u, post, comb
    part, sq, S, BLOCK_R = left if left is not None else _mixes(X, fn)
    block_d, warps = FINISH_LAUNCH[T <= post_next_max_t()]
    block_d = min(block_d, triton.next_power_of_2(D))
    base, scale = base.float().contiguous(), scale.float().contiguous()
    args = (X, part, sq, base, scale, u, post, comb, T, D, S, n * D, norm_eps, hc_eps,
            sinkhorn_iters, norm.weight if fuse else base, float(norm.eps) if fuse else 0.0)
    meta = dict(N=n, BLOCK_N=triton.next_power_of_2(n), BLOCK_S=triton.next_power_of_2(S),
                BLOCK_R=BLOCK_R, BLOCK_D=block_d, OUT_BF16=X.dtype == torch.bfloat16,
                num_warps=warps)
    if fuse and done is None:       # (done: hc_post's launch made them, a NextPre hint)
        # u and its RMSNorm: one program per token over the whole row
        _finish_pre[(T, 1)](*args, HEAD=True, NORM=True,
                            **dict(meta, BLOCK_D=triton.next_power_of_2(D), num_warps=NORM_WARPS))
    if fuse:
        if not head:                    # post / comb on the side lane, as below
            _sinkhorn_aside(X, args, meta, post, part, sq, base, scale, comb)
        return u, post, comb
    if head or not deferred:
        # one launch: u, and (not head) post / comb by each token's D-block-0 program
        _finish_pre[(T, triton.cdiv(D, block_d))](*args, HEAD=head, **meta)
    else:
        # deferred (what the model's blocks ask for): u (what the
        # sub-block needs now) alone, then post / comb (the Sinkhorn chain, read by hc_post at
        # the sub-block's end) by one more program per token on a side stream that hc_post
        # joins (side_stream.py: inline off CUDA), so the decode step waits for u only (the
        # Sinkhorn iterations were the launch's long pole)
        _finish_pre[(T, triton.cdiv(D, block_d))](*args, HEAD=True, **meta)
        _sinkhorn_aside(X, args, meta, post, part, sq, base, scale, comb)
    return (u if norm is None else norm(u)), post, comb


def _sinkhorn_aside(X, args, meta, post, part, sq, base, scale, comb):
    """post / comb by one program per token on the Sinkhorn side lane, which hc_post joins."""
    T = X.shape[0]
    side = side_stream.fork(X.device, _SINKHORN_LANE)
    with side_stream.on(side):
        _finish_pre[(T, 1)](*args, HEAD=False, U=False, **meta)
    if side is not None:
        # what the side launch reads stays referenced until hc_post has joined it: freed
        # earlier, the allocator could hand a block to a main-stream tensor while the side
        # launch still reads it (in a CUDA graph a fixed overlap: the partials _mixes made
        # for T > POST_NEXT_MAX_T were freed at return, and on the H200 a verify step's
        # graph replay then differed from eager, rel. error 0.28)
        setattr(post, _SIDE, (side, (X, part, sq, base, scale, comb)))


# the fused u + RMSNorm launch: one program holds a token's n x D streams. H200 (8 warps): 3.3 us where the u launch (1.7 us) and the RMSNorm launch (2.9 us) ran one after
# the other; 0.924 vs 0.926 ms device time per decode step (16 warps 0.914, 4 warps 0.920 ms
# against 0.913 in the same call: noise).
NORM_WARPS = 8


_SINKHORN_LANE = 5
_SIDE = "_dspark_mhc_side"     # (side stream still writing post / comb, what it reads)


# hc_pre(deferred=True) runs the Sinkhorn launch on a side stream. H200, decode graph device
# time per step: 0.953 ms inline, 0.937 on the side lane.


# `_finish_pre` launch (BLOCK_D, num_warps) for few tokens (True) / more (False). The Sinkhorn
# iterations of the D-block-0 program are a serial chain of tiny n x n reductions: with one
# warp they stay inside it (shuffles, no shared-memory round trips), which is what a decode step
# waits for. H200, `python benchmarks/bench_mhc.py --finish-sweep` (T = 1, D = 4096, hc_post
# leaving the partials + hc_pre, graph µs per pair): 1 warp 7.3, 2 warps 8.5, 4 warps 9.2-10.1
# at BLOCK_D 128 / 256 / 512 alike (15.3 without the partials).
FINISH_LAUNCH = {True: (_BLOCK_D, 1), False: (_BLOCK_D, 4)}


# hc_post(..., next_fn) computes the next projection's partials in its own launch (saving the
# `_mix_partials` launch of the next hc_pre / hc_head) up to this many tokens: each of its
# programs reads its D block of fn once per token, which is cheap for decode / verify steps but
# re-reads fn T times where `_mix_partials` (token blocks of 16-64 on tensor cores) reads it
# once per 16-64 tokens.
POST_NEXT_MAX_T = 16


def post_next_max_t() -> int:
    """POST_NEXT_MAX_T, or every token count in the batch-invariant mode (the per-token
    launches serve all sizes: a row's partials, norm and Sinkhorn warps never change)."""
    return 1 << 62 if invariant.on() else POST_NEXT_MAX_T


_POST_NEXT_BLOCK_D = 64      # 4 streams x 64 columns x 32 rows of fn per program: no spills
_LEFT = "_dspark_mhc_partials"


class _Left(NamedTuple):
    """What hc_post's launch leaves on its output streams for the next collapse."""
    fn: torch.Tensor                # the projection the partials are of
    partials: tuple                 # (part, sq, S, BLOCK_R), as `_mixes` returns them
    hint: tuple | None = None       # the NextPre it also finished (FINISH), and its result u
    u: torch.Tensor | None = None


def _partials_left_on(X, fn):
    """(part, sq, S, BLOCK_R) that hc_post left on the stream tensor X for this very fn, else
    None. X is the tensor hc_post returned (streams are never changed in place)."""
    left = getattr(X, _LEFT, None)
    return left.partials if left is not None and left.fn is fn else None


def _finished_left_on(X, fn, base, scale, norm, head: bool):
    """The RMSNorm'd collapse that hc_post's launch finished on X (`NextPre` hint) for this very
    hc_pre / hc_head (same fn, base, scale, norm module, head or not), else None."""
    left = getattr(X, _LEFT, None)
    if left is None or left.fn is not fn or left.hint is None:
        return None
    h = left.hint
    return left.u if (h.base is base and h.scale is scale and h.norm is norm
                      and h.head == head) else None


def hc_post(o: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            next_fn=None) -> torch.Tensor:
    """X'[k] = post[k]·o + Σ_j comb[j, k]·X[j]; o [T, D], X [T, n, D] -> [T, n, D] in X.dtype.

    next_fn: the fn [R, n·D] of the hc_pre / hc_head that reads X' next, or a `NextPre` of it;
    for few tokens (bf16 / fp32 streams) the same launch leaves that projection's split-K
    partials on X', and that hc_pre skips its first launch; given a `NextPre` with its RMSNorm
    (deferred hc_pre or hc_head, `norm_fusable`) the launch's last program also finishes it
    (pre, u, the norm) and that hc_pre / hc_head launches nothing for u."""
    T, n, D = X.shape
    assert o.shape == (T, D), f"o {tuple(o.shape)} does not match X {tuple(X.shape)}"
    pending = getattr(post, _SIDE, None)                 # hc_pre's side launch, if deferred
    if pending is not None:
        side_stream.join(pending[0])
        delattr(post, _SIDE)
    return _launch_post(o, X, post, comb, next_fn, n, X.dtype, False)


def hc_expand(h: torch.Tensor, n: int, next_fn=None, ids: torch.Tensor | None = None
              ) -> torch.Tensor:
    """The first layer's streams: n copies of h [T, D] -> [T, n, D] (h's dtype), in one launch
    that (next_fn, as hc_post's) also leaves the first hc_pre's partials on them (and finishes
    it, given a `NextPre`). ids (int64 [T]): h is the embedding table [V, D] and token t's row
    is h[ids[t]] (the embedding lookup in the same launch)."""
    return _launch_post(h, h, h, h, next_fn, n, h.dtype, True, ids)


def _launch_post(o, X, post, comb, next_fn, n: int, dtype, expand: bool,
                 ids: torch.Tensor | None = None) -> torch.Tensor:
    """hc_post's launch (expand: hc_expand's; X, post and comb are then not read; ids: o is a
    table whose row ids[t] is token t's)."""
    T, D = (ids.numel(), o.shape[1]) if ids is not None else o.shape
    out = torch.empty(T, n, D, dtype=dtype, device=o.device)
    if T == 0:
        return out
    # a NextPre (dspark.models.deepseek_v4.mhc: fn, base, scale, norm, eps, head) or a plain fn
    hint = None if next_fn is None or isinstance(next_fn, torch.Tensor) else next_fn
    if hint is not None:
        next_fn = hint.fn
    nxt = (next_fn is not None and T <= post_next_max_t() and next_fn.shape[1] == n * D
           and dtype in (torch.bfloat16, torch.float32) and next_fn.is_contiguous())
    finish = nxt and hint is not None and norm_fusable(out, hint.norm)
    if nxt:
        block_d = min(_POST_NEXT_BLOCK_D, triton.next_power_of_2(D))
        R = next_fn.shape[0]
        BLOCK_R = max(16, triton.next_power_of_2(R))
        S = triton.cdiv(D, block_d)
        part = torch.empty(S, T, BLOCK_R, dtype=torch.float32, device=o.device)
        sq = torch.empty(S, T, dtype=torch.float32, device=o.device)
    else:
        block_d = min(_BLOCK_D, triton.next_power_of_2(D))
        R, BLOCK_R, S, part, sq = 0, 16, 0, out, out          # part / sq: never touched
    if not expand:
        X, post, comb = X.contiguous(), post.float().contiguous(), comb.float().contiguous()
    if ids is not None:
        ids = ids.reshape(-1).contiguous()
    fin = dict(u=out, base=out, scale=out, nw=out, cnt=out, eps=(0.0, 0.0, 0.0))
    if finish:
        fin = dict(u=torch.empty(T, D, dtype=dtype, device=o.device),
                   base=hint.base.float().contiguous(), scale=hint.scale.float().contiguous(),
                   nw=hint.norm.weight, cnt=_arrival_counters(o.device, T),
                   eps=(hint.norm_eps, hint.hc_eps, float(hint.norm.eps)))
    _post[(T, triton.cdiv(D, block_d))](
        o.contiguous(), X, post, comb, out, next_fn if nxt else out, part, sq, T, D, R,
        ids if ids is not None else out, fin["base"], fin["scale"], fin["u"], fin["nw"],
        fin["cnt"], S, *fin["eps"],
        N=n, BLOCK_N=triton.next_power_of_2(n), BLOCK_D=block_d,
        OUT_BF16=dtype == torch.bfloat16, NEXT=nxt, BLOCK_R=BLOCK_R, EXPAND=expand,
        GATHER=ids is not None, FINISH=finish, BLOCK_S=triton.next_power_of_2(max(S, 1)),
        BLOCK_DF=triton.next_power_of_2(D) if finish else 1,
        PDL=finish and pdl.enabled(o.device),
        num_warps=NORM_WARPS if finish else 4)
    if nxt:
        left = _Left(next_fn, (part, sq, S, BLOCK_R))
        setattr(out, _LEFT, left._replace(hint=hint, u=fin["u"]) if finish else left)
    return out


def hc_pre(X, fn, base, scale, n: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
           deferred: bool = False, norm=None):
    """X [T, n, D] -> (u [T, D] in X.dtype, post [T, n] fp32, comb [T, n, n] fp32).
    deferred: post / comb may still be being written on a side stream when this returns; only
    for callers that hand them to hc_post alone (it waits for them), e.g. the model's blocks.
    norm: the RMSNorm module that reads u next: norm(u) is returned instead of u (`_collapse`)."""
    assert X.dim() == 3 and X.shape[1] == n, f"X {tuple(X.shape)} is not [T, {n}, D]"
    assert fn.shape[0] == (2 + n) * n, f"hc_pre fn has {fn.shape[0]} rows, expected {(2 + n) * n}"
    return _collapse(X, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters, head=False,
                     deferred=deferred, norm=norm)


def hc_head(X, fn, base, scale, hc_eps: float, norm_eps: float, norm=None) -> torch.Tensor:
    """Final collapse: sigmoid-gated sum of the streams, [T, n, D] -> [T, D] in X.dtype (with
    `norm`, an RMSNorm module: its output)."""
    assert fn.shape[0] == X.shape[1], f"hc_head fn has {fn.shape[0]} rows for {X.shape[1]} streams"
    return _collapse(X, fn, base, scale, hc_eps, norm_eps, 0, head=True, norm=norm)[0]
