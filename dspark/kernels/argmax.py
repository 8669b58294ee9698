"""Row argmax of logits [R, V] in two small launches, exactly torch's `argmax(-1)`: the first index
of the maximum, NaN counting as larger than everything (the first NaN wins), -0.0 equal to +0.0.

Each value becomes an int32 key whose signed order is the float order (negative values get their
magnitude bits flipped; NaN the largest key; -0.0 first turned into +0.0), so both passes are
integer argmaxes with ties going to the lower index:
  1. chunks of CHUNK columns: each program stores its chunk's largest key and its first index;
  2. one program per row takes the first chunk with the row's largest key, and its index.
The first chunk holding the maximum holds its first index, so the result is the global first.
On the H200 this replaces torch's 5 launches (chunk max, argmax of those, gather, index
arithmetic, copy: ~13 us at the end of every decode step for a 129k vocabulary).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096


@triton.jit
def _order_key(v):
    """fp32 -> int32 with the same order (NaN largest, -0.0 == +0.0)."""
    v = v + 0.0                                           # -0.0 -> +0.0
    b = v.to(tl.int32, bitcast=True)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)
    return tl.where(v != v, 0x7FFFFFFF, key)


@triton.jit
def _chunk_argmax_kernel(x_ptr, stride_x, key_ptr, idx_ptr, V, C, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    v = tl.load(x_ptr + r.to(tl.int64) * stride_x + cols, mask=ok, other=float("-inf"))
    key = tl.where(ok, _order_key(v.to(tl.float32)), -2147483647 - 1)
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best, cols, V), axis=0)
    tl.store(key_ptr + r * C + c, best)
    tl.store(idx_ptr + r * C + c, first)


@triton.jit
def _row_argmax_kernel(key_ptr, idx_ptr, out_ptr, C, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    ok = c < C
    key = tl.load(key_ptr + r * C + c, mask=ok, other=-2147483647 - 1)
    best = tl.max(key, axis=0)
    first_chunk = tl.min(tl.where(ok & (key == best), c, C), axis=0)
    tl.store(out_ptr + r, tl.load(idx_ptr + r * C + first_chunk).to(tl.int64))


def supported(x: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] > 0 and 0 < x.shape[1] < 2 ** 31 and x.stride(1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16))


def row_argmax_of_chunks(keys: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The second pass alone, over chunk results [R, C] another kernel stored (the vocabulary
    head's GEMV stores them per program: fp8_gemm's key_ptr / idx_ptr): out int64 [R]."""
    R, C = keys.shape
    _row_argmax_kernel[(R,)](keys, idx, out, C, BLOCK_C=triton.next_power_of_2(C),
                             num_warps=1 if C <= 256 else 4)
    return out


def row_argmax(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R]: x.argmax(-1) of x [R, V] (unit column stride); into `out` when given."""
    assert supported(x), (x.shape, x.stride(), x.dtype)
    R, V = x.shape
    block = min(CHUNK, triton.next_power_of_2(V))
    C = triton.cdiv(V, block)
    keys = torch.empty(R, C, dtype=torch.int32, device=x.device)
    idx = torch.empty(R, C, dtype=torch.int32, device=x.device)
    if out is None:
        out = torch.empty(R, dtype=torch.long, device=x.device)
    _chunk_argmax_kernel[(R, C)](x, x.stride(0), keys, idx, V, C, BLOCK=block,
                                 num_warps=8 if block >= 2048 else 4)
    _row_argmax_kernel[(R,)](keys, idx, out, C, BLOCK_C=triton.next_power_of_2(C), num_warps=1)
    return out
