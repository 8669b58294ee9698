"""The drafter's block attention in one launch per stage: the γ queries of each request over its
context ring (entries masked by the position they hold) and the whole block, with the per-head
sink, then the output's inverse RoPE and its rounding.

Per request r (block at positions P..P+γ-1, ring slot s), head h, query i:

    keys   = ring[s, j] for every ring entry j holding a position p with P - W <= p < P
             (p = -1: never written), then the block's own γ keys (K = V, one shared head)
    o      = Σ_j e^{l_j} k_j / (Σ_j e^{l_j} + e^{sink_h}),   l_j = scale · q·k_j      (fp32)
    out    = o rounded to out's dtype, its last rope_dim dims (interleaved pairs) rotated by
             cis[P + i] (the conjugated table: the inverse rotation) and rounded again

which is the drafter's torch composition (the ring gathered by slot, the keys concatenated,
`attention_with_sink_batched`, then `norm_rope(inverse)`: 12 launches per stage, and 8 per round
for the positions' gather and the mask) with the same roundings. The ring is read in place (no
gather), the mask made from the positions in the loads.

One program = one request x BLOCK_M of its γ·H (query, head) rows, which share every key tile.
Exact fp32 math from 16-bit operands: q·k of bf16 values in bf16 MMAs (exact products, fp32
sums); the probabilities P (fp32) times the bf16 keys as three bf16 MMAs of P = hi + mid + lo
(three bf16 values that sum to P exactly: 24 bits), so every product is exact and only the
summation order differs from torch's fp32 einsum. The interpreter (whose bf16 dot is unsound, see
common.pick_precision) takes exact fp32 ('ieee') dots of the same split values, and so do fp32
operands there. The softmax runs online over key tiles in base 2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.cache_write import _bf16_round
from dspark.kernels.common import interpreting, online_softmax_tile
from dspark.kernels.norm_rope import ROUNDINGS, _rnd

LOG2E = 1.4426950408889634
BLOCK_N = 32            # keys per tile
BLOCK_M = 16            # (query, head) rows per program: one MMA M-tile
# sm_90 offline (benchmarks/kernel_regs.py --kernel draft_attention; Triton 3.6 and 3.9): 8 warps
# unpipelined hold a program (q, a key tile, the [16, 512] accumulator) in 255 registers without
# spills; 2 stages (Triton 3.6) or 4 warps spill. One program per SM is plenty: the grid is
# R x cdiv(γ·H, 16) programs.
NUM_WARPS, NUM_STAGES = 8, 1


@triton.jit
def _dot(a, b, acc, BF16: tl.constexpr):
    """acc + a @ b in fp32: bf16 MMAs of a and b (BF16: both hold bf16 values, so the products
    are exact), else exact fp32 ('ieee') products."""
    if BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _attend(q, k, valid, m_i, l_i, acc, scale_log2, BLOCK_M: tl.constexpr,
            BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, BF16: tl.constexpr):
    """One tile of BLOCK_K keys k [BLOCK_K, D] (valid [BLOCK_K]) into the online softmax
    (m, l in base 2; acc [BLOCK_M, D] fp32)."""
    s = _dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_K), tl.float32), BF16) * scale_log2
    m_new, l_i, p, alpha = online_softmax_tile(s, valid, m_i, l_i)
    acc = acc * alpha[:, None]
    if SPLIT:       # P = hi + mid + lo, each exact in bf16: three exact-product MMAs
        hi = _bf16_round(p)
        r = p - hi
        mid = _bf16_round(r)
        lo = _bf16_round(r - mid)
        acc = _dot(hi, k, _dot(mid, k, _dot(lo, k, acc, BF16), BF16), BF16)
    else:
        acc = _dot(p, k, acc, BF16)
    return m_new, l_i, acc


@triton.jit
def _draft_attention_kernel(
        q_ptr, stride_qt, stride_qh, ring_ptr, stride_rs, stride_rj, slots_ptr, rpos_ptr,
        stride_ps, starts_ptr, blk_ptr, stride_bt, sink_ptr, cis_ptr, out_ptr, stride_ot,
        stride_oh, H, D, CAP, W, scale_log2, R_HALF,
        G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, BF16: tl.constexpr, ROPE: tl.constexpr,
        ROUND: tl.constexpr):
    """Grid (R, cdiv(G·H, BLOCK_M)): request r's rows m = i·H + h (query i, head h)."""
    r = tl.program_id(0).to(tl.int64)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < G * H
    i = m // H
    h = m % H
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    t = r * G + i                                              # the query's token row
    q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    P = tl.load(starts_ptr + r)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for j0 in range(0, CAP, BLOCK_N):                          # the context ring, in place
        j = j0 + tl.arange(0, BLOCK_N)
        held = tl.load(rpos_ptr + slot * stride_ps + j, mask=j < CAP, other=-1)
        valid = (held >= 0) & (held >= P - W) & (held < P)
        k = tl.load(ring_ptr + slot * stride_rs + j[:, None] * stride_rj + d[None, :],
                    mask=valid[:, None] & d_ok[None, :], other=0.0)
        m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale_log2, BLOCK_M, BLOCK_N,
                                SPLIT, BF16)
    jb = tl.arange(0, BLOCK_G)                                 # the block's own keys
    valid = jb < G
    k = tl.load(blk_ptr + (r * G + jb)[:, None] * stride_bt + d[None, :],
                mask=valid[:, None] & d_ok[None, :], other=0.0)
    m_i, l_i, acc = _attend(q, k, valid, m_i, l_i, acc, scale_log2, BLOCK_M, BLOCK_G,
                            SPLIT, BF16)
    # the sink joins the denominator only (re-pivoted on max(m, sink): no overflow)
    sink = tl.load(sink_ptr + h, mask=m_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    top = tl.maximum(m_i, sink)
    f = tl.exp2(m_i - top)
    o = acc * (f / (l_i * f + tl.exp2(sink - top)))[:, None]
    dst = out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh
    if ROPE:        # as kernels.norm_rope without a norm: round, rotate the last pairs, round
        o = _rnd(o, ROUND)
        re, im = tl.split(tl.reshape(o, (BLOCK_M, BLOCK_D // 2, 2)))   # pair c: dims 2c, 2c+1
        c = tl.arange(0, BLOCK_D // 2)
        c0 = D // 2 - R_HALF
        rot = (c >= c0) & (c < D // 2)
        at = (P + i).to(tl.int64)[:, None] * (2 * R_HALF) + 2 * (tl.maximum(c - c0, 0))[None, :]
        both = m_ok[:, None] & rot[None, :]
        cos = tl.load(cis_ptr + at, mask=both, other=1.0)
        sin = tl.load(cis_ptr + at + 1, mask=both, other=0.0)
        re2 = tl.where(rot[None, :], _rnd(re * cos - im * sin, ROUND), re)
        im2 = tl.where(rot[None, :], _rnd(re * sin + im * cos, ROUND), im)
        o = tl.reshape(tl.join(re2, im2), (BLOCK_M, BLOCK_D))
    tl.store(dst + d[None, :], o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def runs_on(q: torch.Tensor, ring: torch.Tensor, block: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: bf16 or fp32, unit last strides, one device."""
    dts = (torch.bfloat16, torch.float32)
    return (q.dim() == 3 and ring.dim() == 3 and block.dim() == 2 and q.dtype in dts
            and ring.dtype in dts and block.dtype in dts and q.shape[-1] == ring.shape[-1]
            == block.shape[-1] and q.shape[-1] % 2 == 0 and q.stride(-1) == 1
            and ring.stride(-1) == 1 and block.stride(-1) == 1
            and q.device == ring.device == block.device)


def supported(q: torch.Tensor, ring: torch.Tensor, block: torch.Tensor) -> bool:
    """Whether the drafter should take the kernel for these: bf16 operands, or fp32 ones off
    CUDA only (the interpreter). On sm_90 the exact fp32 dots of [16, 512] tiles spill ~2 KB per
    thread (offline compile): right but slow, so an fp32 drafter keeps the torch path there."""
    return runs_on(q, ring, block) and (not q.is_cuda or q.dtype == ring.dtype == block.dtype
                                        == torch.bfloat16)


def draft_attention(q: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor,
                    ring_pos: torch.Tensor, starts: torch.Tensor, block: torch.Tensor,
                    sink: torch.Tensor, scale: float, window: int,
                    cis: torch.Tensor | None = None, rope_dim: int = 0,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Block attention of R requests (module doc). q [R·γ, H, D] (request r's γ queries at rows
    rγ..), ring [slots, capacity, D] with ring_pos [slots, capacity] (int64, -1 = empty),
    slots / starts [R] (int64: the request's ring slot and block position P), block [R·γ, D]
    (its own keys), sink [H] fp32, scale, window W. cis (complex64 [> max P + γ - 1, r/2], the
    conjugated table) with rope_dim: the output's inverse RoPE, rounded to out_dtype (fp32 or
    bf16); without: the fp32 attention output. Returns [R·γ, H, D] in out_dtype."""
    assert runs_on(q, ring, block), (q.shape, q.dtype, ring.shape, ring.dtype, block.shape)
    R = slots.shape[0]
    T, H, D = q.shape
    G = T // R
    assert T == R * G and block.shape[0] == T and starts.shape == (R,), (T, R, starts.shape)
    assert ring_pos.shape == ring.shape[:2] and ring_pos.stride(-1) == 1, ring_pos.shape
    out = torch.empty(T, H, D, dtype=out_dtype if cis is not None else torch.float32,
                      device=q.device)
    if T == 0 or H == 0:
        return out
    r_half = rope_dim // 2 if cis is not None else 0
    if cis is not None:
        assert cis.dtype == torch.complex64 and cis.dim() == 2 and cis.shape[1] == r_half \
            and 0 < rope_dim <= D, (cis.shape, rope_dim)
        cis = torch.view_as_real(cis.contiguous())
    sixteen = q.dtype == ring.dtype == block.dtype == torch.bfloat16
    BLOCK_D = triton.next_power_of_2(D)
    _draft_attention_kernel[(R, triton.cdiv(G * H, BLOCK_M))](
        q, q.stride(0), q.stride(1), ring, ring.stride(0), ring.stride(1), slots.contiguous(),
        ring_pos, ring_pos.stride(0), starts.contiguous(), block, block.stride(0),
        sink.contiguous(), cis if cis is not None else out, out, out.stride(0), out.stride(1),
        H, D, ring.shape[1], int(window), float(scale) * LOG2E, r_half,
        G=G, BLOCK_D=BLOCK_D, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, SPLIT=sixteen, BF16=sixteen and not interpreting(),
        ROPE=cis is not None, ROUND=ROUNDINGS[out.dtype], num_warps=NUM_WARPS,
        num_stages=NUM_STAGES)
    return out
