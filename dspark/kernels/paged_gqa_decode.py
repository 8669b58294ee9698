"""Causal GQA attention of a fixed-shape batch over a paged K/V pool (Qwen3 decode / verify).
from dspark.kernels.common import interpreting

The batch is B requests × q_len rows (row t belongs to request t // q_len); row t sits at
absolute position ``positions[t]`` and sees keys 0..positions[t] of its request, where key j lives
at pool row ``block_tables[r, j // block_size] * block_size + j % block_size``. Keys of the rows
being decoded must already be in the pool (the caller writes them first), so a verify block's
rows see each other causally exactly as in the eager path.

Everything is shape-static: ``block_tables`` is padded to a fixed width and nothing here reads a
length on the host, so it can run inside a captured CUDA graph.

* ``paged_gqa_attention`` — Triton. One program = one row × one KV head: the G query heads that
  share the KV head form one MMA tile (padded to 16 rows), keys are walked in tiles of BLOCK_N up
  to the row's own position (the loop bound is read on the device), online softmax in base 2 with
  fp32 statistics. Only keys 0..pos are touched, so the block-table padding costs nothing.
* ``paged_gqa_attention_torch`` — the same contract in torch ops: gather the padded tables'
  pages, mask by position, SDPA. It reads every padded page, so callers bucket the table width.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark.kernels.common import interpreting

LOG2E = 1.4426950408889634


def _precision(dtype: torch.dtype) -> str:
    """bf16/fp16 operands: the native MMA. fp32: exact 'ieee' products (an fp32 model is a
    correctness reference, so no TF32). The interpreter's bf16 dot is unreliable (it multiplies
    raw bit patterns in triton 3.9): always 'ieee' there."""
    if interpreting() or dtype == torch.float32:
        return "ieee"
    return "native"


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr):
    if PRECISION == "ieee":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _paged_gqa_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, pos_ptr, out_ptr,
                      stride_qt, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
                      stride_bt, stride_ot, stride_oh, scale_log2, q_len, block_size,
                      G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    r = t // q_len
    pos = tl.load(pos_ptr + t)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    g_ok = g < G
    q = tl.load(q_ptr + t * stride_qt + (h * G + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for n0 in range(0, pos + 1, BLOCK_N):
        j = n0 + tl.arange(0, BLOCK_N)
        valid = j <= pos
        page = tl.load(bt_ptr + r * stride_bt + j // block_size, mask=valid, other=0)
        slot = page.to(tl.int64) * block_size + j % block_size
        k = tl.load(k_ptr + slot[:, None] * stride_kn + h * stride_kh + d[None, :],
                    mask=valid[:, None], other=0.0)
        s = _dot(q, tl.trans(k), PRECISION) * scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + slot[:, None] * stride_vn + h * stride_vh + d[None, :],
                    mask=valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(out_ptr + t * stride_ot + (h * G + g)[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


def paged_gqa_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                        block_tables: torch.Tensor, positions: torch.Tensor, q_len: int,
                        block_size: int, out: torch.Tensor | None = None,
                        block_n: int = 64) -> torch.Tensor:
    """q [T, Hq, d] (T = B*q_len); k_pool/v_pool [rows, Hkv, d]; block_tables int [B, P] (any
    row stride); positions int64 [T]. Returns [T, Hq, d] in q's dtype (softmax scale d^-0.5)."""
    T, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    if Hq % Hkv or D & (D - 1) or D < 16:
        raise ValueError(f"need Hkv | Hq and a power-of-two head_dim >= 16; got Hq={Hq}, "
                         f"Hkv={Hkv}, d={D}")
    assert q.stride(2) == 1 and k_pool.stride(2) == 1 and v_pool.stride(2) == 1
    assert block_tables.stride(1) == 1 and T == block_tables.shape[0] * q_len
    G = Hq // Hkv
    out = torch.empty_like(q) if out is None else out
    prec = _precision(q.dtype)
    _paged_gqa_kernel[(T, Hkv)](
        q, k_pool, v_pool, block_tables, positions, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0),
        v_pool.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        D ** -0.5 * LOG2E, q_len, block_size,
        G=G, BLOCK_G=max(16, triton.next_power_of_2(G)), D=D, BLOCK_N=block_n, PRECISION=prec,
        num_warps=4)
    return out


def paged_gqa_attention_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                              block_tables: torch.Tensor, positions: torch.Tensor, q_len: int,
                              block_size: int) -> torch.Tensor:
    """Same contract as `paged_gqa_attention`, in torch ops (reads all P padded pages)."""
    T, Hq, D = q.shape
    B, P = block_tables.shape
    Hkv = k_pool.shape[1]
    pages = lambda pool: (pool[:pool.shape[0] // block_size * block_size]        # noqa: E731
                          .view(-1, block_size, Hkv, D)[block_tables]            # [B, P, bs, Hkv, d]
                          .view(B, P * block_size, Hkv, D).transpose(1, 2))     # [B, Hkv, S, d]
    K, V = pages(k_pool), pages(v_pool)
    keys = torch.arange(P * block_size, device=q.device)
    visible = keys[None, None, :] <= positions.view(B, q_len, 1)                 # [B, q_len, S]
    o = F.scaled_dot_product_attention(q.view(B, q_len, Hq, D).transpose(1, 2), K, V,
                                       attn_mask=visible[:, None], enable_gqa=True)
    return o.transpose(1, 2).reshape(T, Hq, D)
