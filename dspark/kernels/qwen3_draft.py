"""The DeepSpec (Qwen3) drafter's elementwise fusions: one launch each where the eager modules
(dspark.models.qwen3) issue 5 to 25 small kernels, with the same rounding points.

    block_embed:      ids = [anchor, mask x (γ-1)], positions P..P+γ-1 -> embedding rows, positions
    add_rms_norm:     h = (h + x) rounded to dtype;  y = w * (h.f32 * rsqrt(mean(h.f32²) + eps)).to(dtype)
    qk_norm_rope:     the q and k heads of a stacked q|k|v projection: per-head RMSNorm (q_norm /
                      k_norm) then rotate-half RoPE at the row's position, as `apply_rope`
                      (each product and the sum rounded to dtype, cos / sin rounded to dtype)
    kv_norm_rope_to_pool: the k|v heads of a context row -> k_norm + RoPE, stored with v at
                      (slot, position) of a draft context pool
    silu_mul:         silu(g) * u of a stacked gate|up projection (silu rounded, then the product)

RoPE angles are computed in the kernels: position (fp32) x inv_freq (fp32, from `rope_inv_freq`,
torch's formula), then cos / sin in fp32; torch's `rope_cos_sin` does the same products, so the
tables agree up to the last fp32 ulp of cos / sin (then the rounding to dtype).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def rope_inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    """fp32 [head_dim / 2]: `rope_cos_sin`'s inverse frequencies."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)


@triton.jit
def _block_embed_kernel(anchor_ptr, start_ptr, embed_ptr, stride_e, h_ptr, pos_ptr, mask_id, N,
                        G: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    r, i = t // G, t % G
    tok = tl.where(i == 0, tl.load(anchor_ptr + r), mask_id).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    tl.store(h_ptr + t.to(tl.int64) * N + c, tl.load(embed_ptr + tok * stride_e + c, mask=ok), mask=ok)
    tl.store(pos_ptr + t, tl.load(start_ptr + r) + i)


def block_embed(embed: torch.Tensor, anchors: torch.Tensor, starts: torch.Tensor, gamma: int,
                mask_id: int):
    """(h [R·γ, H] = embed rows of [anchor, mask x (γ-1)] per request, positions int64 [R·γ] =
    start + 0..γ-1) for anchors / starts int64 [R]."""
    R, N = anchors.shape[0], embed.shape[1]
    assert embed.stride(1) == 1
    h = torch.empty(R * gamma, N, dtype=embed.dtype, device=embed.device)
    pos = torch.empty(R * gamma, dtype=torch.int64, device=embed.device)
    if R:
        _block_embed_kernel[(R * gamma,)](anchors.contiguous(), starts.contiguous(), embed,
                                          embed.stride(0), h, pos, int(mask_id), N, G=gamma,
                                          BLOCK=triton.next_power_of_2(N), num_warps=4)
    return h, pos


@triton.jit
def _add_rms_norm_kernel(h_ptr, x_ptr, w_ptr, sum_ptr, out_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    dt = out_ptr.dtype.element_ty
    h = (tl.load(h_ptr + row * N + c, mask=ok, other=0.0).to(tl.float32) +
         tl.load(x_ptr + row * N + c, mask=ok, other=0.0).to(tl.float32)).to(dt)
    tl.store(sum_ptr + row * N + c, h, mask=ok)
    y = h.to(tl.float32)
    r = tl.rsqrt(tl.sum(y * y, 0) / N + eps)
    w = tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + c, (w * (y * r).to(dt).to(tl.float32)).to(dt), mask=ok)


def add_rms_norm(h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float):
    """(h + x, RMSNorm(h + x)) for contiguous h, x [T, N] of one dtype, weight [N] of it."""
    assert h.shape == x.shape and h.dtype == x.dtype == weight.dtype and h.dim() == 2
    h, x = h.contiguous(), x.contiguous()
    T, N = h.shape
    s, out = torch.empty_like(h), torch.empty_like(h)
    if T:
        _add_rms_norm_kernel[(T,)](h, x, weight, s, out, N, eps, BLOCK=triton.next_power_of_2(N),
                                   num_warps=8 if N >= 2048 else 4)
    return s, out


@triton.jit
def _norm_rope_head(x_ptr, w_ptr, pos, inv_ptr, eps, dt, D: tl.constexpr, HALF: tl.constexpr):
    """(first half, second half) of RoPE(RMSNorm(head)) in fp32, each value rounded to dt."""
    c = tl.arange(0, HALF)
    x1 = tl.load(x_ptr + c).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + c).to(tl.float32)
    r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
    n1 = (tl.load(w_ptr + c).to(tl.float32) * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    n2 = (tl.load(w_ptr + HALF + c).to(tl.float32) * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    f = pos.to(tl.float32) * tl.load(inv_ptr + c)        # the table's halves are equal (cat)
    cs = tl.cos(f).to(dt).to(tl.float32)
    sn = tl.sin(f).to(dt).to(tl.float32)
    o1 = (n1 * cs).to(dt).to(tl.float32) + (-n2 * sn).to(dt).to(tl.float32)
    o2 = (n2 * cs).to(dt).to(tl.float32) + (n1 * sn).to(dt).to(tl.float32)
    return o1.to(dt), o2.to(dt)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, stride_t, pos_ptr, qw_ptr, kw_ptr, inv_ptr, out_ptr, NQ, eps,
                         D: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dt = out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t)
    src = qkv_ptr + t * stride_t + h * D
    if h < NQ:
        o1, o2 = _norm_rope_head(src, qw_ptr, pos, inv_ptr, eps, dt, D, HALF)
    else:
        o1, o2 = _norm_rope_head(src, kw_ptr, pos, inv_ptr, eps, dt, D, HALF)
    dst = out_ptr + (t * tl.num_programs(1) + h) * D
    c = tl.arange(0, HALF)
    tl.store(dst + c, o1)
    tl.store(dst + HALF + c, o2)


def qk_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, nq: int, nkv: int):
    """(q [T, nq, d], k [T, nkv, d]): views of one [T, nq + nkv, d] output) from the stacked
    projection qkv [T, (nq + 2 nkv) d] (rows contiguous), positions int64 [T]."""
    T, d = qkv.shape[0], q_weight.shape[0]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (nq + 2 * nkv) * d and d & (d - 1) == 0
    out = torch.empty(T, nq + nkv, d, dtype=qkv.dtype, device=qkv.device)
    if T:
        _qk_norm_rope_kernel[(T, nq + nkv)](qkv, qkv.stride(0), positions, q_weight, k_weight,
                                            inv_freq, out, nq, eps, D=d, HALF=d // 2, num_warps=1)
    return out[:, :nq], out[:, nq:]


@triton.jit
def _kv_to_pool_kernel(kv_ptr, stride_t, slot_ptr, pos_ptr, kw_ptr, inv_ptr, pk_ptr, pv_ptr,
                       stride_ps, stride_pr, NKV, eps, D: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dt = pk_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t)
    at = tl.load(slot_ptr + t) * stride_ps + pos * stride_pr + h * D
    c = tl.arange(0, HALF)
    o1, o2 = _norm_rope_head(kv_ptr + t * stride_t + h * D, kw_ptr, pos, inv_ptr, eps, dt, D, HALF)
    tl.store(pk_ptr + at + c, o1)
    tl.store(pk_ptr + at + HALF + c, o2)
    v = kv_ptr + t * stride_t + (NKV + h) * D
    tl.store(pv_ptr + at + c, tl.load(v + c).to(dt))
    tl.store(pv_ptr + at + HALF + c, tl.load(v + HALF + c).to(dt))


def kv_norm_rope_to_pool(kv: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                         k_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor,
                         pool_k: torch.Tensor, pool_v: torch.Tensor) -> None:
    """pool_k[slot, pos] = RoPE(k_norm(k)), pool_v[slot, pos] = v for the rows of kv [n, 2 nkv d]
    (k heads, then v heads; rows contiguous) at slots / positions int64 [n]; pools [S, rows,
    nkv, d] contiguous. (slot, position) pairs distinct."""
    n, (S, rows, nkv, d) = kv.shape[0], pool_k.shape
    assert kv.stride(1) == 1 and kv.shape[1] == 2 * nkv * d and pool_k.is_contiguous() \
        and pool_v.is_contiguous() and pool_v.shape == pool_k.shape
    if n:
        _kv_to_pool_kernel[(n, nkv)](kv, kv.stride(0), slots, positions, k_weight, inv_freq,
                                     pool_k, pool_v, pool_k.stride(0), pool_k.stride(1), nkv, eps,
                                     D=d, HALF=d // 2, num_warps=1)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, I, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < I
    dt = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + t * 2 * I + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * 2 * I + I + c, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + t * I + c, (s * u).to(dt), mask=ok)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(gu[:, :I]) * gu[:, I:] for a contiguous stacked gate|up output [T, 2I]."""
    T, I = gu.shape[0], gu.shape[1] // 2
    assert gu.is_contiguous() and gu.shape[1] == 2 * I
    out = torch.empty(T, I, dtype=gu.dtype, device=gu.device)
    if T:
        BLOCK = min(1024, triton.next_power_of_2(I))
        _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](gu, out, I, BLOCK=BLOCK, num_warps=4)
    return out
