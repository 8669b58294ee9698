"""Helpers the Triton kernel families share: whether Triton interprets (CPU), the MMA operand
precision a kernel runs at, and the MMA wrappers that apply it."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pick_precision(q_dtype: torch.dtype, precision: str | None) -> str:
    """MMA operand precision: 'bf16' (bf16 q; the default rows may switch it to 'fp16', see
    DEFAULT_CONFIGS), 'fp16' (asked for), 'tf32' (fp32 q on GPU) or 'ieee'.

    Under TRITON_INTERPRET the interpreter's bf16 dot multiplies raw uint16 bit patterns (triton
    3.9) and its fp32→bf16 cast does not round correctly, so the interpreter always uses 'ieee'
    (exact fp32 products: the kernel is then more accurate than on GPU, never less)."""
    if precision is not None:
        assert precision in ("bf16", "fp16", "tf32", "ieee"), precision
    if interpreting():
        return "fp16" if precision == "fp16" else "ieee"     # (numpy's fp16 dot is sound)
    if precision is not None:
        return precision
    return "bf16" if q_dtype == torch.bfloat16 else "tf32"


@triton.jit
def mma_operand(x, PRECISION: tl.constexpr):
    """Cast a tile to the MMA input type once (bf16 / fp16 for 'bf16' / 'fp16', else fp32)."""
    if PRECISION == "bf16":
        return x.to(tl.bfloat16)
    elif PRECISION == "fp16":
        return x.to(tl.float16)
    else:
        return x.to(tl.float32)


@triton.jit
def mma(a, b, PRECISION: tl.constexpr):
    """a @ b with fp32 accumulation; operands rounded to the chosen MMA input precision."""
    a = mma_operand(a, PRECISION)
    b = mma_operand(b, PRECISION)
    if PRECISION == "bf16" or PRECISION == "fp16":
        return tl.dot(a, b)
    elif PRECISION == "tf32":
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b (fp32 accumulation); a, b already in the MMA operand type."""
    if PRECISION == "bf16" or PRECISION == "fp16":
        return tl.dot(a, b, acc)
    elif PRECISION == "tf32":
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def online_softmax_tile(s, valid, m_i, l_i):
    """One key tile's logits s [M, K] (base 2; valid [K]) into a running softmax: (m, l, p,
    alpha) with p = 2^(s - m) of the tile and alpha the factor rescaling what was summed
    before. Rows with no valid key yet keep m = -inf, p = 0 (no (-inf) - (-inf))."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return m_new, l_i * alpha + tl.sum(p, axis=1), p, alpha
