"""y = x @ W^T with W kept as FP8 e4m3 + UE8M0 128x128 tile scales (spec §5.2), W never
materialised in bf16.

    y = fp8_linear(x, w, scale)        # x [..., K] (bf16 / fp32), w [N, K] e4m3 (or its uint8
                                       # view), scale [ceil(N/128), ceil(K/128)] e8m0 (or uint8)

Numerics / design choice (documented per the issue): activations stay in the engine dtype (bf16 on
GPU) and are NOT quantized to FP8 per token x 128 columns as REF does. Each weight tile is
de-quantised in registers — e4m3 -> bf16 is exact — the tile GEMM accumulates in fp32 and the tile's
power-of-two scale is applied to the fp32 partial sum (exact scaling). The result therefore equals
`F.linear(x, dequant_fp8_blocks(w, scale))` up to fp32 summation order (bf16 x: up to bf16 MMA
operand rounding of x, which is x itself). This keeps the dequantized debug mode and the quantized
mode numerically interchangeable; the weight bytes (the decode bottleneck) are halved either way.
An FP8xFP8 wgmma path (REF's activation quantization, or `torch._scaled_mm` with block-wise
scales) is a later step: it changes numerics (activation rounding) and needs the 1x128 activation
scales, so it is not used here.

Backends: "triton" (CUDA, or TRITON_INTERPRET=1 on CPU for tests), "torch" (de-quantize the
whole weight to x.dtype, then F.linear — exact, used on CPU and as the reference), "auto"
(triton on CUDA tensors, torch otherwise).

Kernel layout: one program = BLOCK_M tokens x BLOCK_N output rows x one K-split. BLOCK_K = 128 so a
weight tile [BLOCK_N <= 128, 128] sits inside one scale tile (BLOCK_N divides 128). For decode
(T small) the GEMM is a weight-streaming GEMV: N/BLOCK_N programs are too few for 132 SMs, so K is
split and the fp32 partials are summed (deterministically) on the host side.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark.kernels.sparse_mqa import _mma, _pick_precision
from dspark.models.quant import FP8_BLOCK, dequant_fp8_blocks, fp8_scale_shape


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def flat_operands(x: torch.Tensor, K: int, w: torch.Tensor, scale: torch.Tensor):
    """(x as a row-contiguous [T, K] matrix, weight bytes, scale bytes) for the weight-only
    quantized GEMM kernels: they address rows by stride and need unit column stride."""
    x2 = x.reshape(-1, K)
    def unit(t):
        return t if t.stride(-1) == 1 else t.contiguous()
    return unit(x2), unit(w.view(torch.uint8)), unit(scale.view(torch.uint8))


@triton.jit
def _e8m0_to_f32(b):
    """UE8M0 byte (int32 0..255) -> fp32 2^(b-127), built from bits (b=0: subnormal 2^-127)."""
    bits = tl.where(b > 0, b << 23, 0x400000)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _fp8_linear_kernel(
    x_ptr, stride_xt, w_ptr, stride_wn, s_ptr, stride_sn, y_ptr, stride_ys, stride_yt,
    T, N, K, K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < T
    n_ok = rn < N
    s_row = (pid_n * BLOCK_N) // 128                       # BLOCK_N divides 128
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xt + kk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wb = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0)
        w = wb.to(tl.float8e4nv, bitcast=True)             # exact e4m3 -> bf16/fp32 in _mma
        sb = tl.load(s_ptr + s_row * stride_sn + k0 // 128).to(tl.int32)
        part = _mma(x, tl.trans(w), PRECISION)
        acc += part * _e8m0_to_f32(sb)                      # power of two: exact scaling
    y = y_ptr + pid_k * stride_ys + rm[:, None] * stride_yt + rn[None, :]
    tl.store(y, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, stride_xt, w_ptr, stride_wn, s_ptr, stride_sn, y_ptr, stride_yt, T, N, K,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Few tokens (decode, verify blocks): one program = one token x BLOCK_N output rows, fp32
    FMAs over [BLOCK_N, 128] weight tiles (no MMA, whose operand layouts cost ~255 registers at
    BLOCK_M = 16), the full K in one program and the result stored in y's dtype: no split-K
    partials, no sum / cast launches after it. Token index fastest, so the programs that read one
    weight tile run side by side and share it through L2."""
    pid = tl.program_id(0)
    t = (pid % T).to(tl.int64)
    pid_n = pid // T
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    s_row = (pid_n * BLOCK_N) // 128                       # BLOCK_N divides 128
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_ptr + t * stride_xt + kk, mask=k_ok, other=0.0).to(tl.float32)
        wb = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0)
        w = wb.to(tl.float8e4nv, bitcast=True).to(tl.float32)      # exact
        sb = tl.load(s_ptr + s_row * stride_sn + k0 // 128).to(tl.int32)
        acc += tl.sum(w * x[None, :], axis=1) * _e8m0_to_f32(sb)   # power of two: exact
    tl.store(y_ptr + t * stride_yt + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


GEMV_MAX_T = 8     # token counts the GEMV kernel takes when enabled (weights re-read per token)


def gemv_enabled() -> bool:
    """The few-token FP8 GEMV kernel is opt-in (DSPARK_FP8_GEMV=1) until a GPU run has timed it
    against the split-K MMA kernel; CPU tests run it under the interpreter."""
    return os.environ.get("DSPARK_FP8_GEMV", "") == "1"


def _gemv_block(T: int, N: int) -> int:
    """BLOCK_N: 16 rows (80 registers at sm_90, offline ptxas: benchmarks/kernel_regs.py; 32 rows
    take 162), 8 (32 registers) while fewer than ~4 programs per H200 SM would run."""
    return 16 if T * triton.cdiv(N, 16) >= 528 else 8


def fp8_gemv_triton(x2: torch.Tensor, wu: torch.Tensor, su: torch.Tensor, N: int, K: int,
                    out_dtype, block_n: int | None = None) -> torch.Tensor:
    """[T, N] in out_dtype from row-contiguous x2 [T, K] and the weight / scale bytes."""
    T = x2.shape[0]
    y = torch.empty(T, N, dtype=out_dtype, device=x2.device)
    bn = block_n or _gemv_block(T, N)
    assert FP8_BLOCK % bn == 0, bn
    _fp8_gemv_kernel[(T * triton.cdiv(N, bn),)](
        x2, x2.stride(0), wu, wu.stride(0), su, su.stride(0), y, y.stride(0), T, N, K,
        BLOCK_N=bn, BLOCK_K=FP8_BLOCK, num_warps=4)
    return y


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor):
    if w.dim() != 2 or w.element_size() != 1:
        raise ValueError(f"fp8_linear: weight must be a 2-D 1-byte tensor [N, K], got "
                         f"{tuple(w.shape)} {w.dtype}")
    N, K = w.shape
    if x.shape[-1] != K:
        raise ValueError(f"fp8_linear: x has {x.shape[-1]} features, weight expects {K}")
    if tuple(scale.shape) != fp8_scale_shape(N, K):
        raise ValueError(f"fp8_linear: scale shape {tuple(scale.shape)}, expected "
                         f"{fp8_scale_shape(N, K)} for weight {tuple(w.shape)}")
    return N, K


def fp8_linear_torch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Reference / CPU path: exact de-quantization to x.dtype, then F.linear (bit-identical to the
    dequantized engine, which de-quantizes the same way at load)."""
    _check(x, w, scale)
    return F.linear(x, dequant_fp8_blocks(w, scale, x.dtype))


def _pick_blocks(T: int, N: int, K: int, interp: bool):
    if interp:
        return 16, 32, 1                    # small tiles keep the interpreter fast
    if T <= 64:                             # decode / small verify batches: stream the weight
        BM, BN = 16, 64
        progs = triton.cdiv(N, BN)
        split = max(1, min(triton.cdiv(K, FP8_BLOCK), triton.cdiv(264, progs)))
        return BM, BN, split
    return (64 if T <= 256 else 128), 128, 1


def fp8_linear_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                      precision: str | None = None, block=None) -> torch.Tensor:
    N, K = _check(x, w, scale)
    lead = x.shape[:-1]
    x2, wu, su = flat_operands(x, K, w, scale)
    T = x2.shape[0]
    if T == 0:
        return x.new_zeros(*lead, N)
    if block is None and T <= GEMV_MAX_T and gemv_enabled():
        return fp8_gemv_triton(x2, wu, su, N, K, x.dtype).reshape(*lead, N)
    BM, BN, split = block or _pick_blocks(T, N, K, _interpreting())
    assert FP8_BLOCK % BN == 0, BN
    nk = triton.cdiv(K, FP8_BLOCK)
    split = max(1, min(split, nk))
    k_per = triton.cdiv(nk, split) * FP8_BLOCK
    split = triton.cdiv(K, k_per)
    y = torch.empty(split, T, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, BM), triton.cdiv(N, BN), split)
    _fp8_linear_kernel[grid](
        x2, x2.stride(0), wu, wu.stride(0), su, su.stride(0), y, y.stride(0), y.stride(1),
        T, N, K, k_per, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=FP8_BLOCK,
        PRECISION=_pick_precision(x.dtype, precision))
    y = y[0] if split == 1 else y.sum(0)
    return y.to(x.dtype).reshape(*lead, N)


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, backend: str = "auto",
               precision: str | None = None) -> torch.Tensor:
    """x [..., K] @ dequant(w [N, K], scale)^T -> [..., N] in x.dtype (fp32 accumulation)."""
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    if backend == "torch":
        return fp8_linear_torch(x, w, scale)
    if backend == "triton":
        return fp8_linear_triton(x, w, scale, precision)
    raise ValueError(f"fp8_linear: backend={backend!r}; use 'auto', 'triton' or 'torch'")
