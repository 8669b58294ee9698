"""Fused Qwen3 RMSNorm and per-head RMSNorm + RoPE (Triton), rounding like the eager modules.

At batch 1 a decode step is bound by kernel count, not bytes: the eager HF-style RMSNorm is ~8
elementwise kernels and q_norm/k_norm + rotate-half RoPE another ~12 per projection. These do
each in one kernel and reproduce the eager rounding points (dspark.models.qwen3):

    rms_norm:       y = w * (x.f32 * rsqrt(mean(x.f32²) + eps)).to(dtype)        (product in dtype)
    head_norm_rope: n = rms_norm(x_head); out = n*cos + rotate_half(n)*sin      (each product and
                    the sum rounded to dtype, cos/sin given in dtype)

so results differ from the eager path only by the fp32 reduction order of the mean.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    ok = c < N
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    y = (x * r).to(dt).to(tl.float32)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + c, (w * y).to(dt), mask=ok)


@triton.jit
def _head_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh,
                           stride_ct, stride_ot, stride_oh, eps,
                           D: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    c = tl.arange(0, HALF)
    xb = x_ptr + t * stride_xt + h * stride_xh
    x1 = tl.load(xb + c).to(tl.float32)
    x2 = tl.load(xb + HALF + c).to(tl.float32)
    r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
    n1 = (tl.load(w_ptr + c).to(tl.float32) * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    n2 = (tl.load(w_ptr + HALF + c).to(tl.float32) * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    cb, sb = cos_ptr + t * stride_ct, sin_ptr + t * stride_ct
    c1, c2 = tl.load(cb + c).to(tl.float32), tl.load(cb + HALF + c).to(tl.float32)
    s1, s2 = tl.load(sb + c).to(tl.float32), tl.load(sb + HALF + c).to(tl.float32)
    o1 = (n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)
    o2 = (n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)
    ob = out_ptr + t * stride_ot + h * stride_oh
    tl.store(ob + c, o1.to(dt))
    tl.store(ob + HALF + c, o2.to(dt))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., N] (last dim contiguous), weight [N] of x's dtype -> [..., N]."""
    assert weight.dtype == x.dtype and x.stride(-1) == 1, (weight.dtype, x.dtype, x.stride())
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), N, eps,
                                     BLOCK=triton.next_power_of_2(N),
                                     num_warps=8 if N >= 2048 else 4)
    return out.view(x.shape)


def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, d] (d contiguous, power of two), weight [d], cos/sin [T, d] in x's dtype
    (`rope_cos_sin` halves duplicated) -> rotate-half RoPE of RMSNorm(x) per head, [T, H, d]."""
    T, H, D = x.shape
    assert weight.dtype == x.dtype and cos.dtype == x.dtype and x.stride(2) == 1
    assert D & (D - 1) == 0 and cos.stride(1) == 1 and cos.stride() == sin.stride()
    out = torch.empty((T, H, D), dtype=x.dtype, device=x.device)
    _head_norm_rope_kernel[(T, H)](x, weight, cos, sin, out, x.stride(0), x.stride(1),
                                   cos.stride(0), out.stride(0), out.stride(1), eps,
                                   D=D, HALF=D // 2, num_warps=1)
    return out
