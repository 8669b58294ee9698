"""Fused RMSNorm + RoPE for the decode path: one launch where the torch composition takes 3-7.

`norm_rope(x, ...)` computes, per row of x [T, D] or [T, H, D] (the same chain of ops and
roundings as the model's torch code, which `dspark.models.deepseek_v4.norm.norm_rope` runs
elsewhere):

    v = x rounded to `dtype`                                   (e.g. fp32 attention output -> bf16)
    v = (v · rsqrt(mean(v²) + eps) [· w]) rounded to `dtype`   (if eps is not None; fp32 math)
    v[-r:] = rotate(v[-r:], cis[t]) rounded to `dtype`         (if cis is not None: interleaved
                                                                pairs times e^{±i·p·f})
    stored in `out_dtype`

Used for RMSNorm (x.float() -> rms_norm -> .to(dtype): 3 launches), the per-head q norm + RoPE
(6), kv_norm + RoPE (7), compressed-entry cast + norm + RoPE (8), the inverse RoPE of the
attention output (5) and the indexer query RoPE (5).

Only the order of the sum of squares and the rsqrt implementation differ from torch. bf16 roundings
are done by bit arithmetic (cache_write._bf16_round) so that the interpreter, whose float
down-cast does not round to nearest even, gives the GPU's bytes. One program per row (token,
head); the row is loaded once for the sum of squares and its rotated pairs once more as (even,
odd) vectors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.cuda import pdl
from dspark.kernels.cache_write import _bf16_round

ROUNDINGS = {torch.float32: 0, torch.bfloat16: 1}


@triton.jit
def _rnd(v, ROUND: tl.constexpr):
    if ROUND == 1:
        v = _bf16_round(v)
    return v


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cis_ptr, out_ptr, H, D, R_HALF,
                      stride_xt, stride_xh, stride_ot, stride_oh, stride_wh, eps, pos_ptr,
                      ROUND_IN: tl.constexpr, NORM: tl.constexpr, HAS_W: tl.constexpr,
                      ROPE: tl.constexpr, ROUND: tl.constexpr,
                      BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, GATHER: tl.constexpr,
                      PDL: tl.constexpr = False):
    # PDL (dspark.cuda.pdl): the next kernel (a weight-streaming GEMV) may start now;
    # it waits for this grid before reading anything this one writes
    pdl.launch_dependents(PDL)
    row = tl.program_id(0)
    t = row // H
    h = row % H
    cis_row = t
    if GATHER:                                    # cis is the whole table: row = position of t
        cis_row = tl.load(pos_ptr + t).to(tl.int64)
    src = x_ptr + t * stride_xt + h * stride_xh
    dst = out_ptr + t * stride_ot + h * stride_oh
    w_ptr += h * stride_wh                        # per-head weights (stride 0: one for all)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # every load first (none depends on this program's arithmetic; the rotation's table row on
    # the position only): one memory round trip before the reductions instead of one per use
    v = tl.load(src + d, mask=d_ok, other=0.0).to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    n_plain = D
    if ROPE:
        n_plain = D - 2 * R_HALF
        i = tl.arange(0, BLOCK_R)
        i_ok = i < R_HALF
        pe = n_plain + 2 * i                      # even element of pair i; odd = pe + 1
        re = tl.load(src + pe, mask=i_ok, other=0.0).to(tl.float32)
        im = tl.load(src + pe + 1, mask=i_ok, other=0.0).to(tl.float32)
        if HAS_W:
            w_re = tl.load(w_ptr + pe, mask=i_ok, other=0.0).to(tl.float32)
            w_im = tl.load(w_ptr + pe + 1, mask=i_ok, other=0.0).to(tl.float32)
        c = tl.load(cis_ptr + cis_row * 2 * R_HALF + 2 * i, mask=i_ok, other=0.0)
        s = tl.load(cis_ptr + cis_row * 2 * R_HALF + 2 * i + 1, mask=i_ok, other=0.0)
    if ROUND_IN:
        v = _rnd(v, ROUND)
    rstd = 1.0
    if NORM:
        rstd = tl.math.rsqrt(tl.sum(v * v, axis=0) / D + eps)
        v = v * rstd
        if HAS_W:
            v = v * w
        v = _rnd(v, ROUND)
    tl.store(dst + d, v.to(out_ptr.dtype.element_ty), mask=d < n_plain)
    if ROPE:
        if ROUND_IN:
            re = _rnd(re, ROUND)
            im = _rnd(im, ROUND)
        if NORM:
            re = re * rstd
            im = im * rstd
            if HAS_W:
                re = re * w_re
                im = im * w_im
            re = _rnd(re, ROUND)
            im = _rnd(im, ROUND)
        out_re = _rnd(re * c - im * s, ROUND)     # (re + i·im)(c + i·s), as complex64 multiplies
        out_im = _rnd(re * s + im * c, ROUND)
        tl.store(dst + pe, out_re.to(out_ptr.dtype.element_ty), mask=i_ok)
        tl.store(dst + pe + 1, out_im.to(out_ptr.dtype.element_ty), mask=i_ok)


def supported(x: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether the kernel handles these dtypes / layout (else use the torch composition)."""
    return (dtype in ROUNDINGS and out_dtype in (torch.float32, torch.bfloat16)
            and x.dtype in (torch.float32, torch.bfloat16) and x.dim() in (2, 3)
            and x.stride(-1) == 1)


def norm_rope(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None,
              cis: torch.Tensor | None = None, rope_dim: int = 0, dtype: torch.dtype | None = None,
              out_dtype: torch.dtype | None = None,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """See the module doc. x [T, D] or [T, H, D] (last dim contiguous); weight [D], [H, D] (head
    h's row for head h: several norms of one width in one launch) or None;
    eps None = no normalisation; cis complex64 [T, rope_dim/2] (already conjugated for the
    inverse rotation) or None; dtype (rounding, default x.dtype), out_dtype (default dtype).
    positions [T] (integers): cis is then a whole table [>= max position + 1, rope_dim/2] and
    row t rotates by cis[positions[t]] (the gather happens in the kernel: no launch for it;
    positions are not bounds-checked: size the table from a host-side bound)."""
    dtype = dtype or x.dtype
    out_dtype = out_dtype or dtype
    assert supported(x, dtype, out_dtype), (x.dtype, x.shape, x.stride(), dtype, out_dtype)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    T, H, D = x3.shape
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    o3 = out if out.dim() == 3 else out.unsqueeze(1)
    if T * H == 0:
        return out
    r_half = rope_dim // 2 if cis is not None else 0
    gather = cis is not None and positions is not None
    if cis is not None:
        rows = cis.shape[0] if gather else T
        assert cis.shape == (rows, r_half) and cis.dtype == torch.complex64, (cis.shape, T, r_half)
        cis = torch.view_as_real(cis.contiguous())
    if gather:
        assert positions.shape == (T,), (positions.shape, T)
        positions = positions.contiguous()
    if weight is not None:
        assert weight.shape in ((D,), (H, D)) and weight.is_contiguous(), weight.shape
    block_d = triton.next_power_of_2(D)
    _norm_rope_kernel[(T * H,)](
        x3, weight if weight is not None else x3, cis if cis is not None else x3, o3,
        H, D, r_half, x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1),
        D if weight is not None and weight.dim() == 2 else 0,
        float(eps) if eps is not None else 0.0, positions if gather else x3,
        ROUND_IN=x.dtype != dtype, NORM=eps is not None, HAS_W=weight is not None,
        ROPE=cis is not None, ROUND=ROUNDINGS[dtype], BLOCK_D=block_d,
        BLOCK_R=triton.next_power_of_2(max(r_half, 1)), GATHER=gather, PDL=pdl.enabled(x.device),
        num_warps=4 if block_d <= 1024 else 8)
    return out
