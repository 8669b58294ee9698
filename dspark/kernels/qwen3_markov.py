"""One Markov step of the DeepSpec (Qwen3) vanilla head in one launch: the corrected logits of slot
k and its confidence, for a vocabulary too wide for kernels/markov_loop.py (151936 for Qwen3).

    e     = W1[prev]                                  (gathered by each program)
    z     = base[:, k] + (W2 e rounded to W2's dtype)  fp32 [R, V]  (markov_w2(e).float() + U_k)
    conf  = conf_base[:, k] + e.f32 · w_e              fp32 [R]     (w_e: the confidence weight's
                                                                     W1 part; conf_base = w_h·h_k + b)

which the torch path spells as an embedding gather, the r x V GEMV, a cast, the add of the base
logits and, for the confidence, a concatenation, casts and an fp32 linear: ~10 launches per step.
One program = BLOCK_V vocabulary columns for every request (its W2 tile loaded once); program 0
also writes the confidences. Sums run in fp32 (differences from torch: summation order only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 64


@triton.jit
def _markov_step_kernel(base_ptr, stride_br, prev_ptr, w1_ptr, w2_ptr, cb_ptr, stride_cr, we_ptr,
                        z_ptr, conf_ptr, R, V, RANK, HAS_CONF_E: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_RANK: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
    c_ok = cols < V
    j = tl.arange(0, BLOCK_RANK)
    j_ok = j < RANK
    w2 = tl.load(w2_ptr + cols.to(tl.int64)[:, None] * RANK + j[None, :],
                 mask=c_ok[:, None] & j_ok[None, :], other=0.0)
    dt = w2_ptr.dtype.element_ty
    w2 = w2.to(tl.float32)
    for r in range(R):
        tok = tl.load(prev_ptr + r).to(tl.int64)
        e = tl.load(w1_ptr + tok * RANK + j, mask=j_ok, other=0.0).to(tl.float32)
        b = tl.sum(w2 * e[None, :], axis=1).to(dt).to(tl.float32)
        u = tl.load(base_ptr + r * stride_br + cols, mask=c_ok, other=0.0)
        tl.store(z_ptr + r * V + cols, u + b, mask=c_ok)
        if tl.program_id(0) == 0:
            c = tl.load(cb_ptr + r * stride_cr)
            if HAS_CONF_E:
                c += tl.sum(e * tl.load(we_ptr + j, mask=j_ok, other=0.0), axis=0)
            tl.store(conf_ptr + r, c)


def markov_step(base_k: torch.Tensor, prev: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                conf_base_k: torch.Tensor, conf_w_e: torch.Tensor | None):
    """(z fp32 [R, V], conf fp32 [R]) for base logits base_k fp32 [R, V] (unit column stride),
    prev int64 [R], W1 / W2 [V, r] contiguous of one dtype, conf_base_k fp32 [R] and conf_w_e
    fp32 [r] (None: the confidence does not read e)."""
    R, V = base_k.shape
    rank = w1.shape[1]
    assert base_k.stride(1) == 1 and w1.is_contiguous() and w2.is_contiguous() \
        and w1.shape == w2.shape and w1.shape[0] == V and base_k.dtype == torch.float32
    z = torch.empty(R, V, dtype=torch.float32, device=base_k.device)
    conf = torch.empty(R, dtype=torch.float32, device=base_k.device)
    if R:
        _markov_step_kernel[(triton.cdiv(V, BLOCK_V),)](
            base_k, base_k.stride(0), prev.contiguous(), w1, w2, conf_base_k,
            conf_base_k.stride(0), conf_w_e if conf_w_e is not None else conf, z, conf, R, V, rank,
            HAS_CONF_E=conf_w_e is not None, BLOCK_V=BLOCK_V,
            BLOCK_RANK=max(16, triton.next_power_of_2(rank)), num_warps=4)
    return z, conf
