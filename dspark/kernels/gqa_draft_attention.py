"""The DeepSpec (Qwen3) drafter's block attention in one launch per layer: each request's γ queries
over its slot's draft context (pool rows 0..P-1, P = the block's start) and the whole block
(bidirectional, no mask inside the block), GQA (query head h reads kv head h // (Hq / Hkv)).

    o[t, h] = Σ_j softmax_j(scale · q[t, h]·k_j) v_j,   j over pool[slot, 0..P-1, kvh] ++ block keys

which the torch path composes from two pool gathers, two concatenations, the GQA expansions and
SDPA with a [R, ctx + γ] mask (7 launches and a copy of the context per layer). Here the pool is
read in place, only its rows < P, and the mask is the loop bound.

One program = one request x one kv head: its γ · (Hq / Hkv) query rows share every key tile.
Online softmax in base 2, fp32 statistics and accumulator; q·k and p·v as MMAs of the operands'
dtype (p rounded to it, as flash attention does) with fp32 accumulation; fp32 operands (and the
interpreter) take exact fp32 dots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.common import dot, interpreting, mma_operand, online_softmax_tile

LOG2E = 1.4426950408889634
BLOCK_N = 64            # context keys per tile


@triton.jit
def _tile(q, k, v, valid, m_i, l_i, acc, scale_log2, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    s = dot(q, tl.trans(mma_operand(k, PRECISION)), tl.zeros((BLOCK_M, BLOCK_K), tl.float32),
            PRECISION) * scale_log2
    m_new, l_i, p, alpha = online_softmax_tile(s, valid, m_i, l_i)
    acc = dot(mma_operand(p, PRECISION), mma_operand(v, PRECISION), acc * alpha[:, None],
              PRECISION)
    return m_new, l_i, acc


@triton.jit
def _gqa_draft_attention_kernel(
        q_ptr, stride_qt, stride_qh, pk_ptr, pv_ptr, stride_ps, stride_pr, stride_ph,
        slots_ptr, starts_ptr, bk_ptr, stride_bkt, stride_bkh, bv_ptr, stride_bvt, stride_bvh,
        out_ptr, stride_ot, stride_oh, scale_log2,
        G: tl.constexpr, GS: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Grid (R, Hkv): rows m = i·GS + g (query slot i, head kvh·GS + g)."""
    r = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    m_ok = m < G * GS
    t = r * G + m // GS                                        # the query's token row
    h = kvh * GS + m % GS
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=m_ok[:, None], other=0.0)
    q = mma_operand(q, PRECISION)
    slot = tl.load(slots_ptr + r).to(tl.int64)
    P = tl.load(starts_ptr + r)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    base = slot * stride_ps + kvh * stride_ph
    for j0 in range(0, P, BLOCK_N):                            # the context, rows < P only
        j = j0 + tl.arange(0, BLOCK_N)
        valid = j < P
        at = base + j[:, None].to(tl.int64) * stride_pr + d[None, :]
        k = tl.load(pk_ptr + at, mask=valid[:, None], other=0.0)
        v = tl.load(pv_ptr + at, mask=valid[:, None], other=0.0)
        m_i, l_i, acc = _tile(q, k, v, valid, m_i, l_i, acc, scale_log2, BLOCK_M, BLOCK_N,
                              PRECISION)
    jb = tl.arange(0, BLOCK_G)                                 # the block's own keys
    valid = jb < G
    tb = (r * G + jb)[:, None]
    k = tl.load(bk_ptr + tb * stride_bkt + kvh * stride_bkh + d[None, :], mask=valid[:, None],
                other=0.0)
    v = tl.load(bv_ptr + tb * stride_bvt + kvh * stride_bvh + d[None, :], mask=valid[:, None],
                other=0.0)
    m_i, l_i, acc = _tile(q, k, v, valid, m_i, l_i, acc, scale_log2, BLOCK_M, BLOCK_G, PRECISION)
    o = acc / l_i[:, None]
    tl.store(out_ptr + t[:, None] * stride_ot + h[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])


def gqa_draft_attention(q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                        slots: torch.Tensor, starts: torch.Tensor, k: torch.Tensor,
                        v: torch.Tensor) -> torch.Tensor:
    """Block attention of R requests (module doc): q [R·γ, Hq, d] (request r's γ queries at rows
    rγ..), pools [slots, rows, Hkv, d] (rows >= every start), slots / starts int64 [R], the
    block's k / v [R·γ, Hkv, d]; last dims contiguous, any other strides. Scale 1/√d. Returns
    [R·γ, Hq, d] in q's dtype."""
    T, Hq, D = q.shape
    R, Hkv = slots.shape[0], pool_k.shape[2]
    G = T // R
    assert T == R * G and Hq % Hkv == 0 and D & (D - 1) == 0 and starts.shape == (R,)
    assert k.shape == v.shape == (T, Hkv, D) and pool_k.stride() == pool_v.stride()
    assert all(x.stride(-1) == 1 for x in (q, pool_k, pool_v, k, v))
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    precision = "ieee" if interpreting() or q.dtype == torch.float32 else \
        ("bf16" if q.dtype == torch.bfloat16 else "fp16")
    GS = Hq // Hkv
    _gqa_draft_attention_kernel[(R, Hkv)](
        q, q.stride(0), q.stride(1), pool_k, pool_v, pool_k.stride(0), pool_k.stride(1),
        pool_k.stride(2), slots.contiguous(), starts.contiguous(), k, k.stride(0), k.stride(1),
        v, v.stride(0), v.stride(1), out, out.stride(0), out.stride(1), D ** -0.5 * LOG2E,
        G=G, GS=GS, D=D, BLOCK_M=max(16, triton.next_power_of_2(G * GS)),
        BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=BLOCK_N, PRECISION=precision,
        num_warps=4)
    return out
