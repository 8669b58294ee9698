"""Routed experts computed straight from packed FP4 weights (spec §5.2, §3.8).

    y = fp4_linear(x, packed, scale)    # x [..., K], packed int8 [N, K/2] (two e2m1 codes per
                                        # byte, low nibble = even column), scale e8m0 [N, ceil(K/32)]
    out = fp4_moe(x, idx, w, experts, swiglu_limit)   # routed-expert sum, fp32 [T, D]

FP4 GEMM kernel: one program = BLOCK_M tokens x BLOCK_N output rows; each K step loads a
[BLOCK_N, BLOCK_K/2] byte tile, splits it into the even-column (low nibble) and odd-column (high
nibble) halves, turns each 4-bit code into its exact value with a bit trick (code bits -> fp16
bits: e2m1 value = fp16(code << 9) * 2^14, subnormal 0.5 included; the 2^14 is folded into the
decoded UE8M0 scale), multiplies by the row's group scale (gathered per byte column: one scale per
16 bytes) and feeds two MMAs against the even / odd columns of x (strided loads). Values
`e2m1 * 2^k` are exact in bf16, so on GPU the MMA operands are the exact weights; accumulation is
fp32. Activations are not quantized (same choice as fp8_gemm).

fp4_moe: token -> expert grouping by a stable argsort of the flattened top-k ids (identical order to
the reference MoE), then per used expert (one expert group at a time): g = x W1^T, u = x W3^T in
fp32, clamped SwiGLU (u in [-limit, limit], g <= limit), routing weight applied before W2, h cast to
x.dtype, y = h W2^T, index_add into an fp32 output. Numerically this is exactly the reference
`MoE.forward` with de-quantized experts (torch backend: bit-identical on CPU). A single launch over
all experts (a stacked [E, ...] layout or a pointer table + per-expert token offsets) is the next
step for the H200; this module keeps the per-expert loop.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark.kernels.fp8_gemm import _interpreting, flat_operands
from dspark.kernels.sparse_mqa import _mma, _pick_precision
from dspark.models.quant import FP4_GROUP, dequant_fp4_experts, fp4_scale_shape


@triton.jit
def _e2m1_times_2pow14(code):
    """4-bit e2m1 code (int32 0..15) -> fp32 value * 2^-14 (exact, via fp16 bits)."""
    mag = ((code & 7) << 9).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _fp4_linear_kernel(
    x_ptr, stride_xt, w_ptr, stride_wn, s_ptr, stride_sn, y_ptr, stride_yt,
    T, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    jb = tl.arange(0, BLOCK_K // 2)                       # byte column inside the tile
    m_ok = rm < T
    n_ok = rn < N
    KB = (K + 1) // 2
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 2 + jb
        b_ok = kb < KB
        wmask = n_ok[:, None] & b_ok[None, :]
        wb = tl.load(w_ptr + rn[:, None] * stride_wn + kb[None, :], mask=wmask, other=0)
        wb = wb.to(tl.int32) & 0xFF
        sb = tl.load(s_ptr + rn[:, None] * stride_sn + (kb // (32 // 2))[None, :], mask=wmask,
                     other=0).to(tl.int32)
        sc = ((sb + 14) << 23).to(tl.float32, bitcast=True)    # 2^(b-127) * 2^14
        w_even = _e2m1_times_2pow14(wb & 0xF) * sc               # columns k0 + 2j
        w_odd = _e2m1_times_2pow14(wb >> 4) * sc                 # columns k0 + 2j + 1
        ke = 2 * kb
        xe = tl.load(x_ptr + rm[:, None] * stride_xt + ke[None, :],
                     mask=m_ok[:, None] & (ke < K)[None, :], other=0.0)
        xo = tl.load(x_ptr + rm[:, None] * stride_xt + (ke + 1)[None, :],
                     mask=m_ok[:, None] & (ke + 1 < K)[None, :], other=0.0)
        acc += _mma(xe, tl.trans(w_even), PRECISION)
        acc += _mma(xo, tl.trans(w_odd), PRECISION)
    tl.store(y_ptr + rm[:, None] * stride_yt + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def _check(x, packed, scale):
    if packed.dim() != 2 or packed.element_size() != 1:
        raise ValueError(f"fp4_linear: packed weight must be 2-D int8/uint8 [N, K/2], got "
                         f"{tuple(packed.shape)} {packed.dtype}")
    N, K = packed.shape[0], 2 * packed.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"fp4_linear: x has {x.shape[-1]} features, packed weight expects {K}")
    if tuple(scale.shape) != fp4_scale_shape(N, K):
        raise ValueError(f"fp4_linear: scale shape {tuple(scale.shape)}, expected "
                         f"{fp4_scale_shape(N, K)}")
    return N, K


def fp4_linear_torch(x, packed, scale):
    """Reference / CPU path: exact de-quantization to x.dtype, then F.linear."""
    _check(x, packed, scale)
    return F.linear(x, dequant_fp4_experts(packed, scale, x.dtype))


def fp4_linear_triton(x, packed, scale, precision: str | None = None, block=None):
    N, K = _check(x, packed, scale)
    lead = x.shape[:-1]
    x2, wu, su = flat_operands(x, K, packed, scale)
    T = x2.shape[0]
    if T == 0:
        return x.new_zeros(*lead, N)
    if block is None:
        block = (16, 32, 64) if _interpreting() else ((16, 64, 128) if T <= 64 else (64, 128, 128))
    BM, BN, BK = block
    assert BK % (2 * FP4_GROUP) == 0 or BK == FP4_GROUP, BK
    y = torch.empty(T, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, BM), triton.cdiv(N, BN))
    _fp4_linear_kernel[grid](x2, x2.stride(0), wu, wu.stride(0), su, su.stride(0), y, y.stride(0),
                             T, N, K, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                             PRECISION=_pick_precision(x.dtype, precision))
    return y.to(x.dtype).reshape(*lead, N)


def fp4_linear(x, packed, scale, backend: str = "auto", precision: str | None = None):
    """x [..., K] @ dequant(packed [N, K/2], scale)^T -> [..., N] in x.dtype (fp32 accumulation)."""
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        return fp4_linear_torch(x, packed, scale)
    if backend == "triton":
        return fp4_linear_triton(x, packed, scale, precision)
    raise ValueError(f"fp4_linear: backend={backend!r}; use 'auto', 'triton' or 'torch'")


def swiglu_expert(x, w1, w3, w2, linear, limit: float, weight=None):
    """One clamped-SwiGLU expert with `linear(x, (w, scale))` GEMMs; same op order as the
    reference `Expert.forward` (fp32 activation math, routing weight before w2)."""
    g = linear(x, w1).float()
    u = linear(x, w3).float()
    if limit > 0:
        u = u.clamp(-limit, limit)
        g = g.clamp(max=limit)
    h = F.silu(g) * u
    if weight is not None:
        h = h * weight.unsqueeze(-1)
    return linear(h.to(x.dtype), w2)


def fp4_moe(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts, swiglu_limit: float,
            backend: str = "auto", precision: str | None = None) -> torch.Tensor:
    """Routed-expert output (fp32 [T, D]) from packed FP4 experts.

    x [T, D]; idx [T, k] expert ids; weights [T, k] fp32 routing weights; experts: a sequence
    indexed by expert id of ((w1, s1), (w3, s3), (w2, s2)) packed weights + e8m0 scales, or None
    for experts this process does not hold (they must not be routed to)."""
    def lin(a, ws):
        return fp4_linear(a, ws[0], ws[1], backend, precision)

    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    tok = order // idx.shape[1]
    wflat = weights.flatten()
    start = 0
    for e, n in enumerate(counts):
        if n:
            sel = order[start:start + n]
            t = tok[start:start + n]
            w1, w3, w2 = experts[e]
            out.index_add_(0, t, swiglu_expert(x[t], w1, w3, w2, lin, swiglu_limit,
                                               wflat[sel]).float())
            start += n
    return out
