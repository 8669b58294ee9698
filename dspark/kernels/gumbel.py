"""Gumbel-max draws keyed by (seed, position) in one Triton launch: the deterministic mode's
sampler on CUDA (`dspark.spec.gumbel`), for rows without top-k / top-p.

Row n's token is argmax_v (x_v / T_n + g_v) with g_v = -log(-log u_v), u_v the 52-bit uniform
`spec.gumbel._noise_of_keys` derives from the key of (seed_n, position_n) and v (the same integer
hash, in int64 here as there), or argmax_v x_v where T_n = 0. The torch path builds the noise in
~100 elementwise launches per draw; here it never leaves the registers. Ties go to the lowest
index, as torch's argmax.

x / T is an IEEE division (div_rn, torch's), the noise and the sum are float64: scores equal the
torch path's wherever the device's float64 log does (libdevice's, CUDA's math library). A row's
result is a function of its own logits, temperature, seed and position: it does not depend on
the other rows or on the split of V (each split keeps its first best index; the splits are
compared in index order).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.formats.sampling import _M32, Purpose, _mix32

from .common import interpreting
from .sampling import _mix32_jit

# `spec.gumbel._key`'s start state: the purpose-only word, mixed once
_KEY_START = _mix32((0x9E3779B9 * (int(Purpose.GUMBEL) + 1)) & _M32)


@triton.jit
def gumbel_key(start, seed, pos):
    """(h, h2): `spec.gumbel._key(seed, pos)` (start = _KEY_START) and the second word's mix
    `_noise_of_keys` derives from it, for int64 seed / pos."""
    m32 = tl.full([], 0xFFFFFFFF, tl.int64)
    h = _mix32_jit(start ^ (seed & m32))
    h = _mix32_jit(h ^ ((seed >> 32) & m32))
    h = _mix32_jit(h ^ ((pos >> 32) & m32))
    h = _mix32_jit(h ^ (pos & m32))
    return h, _mix32_jit(h ^ 0x85EBCA6B)


@triton.jit
def gumbel_scores(x, t, offs, h, h2):
    """float64 x / t (IEEE division in fp32, as torch's) + the Gumbel noise of token ids offs
    under key (h, h2): `spec.gumbel`'s 52-bit uniforms, -log(-log u)."""
    w1 = _mix32_jit(offs.to(tl.int64) ^ h)
    w2 = _mix32_jit(w1 ^ h2)
    k = (w1 >> 6) * 67108864 + (w2 >> 6)                               # 52 bits
    u = (k.to(tl.float64) + 0.5) * 2.220446049250313e-16               # in (0, 1), exact
    return tl.math.div_rn(x, t).to(tl.float64) - tl.log(-tl.log(u))


@triton.jit
def _gumbel_argmax_kernel(x_ptr, stride_n, stride_v, temp_ptr, seed_ptr, pos_ptr, val_ptr,
                          idx_ptr, V, chunk, S, start, BLOCK_V: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    temp = tl.load(temp_ptr + n)
    greedy = temp == 0
    t = tl.where(greedy, 1.0, temp)
    h, h2 = gumbel_key(start, tl.load(seed_ptr + n), tl.load(pos_ptr + n))
    lo = s * chunk
    hi = tl.minimum(lo + chunk, V)
    best = tl.full([], float("-inf"), tl.float64)
    best_i = tl.full([], 0, tl.int32) + lo          # (all -inf: the first index, as torch)
    row = x_ptr + n * stride_n
    for off in range(lo, hi, BLOCK_V):
        offs = off + tl.arange(0, BLOCK_V)
        ok = offs < hi
        x = tl.load(row + offs.to(tl.int64) * stride_v, mask=ok, other=0.0).to(tl.float32)
        score = tl.where(greedy, x.to(tl.float64), gumbel_scores(x, t, offs, h, h2))
        score = tl.where(ok, score, float("-inf"))
        m = tl.max(score, 0)
        i = tl.argmax(score, 0, tie_break_left=True).to(tl.int32) + off
        better = m > best                            # ties: the earlier block's index
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, m, best)
    tl.store(val_ptr + n * S + s, best)
    tl.store(idx_ptr + n * S + s, best_i.to(tl.int64))


def gumbel_argmax(rows: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor) -> torch.Tensor:
    """int64 [N]: per row of rows [N, V] (any float dtype, any strides) the Gumbel-max token
    keyed by (seeds[n], positions[n]) at temperature[n] (fp32 [N]; 0: the plain argmax). No host
    sync, fixed launch sizes for a given (N, V): a CUDA graph can hold it."""
    if rows.dim() != 2:
        raise ValueError(f"gumbel_argmax: rows must be [N, V], got shape {tuple(rows.shape)}")
    N, V = rows.shape
    dev = rows.device
    if N == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    temp = temperature.to(device=dev, dtype=torch.float32).reshape(N).contiguous()
    seeds = seeds.to(device=dev, dtype=torch.int64).reshape(N).contiguous()
    positions = positions.to(device=dev, dtype=torch.int64).reshape(N).contiguous()
    block = 64 if interpreting() else min(triton.next_power_of_2(V), 1024)
    # split V across programs only where the rows alone leave the SMs idle (large vocabularies)
    splits = max(1, min(triton.cdiv(V, block), triton.cdiv(256, N)))
    chunk = triton.cdiv(triton.cdiv(V, splits), block) * block
    splits = triton.cdiv(V, chunk)
    val = torch.empty(N, splits, dtype=torch.float64, device=dev)
    idx = torch.empty(N, splits, dtype=torch.int64, device=dev)
    _gumbel_argmax_kernel[(N, splits)](rows, rows.stride(0), rows.stride(1), temp, seeds,
                                       positions, val, idx, V, chunk, splits, _KEY_START,
                                       BLOCK_V=block, num_warps=4)
    if splits == 1:
        return idx[:, 0]
    # the first split holding the row's maximum: the lowest index among ties
    return idx.gather(1, val.argmax(1, keepdim=True))[:, 0]


__all__ = ["gumbel_argmax"]
