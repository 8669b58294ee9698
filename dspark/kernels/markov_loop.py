"""The drafter's γ sequential Markov steps in one launch, one program per row, for small
vocabularies.

Per row r and slot k = 0..γ-1, with prev = the anchor for k = 0 and the token of slot k-1 after:

    e       = W1[prev]                                   (fp32)
    conf_k  = w_conf · [hidden_k ; e]                    (fp32 sums)
    x       = base[r, k] + W2 @ e                        (fp32 sums over the rank)
    token_k = argmax(x)                                  (greedy: first index on ties)
            | inverse-CDF draw with u[r, k] from q_k = softmax(x / T_r)   (T_r <= 0: one-hot)

which is what the draft pass's per-step path computes with `markov_step`, `probs_from_logits`
and `sample_from_probs` (or `fused_sample`) in ~10 launches per step plus the stacks. At the
shipped width (V 512, rank 64) a captured draft pass is bound by its number of kernels, so the
whole loop is one launch here. The price is that one program streams W2 once per step and pass
(two passes when sampling: statistics, then q and the draw), which stays cheap only while V and
V·rank are small: `supported` says where; wider heads (V4-Flash's 129280) keep the per-step path.

Sums run in another order than torch's, so q and the confidences agree to fp32 rounding, greedy
tokens agree except where two logits are within rounding of each other, and sampled tokens except
where u lands within rounding of a cdf boundary. The argmax is torch's: first index of the
maximum, NaN counting as the largest (the order keys of kernels/argmax.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .argmax import _order_key
from .gumbel import _KEY_START, gumbel_key, gumbel_scores
from .sampling import _MAX_FLOOR, _cdf_chunk

MAX_VOCAB = 4096            # one program loops over the row's V blocks once or twice per step
MAX_TABLE = 1 << 18         # V · rank: W2 elements one program reads per step and pass
MAX_RANK = 256
_TILE = 8192                # W2 elements per loop step (BLOCK_V x BLOCK_R): ~64 fp32 / thread


def supported(vocab: int, rank: int) -> bool:
    """Whether `markov_loop` serves a Markov head of this vocabulary and rank (0 = no head:
    zero bias, the confidence from the hidden state alone)."""
    return 0 < vocab <= MAX_VOCAB and 0 <= rank <= MAX_RANK and vocab * max(rank, 1) <= MAX_TABLE


def _blocks(vocab: int, rank: int) -> tuple[int, int]:
    block_r = max(16, triton.next_power_of_2(max(rank, 1)))
    block_v = max(16, min(triton.next_power_of_2(vocab), _TILE // block_r))
    return block_v, block_r


@triton.jit
def _markov_loop_kernel(
        base_ptr, stride_b_r, stride_b_k, stride_b_v,
        anchor_ptr, stride_a,
        w1_ptr, stride_w1, w2_ptr, stride_w2,
        hid_ptr, stride_h_r, stride_h_k, stride_h_d,
        wc_ptr, stride_wc,
        temp_ptr, stride_t, u_ptr, stride_u_r, stride_u_k,
        seed_ptr, start_ptr, key_start,
        tok_ptr, q_ptr, conf_ptr,
        V, RANK, D, G,
        GREEDY: tl.constexpr, GUMBEL: tl.constexpr, BLOCK_V: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    ok_r = offs_r < RANK
    # the confidence weight's Markov half, the same for every slot
    wc_e = tl.load(wc_ptr + (D + offs_r) * stride_wc, mask=ok_r, other=0.0).to(tl.float32)
    prev = tl.load(anchor_ptr + r * stride_a).to(tl.int64)
    if not GREEDY:
        temp = tl.load(temp_ptr + r * stride_t).to(tl.float32)
        row_greedy = temp <= 0
        t = tl.where(row_greedy, 1.0, temp)    # probs_from_logits divides greedy rows by 1
    if GUMBEL:
        seed = tl.load(seed_ptr + r)
        start = tl.load(start_ptr + r)
    for k in range(G):
        e = tl.load(w1_ptr + prev * stride_w1 + offs_r, mask=ok_r, other=0.0).to(tl.float32)
        conf = tl.sum(e * wc_e, 0)
        hid_k = hid_ptr + r * stride_h_r + k * stride_h_k
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            ok_d = offs_d < D
            h = tl.load(hid_k + offs_d * stride_h_d, mask=ok_d, other=0.0).to(tl.float32)
            wc = tl.load(wc_ptr + offs_d * stride_wc, mask=ok_d, other=0.0).to(tl.float32)
            conf += tl.sum(h * wc, 0)
        tl.store(conf_ptr + r * G + k, conf)

        # pass 1: x = base + W2 e block by block; its argmax (order keys: torch's ties and
        # NaN) and, sampling, the running max / sum of exp(x / t), x kept in q's row for pass 2
        base_k = base_ptr + r * stride_b_r + k * stride_b_k
        q_row = q_ptr + (r * G + k) * V
        best = tl.full([], -2147483647 - 1, tl.int32)
        best_idx = tl.zeros([], tl.int32)
        m = tl.full([], _MAX_FLOOR, tl.float32)
        s = tl.zeros([], tl.float32)
        if GUMBEL:
            # spec.gumbel's key of (seed, position start + k + 1)
            h, h2 = gumbel_key(key_start, seed, start + k + 1)
            g_best = tl.full([], float("-inf"), tl.float64)
            g_idx = tl.zeros([], tl.int32)
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            ok_v = offs_v < V
            w2 = tl.load(w2_ptr + offs_v[:, None].to(tl.int64) * stride_w2 + offs_r[None, :],
                         mask=ok_v[:, None] & ok_r[None, :], other=0.0).to(tl.float32)
            x = tl.load(base_k + offs_v.to(tl.int64) * stride_b_v, mask=ok_v,
                        other=0.0).to(tl.float32) + tl.sum(w2 * e[None, :], 1)
            key = tl.where(ok_v, _order_key(x), -2147483647 - 1)
            chunk_best = tl.max(key, 0)
            chunk_idx = tl.min(tl.where(key == chunk_best, offs_v, V), 0)
            # strictly greater: an equal maximum in a later block keeps the first index
            best_idx = tl.where(chunk_best > best, chunk_idx, best_idx)
            best = tl.maximum(best, chunk_best)
            if GUMBEL:
                score = tl.where(ok_v, gumbel_scores(x, t, offs_v, h, h2), float("-inf"))
                g_max = tl.max(score, 0)
                g_at = tl.argmax(score, 0, tie_break_left=True).to(tl.int32) + v0
                g_idx = tl.where(g_max > g_best, g_at, g_idx)    # ties: the earlier block
                g_best = tl.maximum(g_best, g_max)
            elif not GREEDY:
                tl.store(q_row + offs_v, x, mask=ok_v)
                xt = tl.where(ok_v, x / t, float("-inf"))
                m_new = tl.maximum(m, tl.max(xt, 0))
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(xt - m_new), 0)
                m = m_new
        if GREEDY:
            prev = best_idx.to(tl.int64)
        elif GUMBEL:
            prev = tl.where(row_greedy, best_idx, g_idx).to(tl.int64)
        else:
            # pass 2 reads x back from other threads' stores of pass 1
            tl.debug_barrier()
            target = tl.load(u_ptr + r * stride_u_r + k * stride_u_k) * s
            carry = tl.zeros([], tl.float32)
            first = tl.full([], V, tl.int32)
            last_positive = tl.full([], -1, tl.int32)
            for v0 in range(0, V, BLOCK_V):
                offs_v = v0 + tl.arange(0, BLOCK_V)
                ok_v = offs_v < V
                x = tl.load(q_row + offs_v, mask=ok_v, other=float("-inf"))
                w = tl.exp(x / t - m)                                   # 0 past V
                q = tl.where(row_greedy, tl.where(offs_v == best_idx, 1.0, 0.0), w / s)
                tl.store(q_row + offs_v, q, mask=ok_v)
                # the draw weighs exp(x / t - m) against u * s (q's law); only tokens whose
                # stored q is positive are eligible (verify never sees q = 0 at a draft)
                carry, first, last_positive = _cdf_chunk(w, q > 0, offs_v, V, target, carry,
                                                         first, last_positive)
            y = tl.where(first < V, first, last_positive)
            prev = tl.where(row_greedy, best_idx, y).to(tl.int64)
            # the next slot's pass 1 reuses nothing of this row: no second barrier
        tl.store(tok_ptr + r * G + k, prev)


def _check(base, anchors, w1, w2, hidden, conf_weight, temperature, u, greedy, gumbel=None):
    if base.dim() != 3 or not base.is_floating_point():
        raise ValueError(f"base logits must be a float [R, γ, V] tensor, got "
                         f"{base.dtype} {tuple(base.shape)}")
    R, G, V = base.shape
    if anchors.shape != (R,) or anchors.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"anchors must be int64 (or int32) [R] = [{R}], got "
                         f"{anchors.dtype} {tuple(anchors.shape)}")
    if w1.dim() != 2 or w1.shape[0] != V or w2.shape != w1.shape:
        raise ValueError(f"W1 and W2 must both be [V, rank] with V = {V}, got "
                         f"{tuple(w1.shape)} and {tuple(w2.shape)}")
    rank = w1.shape[1]
    if hidden.dim() != 3 or hidden.shape[:2] != (R, G):
        raise ValueError(f"hidden must be [R, γ, D] = [{R}, {G}, D], got {tuple(hidden.shape)}")
    D = hidden.shape[2]
    if conf_weight.numel() != D + rank or (conf_weight.dim() == 2 and conf_weight.shape[0] != 1):
        raise ValueError(f"the confidence weight must be [1, D + rank] = [1, {D + rank}], got "
                         f"{tuple(conf_weight.shape)}")
    if not supported(V, rank):
        raise ValueError(f"markov_loop serves V <= {MAX_VOCAB}, rank <= {MAX_RANK} and "
                         f"V * rank <= {MAX_TABLE}; got V = {V}, rank = {rank} (check supported())")
    if gumbel is not None:
        if greedy or temperature is None or u is not None:
            raise ValueError("Gumbel draws need temperature [R] and (seeds, starts), no u")
        seeds, starts = gumbel
        if temperature.numel() != R or seeds.shape != (R,) or starts.shape != (R,):
            raise ValueError(f"temperature, seeds and starts must be [R] = [{R}], got "
                             f"{tuple(temperature.shape)}, {tuple(seeds.shape)}, "
                             f"{tuple(starts.shape)}")
    elif not greedy:
        if temperature is None or u is None:
            raise ValueError("sampling needs temperature [R] and uniforms u [R, γ]")
        if temperature.numel() != R or u.shape != (R, G):
            raise ValueError(f"temperature must be [R] = [{R}] and u [R, γ] = [{R}, {G}], got "
                             f"{tuple(temperature.shape)} and {tuple(u.shape)}")
    tensors = [base, anchors, w1, w2, hidden, conf_weight] + (
        [] if greedy else [temperature] + ([u] if gumbel is None else list(gumbel)))
    if any(t.device != base.device for t in tensors):
        raise ValueError("markov_loop's tensors must share one device")
    for name, t in (("W1", w1), ("W2", w2)):
        if rank and t.stride(1) != 1:
            raise ValueError(f"{name} must have unit stride along the rank")


def markov_loop(base: torch.Tensor, anchors: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                hidden: torch.Tensor, conf_weight: torch.Tensor,
                temperature: torch.Tensor | None = None, u: torch.Tensor | None = None,
                greedy: bool = False, block_v: int | None = None, gumbel=None):
    """(tokens int64 [R, γ], q fp32 [R, γ, V] or None when `greedy`, confidence logits fp32
    [R, γ]) of the Markov loop over base logits [R, γ, V] (any float dtype and strides) from
    anchors [R] (token ids in [0, V)), W1 / W2 [V, rank] (bf16 / fp32 as stored, rank 0
    allowed), hidden [R, γ, D] (the pre-norm hidden the confidence reads; cast to fp32) and the
    confidence weight [1, D + rank]. greedy: every row takes the argmax; else temperature [R]
    (<= 0: that row greedy, its q one-hot) and uniforms u [R, γ] in [0, 1). gumbel = (seeds
    [R], starts [R]) int64 instead of u: slot k's token is the Gumbel-max draw of
    `spec.gumbel` keyed by (seed, start + k + 1), and no q is kept (None). block_v: V block
    per loop step (a power of two; tests). One launch, no host sync."""
    _check(base, anchors, w1, w2, hidden, conf_weight, temperature, u, greedy, gumbel)
    R, G, V = base.shape
    rank, D, dev = w1.shape[1], hidden.shape[2], base.device
    tokens = torch.empty(R, G, dtype=torch.int64, device=dev)
    conf = torch.empty(R, G, dtype=torch.float32, device=dev)
    keep_q = not greedy and gumbel is None
    q = torch.empty(R, G, V, dtype=torch.float32, device=dev) if keep_q else None
    if R == 0 or G == 0:
        return tokens, q, conf
    bv, br = _blocks(V, rank)
    bv = block_v or bv
    wc = conf_weight.reshape(-1)
    temp_arg = base if greedy else temperature.reshape(-1)
    u_arg = u if keep_q else base
    u_strides = u.stride() if keep_q else (0, 0)
    seeds, starts = (s.contiguous() for s in gumbel) if gumbel is not None else (anchors, anchors)
    _markov_loop_kernel[(R,)](
        base, *base.stride(), anchors, anchors.stride(0),
        w1, w1.stride(0), w2, w2.stride(0), hidden, *hidden.stride(), wc, wc.stride(0),
        temp_arg, 0 if greedy else temp_arg.stride(0), u_arg, *u_strides,
        seeds, starts, _KEY_START,
        tokens, q if keep_q else tokens, conf,
        V, rank, D, G,
        GREEDY=greedy, GUMBEL=gumbel is not None, BLOCK_V=bv, BLOCK_R=br,
        BLOCK_D=min(triton.next_power_of_2(max(D, 1)), 1024), num_warps=4)
    return tokens, q, conf


__all__ = ["markov_loop", "supported", "MAX_VOCAB", "MAX_TABLE", "MAX_RANK"]
