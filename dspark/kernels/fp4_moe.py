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
`MoE.forward` with de-quantized experts (torch backend: bit-identical on CPU). That path syncs
(`bincount(...).tolist()`) and launches ~12 ops per used expert with data-dependent shapes.

Grouped path (decode / verify / short prefills: T*k <= GROUPED_MAX_PAIRS (token, slot) pairs):
fixed-shape, no device->host sync, CUDA-graph capturable; two Triton launches over a stacked
layout of the experts (`FP4ExpertStack`, built once by `stack_fp4_experts`):

    stack = stack_fp4_experts(experts)            # w13 [E', 2I, D/2] (w1 rows then w3 rows),
                                                  # s13 [E', 2I, D/32], w2 [E', D, I/2],
                                                  # s2 [E', D, I/32], emap [E] int32 (-1: not held)
    out = fp4_moe_grouped(x, idx, weights, stack, swiglu_limit)      # fp32 [T, D]

* `_fp4_moe_gate_up_kernel`, grid (T*k, cdiv(I, BLOCK_N)): program (p, n-tile) loads the expert
  id idx[p] on the device, maps it to its stack row, and computes BLOCK_N gate rows and the same
  BLOCK_N up rows as a GEMV against x[p // k] (fp32 FMA, no MMA: one token per program). Codes
  are decoded exactly as in `_fp4_linear_kernel`; the byte tile is viewed as [BLOCK_N, groups,
  16 bytes] so each 32-column group's UE8M0 scale multiplies its partial sum once. Then, as
  `swiglu_expert`: g, u rounded to x.dtype (the per-expert path's GEMM output dtype), clamp
  u in [-limit, limit], g <= limit, h = silu(g) * u * routing weight, stored as x.dtype [T*k, I].
* `_fp4_moe_down_kernel`, grid (T, cdiv(D, BLOCK_N)): program (t, n-tile) loops over the k slots
  of token t, y_j = h[t, j] W2[idx[t, j]]^T (GEMV, fp32), rounds y_j to x.dtype (as the per-expert
  path does before its fp32 index_add) and sums the slots in fp32 -> out[t] (no atomics,
  deterministic). Only the slot-sum order differs from the per-expert path (slot order instead
  of expert-id order).
* Experts this process does not hold (None in `experts`) have emap -1: their pairs contribute 0
  (expert parallelism: another rank adds them) instead of failing as the per-expert path does.
* bf16 rounding is done with an explicit round-to-nearest-even bit trick so the Triton interpreter
  (whose fp32 -> bf16 cast truncates) rounds like the GPU.

One file (~680 lines) for one job: the FP4 GEMM, the per-expert path and the grouped kernels share
the e2m1 decode helpers and must round identically, and the tests check them against each other.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark.kernels import invariant
from dspark.kernels.common import interpreting, mma, pick_precision
from dspark.kernels.fp8_gemm import flat_operands
from dspark.formats.quant import FP4_GROUP, dequant_fp4_experts, fp4_scale_shape


@triton.jit
def _e2m1_times_2pow14(code):
    """4-bit e2m1 code (int32 0..15) -> fp32 value * 2^-14 (exact, via fp16 bits)."""
    mag = ((code & 7) << 9).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def _e2m1_pair_times_2pow14(b):
    """Both codes of a byte (int32 0..255; low nibble = even column) -> fp32 values * 2^-14, as
    _e2m1_times_2pow14 but built together: the two f16 bit patterns (sign << 15 | magnitude << 9)
    are assembled in one 32-bit word (~7 integer ops for the pair instead of ~14), then each half
    is converted. Exact, -0.0 for code 8 as the single-code version."""
    t = b | (b << 12)                       # low nibble at bits 0-3, high nibble at bits 16-19
    w = ((t & 0x00070007) << 9) | ((t & 0x00080008) << 12)
    lo = w.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


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
        acc += mma(xe, tl.trans(w_even), PRECISION)
        acc += mma(xo, tl.trans(w_odd), PRECISION)
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
        block = (16, 32, 64) if interpreting() else ((16, 64, 128) if T <= 64 else (64, 128, 128))
    BM, BN, BK = block
    assert BK % (2 * FP4_GROUP) == 0 or BK == FP4_GROUP, BK
    y = torch.empty(T, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(T, BM), triton.cdiv(N, BN))
    _fp4_linear_kernel[grid](x2, x2.stride(0), wu, wu.stride(0), su, su.stride(0), y, y.stride(0),
                             T, N, K, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                             PRECISION=pick_precision(x.dtype, precision))
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


# (token, slot) pairs up to which the grouped path is used. It re-reads an expert's weights for
# every pair (GEMV per pair), the per-expert loop reads each used expert once but costs ~12
# launches and a host sync per expert: at V4-Flash widths (12.6 MB of FP4 per expert, 256 experts)
# that loop is ~0.1 s per layer for a few hundred prompt tokens, while 4096 pairs re-read at
# ~4 TB/s cost ~13 ms (estimates; the crossover is tens of thousands of pairs). So short
# prefills take the grouped kernels too, long ones the loop.
GROUPED_MAX_PAIRS = 4096


def fp4_moe(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, experts, swiglu_limit: float,
            backend: str = "auto", precision: str | None = None, grouped: bool | None = None,
            stack: "FP4ExpertStack | None" = None) -> torch.Tensor:
    """Routed-expert output (fp32 [T, D]) from packed FP4 experts.

    x [T, D]; idx [T, k] expert ids; weights [T, k] fp32 routing weights; experts: a sequence
    indexed by expert id of ((w1, s1), (w3, s3), (w2, s2)) packed weights + e8m0 scales, or None
    for experts this process does not hold (they must not be routed to).

    grouped=None (auto): the fixed-shape grouped kernels (`fp4_moe_grouped`, no host sync) when a
    prebuilt `stack` (stack_fp4_experts(experts)) is given, the backend resolves to Triton and
    T*k <= GROUPED_MAX_PAIRS; else the per-expert loop. grouped=True forces the grouped kernels
    (building the stack for this call when none is given: a full copy of the experts);
    grouped=False forces the per-expert loop."""
    if grouped is None:
        grouped = stack is not None and grouped_applies(x, idx, backend)
    if grouped:
        if stack is None:
            stack = stack_fp4_experts(experts)
        return fp4_moe_grouped(x, idx, weights, stack, swiglu_limit)
    return fp4_moe_per_expert(x, idx, weights, experts, swiglu_limit, backend, precision)


def fp4_moe_per_expert(x, idx, weights, experts, swiglu_limit: float, backend: str = "auto",
                       precision: str | None = None) -> torch.Tensor:
    """`fp4_moe` by one GEMM triple per used expert (host loop; one device->host sync)."""
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


# ---- grouped small-batch path ----------------------------------------------------------------

def grouped_applies(x: torch.Tensor, idx: torch.Tensor, backend: str = "auto",
                    max_pairs: int = GROUPED_MAX_PAIRS) -> bool:
    """Whether `fp4_moe_grouped` is the automatic choice: the backend resolves to Triton (CUDA
    under "auto"; "triton" on CPU needs TRITON_INTERPRET=1) and T*k <= max_pairs. Shape-only."""
    return x.dim() == 2 and grouped_serves(idx.numel(), x.device, backend, max_pairs)


def grouped_serves(pairs: int, device, backend: str = "auto",
                   max_pairs: int = GROUPED_MAX_PAIRS) -> bool:
    """`grouped_applies` from the (token, slot) pair count and the device alone: what a caller
    deciding ahead of time (a CUDA-graph bucket) asks before any tensor exists."""
    if backend == "auto":
        backend = "triton" if torch.device(device).type == "cuda" else "torch"
    return backend == "triton" and 0 < max_pairs and pairs <= max_pairs


class FP4ExpertStack(NamedTuple):
    """The held routed experts side by side (raw bytes, uint8):
    w13 [E', 2I, D/2] (rows 0..I-1: w1, I..2I-1: w3), s13 [E', 2I, ceil(D/32)],
    w2 [E', D, I/2], s2 [E', D, ceil(I/32)]; emap int32 [E]: stack row of global expert e,
    -1 when not held."""
    w13: torch.Tensor
    s13: torch.Tensor
    w2: torch.Tensor
    s2: torch.Tensor
    emap: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def stack_fp4_experts(experts) -> FP4ExpertStack:
    """Copy the held experts of an `fp4_moe` experts list into one `FP4ExpertStack` (an extra copy
    of every held expert; QuantMoE instead re-points its experts' buffers at the stack)."""
    held = [e for e, ex in enumerate(experts) if ex is not None]
    if not held:
        raise ValueError("stack_fp4_experts: no expert is held")
    (w1, s1), (w3, s3), (w2, s2) = experts[held[0]]
    I, D = w1.shape[0], 2 * w1.shape[1]
    want = (((I, D // 2), fp4_scale_shape(I, D)), ((I, D // 2), fp4_scale_shape(I, D)),
            ((D, I // 2), fp4_scale_shape(D, I)))
    dev = w1.device
    E2 = len(held)
    st = FP4ExpertStack(
        torch.empty(E2, 2 * I, D // 2, dtype=torch.uint8, device=dev),
        torch.empty(E2, 2 * I, fp4_scale_shape(I, D)[1], dtype=torch.uint8, device=dev),
        torch.empty(E2, D, I // 2, dtype=torch.uint8, device=dev),
        torch.empty(E2, D, fp4_scale_shape(D, I)[1], dtype=torch.uint8, device=dev),
        torch.full((len(experts),), -1, dtype=torch.int32, device=dev))
    for row, e in enumerate(held):
        (w1, s1), (w3, s3), (w2, s2) = experts[e]
        got = tuple((tuple(a.shape), tuple(b.shape)) for a, b in experts[e])
        if got != tuple((tuple(a), tuple(b)) for a, b in want):
            raise ValueError(f"stack_fp4_experts: expert {e} has shapes {got}, expected {want} "
                             f"(from expert {held[0]})")
        st.w13[row, :I].copy_(_u8(w1))
        st.w13[row, I:].copy_(_u8(w3))
        st.s13[row, :I].copy_(_u8(s1))
        st.s13[row, I:].copy_(_u8(s3))
        st.w2[row].copy_(_u8(w2))
        st.s2[row].copy_(_u8(s2))
    st.emap[torch.tensor(held, device=dev)] = torch.arange(E2, dtype=torch.int32, device=dev)
    # fp4_moe_tc scales its bf16 weights by 2^(s - 1): every UE8M0 byte must be in [1, 128]
    # (checked here, at build time: a host sync; `fp4_moe_tc.tc_scales_ok` reads the record)
    st.emap._dspark_tc_ok = all(int(s.min()) >= 1 and int(s.max()) <= 128 for s in (st.s13, st.s2))
    return st


@triton.jit
def _round_to(v, DT: tl.constexpr):
    """fp32 -> nearest value of DT (round to nearest even), returned as fp32. bf16 by bits so the
    interpreter (whose fp32->bf16 cast truncates) rounds like the GPU; finite inputs."""
    if DT == "bf16":
        b = v.to(tl.uint32, bitcast=True)
        b = (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif DT == "fp16":
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def _x_pairs(x_row_ptr, kb, b_ok, K, BF16_PAIRS: tl.constexpr):
    """fp32 (x[2 kb], x[2 kb + 1]) for byte columns kb [G, 16]. BF16_PAIRS (bf16 x, even K, the
    row 4-byte aligned): one contiguous int32 load per pair, split by bit shifts (exact), instead
    of two strided 2-byte loads: on the H200 the strided loads, repeated by every row's thread,
    kept the L1 pipe ~92% busy."""
    if BF16_PAIRS:
        pr = tl.load(x_row_ptr.to(tl.pointer_type(tl.int32)) + kb, mask=b_ok, other=0)
        xe = (pr << 16).to(tl.float32, bitcast=True)
        xo = (pr & -65536).to(tl.float32, bitcast=True)
    else:
        ke = 2 * kb
        xe = tl.load(x_row_ptr + ke, mask=b_ok & (ke < K), other=0.0).to(tl.float32)
        xo = tl.load(x_row_ptr + ke + 1, mask=b_ok & (ke + 1 < K), other=0.0).to(tl.float32)
    return xe, xo


@triton.jit
def _byte_dot(wb, xe, xo, PAIR_DECODE: tl.constexpr):
    """sum over the 16 bytes of each group of e2m1(lo) * xe + e2m1(hi) * xo (times 2^-14); xe /
    xo [G, 16] (shared by the rows)."""
    if PAIR_DECODE:
        lo, hi = _e2m1_pair_times_2pow14(wb)
    else:
        lo = _e2m1_times_2pow14(wb & 0xF)
        hi = _e2m1_times_2pow14(wb >> 4)
    xe = xe[None, :, :]
    xo = xo[None, :, :]
    return tl.sum(lo * xe + hi * xo, axis=2)


@triton.jit
def _fp4_tile_load(w_rows_ptr, stride_wn, s_rows_ptr, stride_sn, n_ok, K, g0, second_w,
                   second_s, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, TWO: tl.constexpr,
                   FULL_GROUPS: tl.constexpr):
    """The weight bytes (int32 0..255) and scale bytes of groups g0.. of the BLOCK_N rows (and of
    the second rows when TWO), byte columns kb [G, 16] and their mask (all masked past K)."""
    rn = tl.arange(0, BLOCK_N).to(tl.int64)
    grp = g0 + tl.arange(0, BLOCK_G)                            # scale column [G]
    kb = grp[:, None] * 16 + tl.arange(0, 16)[None, :]          # byte column [G, 16]
    NG = (K + 31) // 32
    if FULL_GROUPS:     # K % 32 == 0: masks constant over a group's 16 bytes, so the
        # weight / activation loads vectorise (16 B per thread, not 16 one-byte loads)
        b_ok = tl.broadcast_to((grp < NG)[:, None], (BLOCK_G, 16))
    else:
        b_ok = kb < (K + 1) // 2
    w_ptrs = w_rows_ptr + rn[:, None, None] * stride_wn + kb[None, :, :]
    w_mask = n_ok[:, None, None] & b_ok[None, :, :]
    s_ptrs = s_rows_ptr + rn[:, None] * stride_sn + grp[None, :]
    s_mask = n_ok[:, None] & (grp < NG)[None, :]
    wb = tl.load(w_ptrs, mask=w_mask, other=0).to(tl.int32) & 0xFF
    sb = tl.load(s_ptrs, mask=s_mask, other=0).to(tl.int32)
    wb2, sb2 = wb, sb
    if TWO:
        wb2 = tl.load(w_ptrs + second_w, mask=w_mask, other=0).to(tl.int32) & 0xFF
        sb2 = tl.load(s_ptrs + second_s, mask=s_mask, other=0).to(tl.int32)
    return wb, sb, wb2, sb2, kb, b_ok


@triton.jit
def _fp4_gemv_tile(x_row_ptr, w_rows_ptr, stride_wn, s_rows_ptr, stride_sn, n_ok, K,
                   second_w, second_s,
                   BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, TWO: tl.constexpr,
                   BF16_PAIRS: tl.constexpr, PAIR_DECODE: tl.constexpr = False,
                   FULL_GROUPS: tl.constexpr = False):
    """fp32 [BLOCK_N]: x[0:K] . W[n, 0:K] for BLOCK_N packed FP4 rows (row n at w_rows_ptr +
    n * stride_wn, its UE8M0 scales at s_rows_ptr + n * stride_sn; n_ok masks rows). Works on
    [BLOCK_N, BLOCK_G groups, 16 bytes] tiles: 32 columns share one scale. TWO: also the rows
    second_w / second_s elements further on (gate and up rows of an expert) in the same loop,
    sharing the x loads; returns (first, second) (second = zeros when not TWO)."""
    NG = (K + 31) // 32
    acc = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_G), dtype=tl.float32)
    for g0 in range(0, NG, BLOCK_G):
        wb, sb, wb2, sb2, kb, b_ok = _fp4_tile_load(
            w_rows_ptr, stride_wn, s_rows_ptr, stride_sn, n_ok, K, g0, second_w, second_s,
            BLOCK_N, BLOCK_G, TWO, FULL_GROUPS)
        xe, xo = _x_pairs(x_row_ptr, kb, b_ok, K, BF16_PAIRS)
        part = _byte_dot(wb, xe, xo, PAIR_DECODE)                           # [N, G]
        acc += part * ((sb + 14) << 23).to(tl.float32, bitcast=True)  # 2^(b-127) * 2^14
        if TWO:
            part2 = _byte_dot(wb2, xe, xo, PAIR_DECODE)
            acc2 += part2 * ((sb2 + 14) << 23).to(tl.float32, bitcast=True)
    return tl.sum(acc, axis=1), tl.sum(acc2, axis=1)


@triton.jit
def _swiglu_h(g, u, limit, rw, DT: tl.constexpr):
    """The expert's hidden h in x.dtype values (fp32 tensor), as `swiglu_expert`: g, u rounded to
    x.dtype (the per-expert GEMMs return it), u clamped to [-limit, limit] and g <= limit when
    limit > 0, silu(g) * u in fp32, times the routing weight rw (before w2), rounded again."""
    g = _round_to(g, DT)
    u = _round_to(u, DT)
    clamp = limit > 0
    u = tl.where(clamp, tl.minimum(tl.maximum(u, -limit), limit), u)
    g = tl.where(clamp, tl.minimum(g, limit), g)
    h = g / (1.0 + tl.exp(-g)) * u
    return _round_to(h * rw, DT)


@triton.jit
def _fp4_moe_gate_up_kernel(
    x_ptr, stride_xt, idx_ptr, rw_ptr, emap_ptr,
    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, h_ptr, stride_hp,
    KSLOTS, I, D, limit, NP,                    # NP: programs along axis 0, bucketed (tuning key)
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, DT: tl.constexpr, BF16_PAIRS: tl.constexpr,
    PAIR_DECODE: tl.constexpr = False, FULL_GROUPS: tl.constexpr = False,
):
    p = tl.program_id(0)                                    # (token, slot) pair
    pid_n = tl.program_id(1)
    t = p // KSLOTS
    row = tl.load(emap_ptr + tl.load(idx_ptr + p))          # stack row (-1: not held)
    rows_held = tl.where(row >= 0, I, 0)        # (`(rn < I) & held`: the interpreter's `&`
                                                # of a 0-d mask yields int32)
    row = tl.maximum(row, 0).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < rows_held
    x_row = x_ptr + t.to(tl.int64) * stride_xt
    w_base = w_ptr + row * stride_we + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    s_base = s_ptr + row * stride_se + (pid_n * BLOCK_N).to(tl.int64) * stride_sn
    g, u = _fp4_gemv_tile(x_row, w_base, stride_wn, s_base, stride_sn, n_ok, D,
                          I * stride_wn, I * stride_sn, BLOCK_N, BLOCK_G, True, BF16_PAIRS,
                          PAIR_DECODE, FULL_GROUPS)
    h = _swiglu_h(g, u, limit, tl.load(rw_ptr + p).to(tl.float32), DT)
    tl.store(h_ptr + p.to(tl.int64) * stride_hp + rn, h, mask=rn < I)


@triton.jit
def _fp4_moe_down_kernel(
    h_ptr, stride_hp, idx_ptr, emap_ptr,
    w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, out_ptr, stride_ot,
    KSLOTS, D, I, NP,                           # NP: programs along axis 0, bucketed (tuning key)
    BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr, DT: tl.constexpr, BF16_PAIRS: tl.constexpr,
    PAIR_DECODE: tl.constexpr = False, FULL_GROUPS: tl.constexpr = False,
    add_ptr=None, stride_at=0, HAS_ADD: tl.constexpr = False, OUT_DT: tl.constexpr = "fp32",
):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    out = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in range(KSLOTS):
        out += _fp4_down_slot(h_ptr, stride_hp, idx_ptr, emap_ptr, w_ptr, stride_we,
                              stride_wn, s_ptr, stride_se, stride_sn, t * KSLOTS + j, rn,
                              pid_n, D, I, BLOCK_N, BLOCK_G, DT, BF16_PAIRS, PAIR_DECODE,
                              FULL_GROUPS)
    _fp4_down_finish(out, add_ptr, stride_at, out_ptr, stride_ot, t, rn, D, HAS_ADD, OUT_DT)


@triton.jit
def _fp4_down_slot(h_ptr, stride_hp, idx_ptr, emap_ptr, w_ptr, stride_we, stride_wn, s_ptr,
                   stride_se, stride_sn, p, rn, pid_n, D, I, BLOCK_N: tl.constexpr,
                   BLOCK_G: tl.constexpr, DT: tl.constexpr, BF16_PAIRS: tl.constexpr,
                   PAIR_DECODE: tl.constexpr, FULL_GROUPS: tl.constexpr):
    """Pair p's expert output on the rows rn (0 for an expert not held), rounded to x.dtype (as
    the per-expert path's GEMM output), fp32 [BLOCK_N]."""
    row = tl.load(emap_ptr + tl.load(idx_ptr + p))
    n_ok = rn < tl.where(row >= 0, D, 0)
    row = tl.maximum(row, 0).to(tl.int64)
    w_base = w_ptr + row * stride_we + (pid_n * BLOCK_N).to(tl.int64) * stride_wn
    s_base = s_ptr + row * stride_se + (pid_n * BLOCK_N).to(tl.int64) * stride_sn
    y, _ = _fp4_gemv_tile(h_ptr + p.to(tl.int64) * stride_hp, w_base, stride_wn,
                          s_base, stride_sn, n_ok, I, 0, 0, BLOCK_N, BLOCK_G, False,
                          BF16_PAIRS, PAIR_DECODE, FULL_GROUPS)
    return _round_to(y, DT)


@triton.jit
def _fp4_down_finish(out, add_ptr, stride_at, out_ptr, stride_ot, t, rn, D,
                     HAS_ADD: tl.constexpr, OUT_DT: tl.constexpr):
    """out (the slots' fp32 sum) + the shared expert's output, rounded to OUT_DT, stored."""
    if HAS_ADD:             # the shared expert's output, added in fp32 (QuantMoE's `out += ...`)
        out += tl.load(add_ptr + t.to(tl.int64) * stride_at + rn, mask=rn < D,
                       other=0.0).to(tl.float32)
    out = _round_to(out, OUT_DT)                           # exact in OUT_DT: the store only casts
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + rn, out, mask=rn < D)


_DT_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _grouped_blocks(programs_per_col: int, n: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_G): 4 rows x 32 scale groups (1024 columns, 512 bytes per row) per K step.
    H200 at V4-Flash widths (benchmarks/bench_decode_kernels.py, cold L2, graph replay; gate_up
    + down per layer): 8 x 16 (the earlier autotuned pick) 100.4 / 553 / 1449 us at 1 / 6
    / 16 tokens, 4 x 32 94.4 / 485 / 1273, 16 x 8 and 16 x 16 twice as slow (the kernels are
    latency-bound: more, smaller programs keep more loads in flight).
    Decode graph timeline, per layer at 1 token, gate/up | down: 4 x 32 35 | 21 us; whole rows
    per step, gate/up 4 x 128 (128 registers, 40 KB of loads in flight per program) 48 us; down
    4 x 64 with the slot loop unrolled at compile time 21 us, 4 x 32 unrolled 25 us."""
    if interpreting():
        return 64, 2          # few programs (the interpreter's cost is per program)
    return 4, 32


# ---- autotuning, for tuning runs (bench_decode_v4.py --autotune sets AUTOTUNE) ---------------
# With AUTOTUNE Triton times the configs below once per (program-count bucket, shape) on first
# use and keeps the fastest; `autotune_report()` lists the picks. Never under the interpreter.
AUTOTUNE = False
_GEMV_CONFIGS = [(16, 8, 4, 3), (16, 16, 4, 3), (16, 16, 8, 3), (16, 32, 8, 3), (8, 16, 4, 3),
                 (16, 8, 2, 3), (16, 8, 4, 1), (32, 8, 4, 3), (32, 16, 8, 3), (32, 32, 8, 2),
                 (64, 8, 4, 3), (64, 16, 8, 2)]        # (BLOCK_N, BLOCK_G, warps, stages)
_TUNED: dict = {}


def autotune_enabled() -> bool:
    return AUTOTUNE and not interpreting()


def _bench_quick(fn, quantiles=None):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _tuned(kernel, key):
    """The autotuned wrapper of `kernel` (built on first use)."""
    if kernel not in _TUNED:
        configs = [triton.Config({"BLOCK_N": n, "BLOCK_G": g}, num_warps=w, num_stages=st)
                   for n, g, w, st in _GEMV_CONFIGS]
        _TUNED[kernel] = triton.autotune(configs=configs, key=key, do_bench=_bench_quick)(kernel)
    return _TUNED[kernel]


def autotune_report() -> dict:
    """{kernel name: {tuning key: picked config}} of the autotuned grouped MoE kernels so far."""
    return {getattr(k, "__name__", str(k)): {str(key): str(cfg) for key, cfg in t.cache.items()}
            for k, t in _TUNED.items()}


def _np_bucket(n: int) -> int:
    return min(triton.next_power_of_2(max(n, 1)), 8192)


def fp4_moe_grouped(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                    stack: FP4ExpertStack, swiglu_limit: float, block=None,
                    pair_decode: bool = True, add: torch.Tensor | None = None,
                    out_dtype: torch.dtype = torch.float32,
                    add_stream=None) -> torch.Tensor:
    """Routed-expert output [T, D] by the two grouped kernels (module docstring): fp32, or with
    ``add`` ([T, D], e.g. the shared expert's output) and ``out_dtype``: out_dtype(routed + add)
    with the sum in fp32 (the down kernel does both: no add / cast launch). Fixed
    shapes, no host sync. x [T, D] (bf16 / fp16 / fp32), idx [T, k] global expert ids,
    weights [T, k] routing weights. Expert ids must be < len(stack.emap) (not checked: that would
    sync). block = (BLOCK_N, BLOCK_G) for both FMA kernels (tests), else picked by shape. On the
    GPU, bf16 batches on sm_90+ go to the tensor-core decode kernels: per (token, slot) pair
    (fp4_moe_tc.py) while experts rarely repeat, with the pairs of one expert in the MMA's
    columns (fp4_moe_tc_grouped.py, `takes`) from there on (equal up to the tensor cores'
    rounding); on older
    GPUs bf16 batches of MMA_MIN_TOKENS tokens or more to the expert-grouped kernels of
    fp4_moe_mma.py, the rest to the CUDA-core kernels below. pair_decode: the CUDA-core
    kernels decode both codes of a byte together (_e2m1_pair_times_2pow14; same values, fewer
    integer ops for the issue-bound decode kernels: 1.5x at 1 and 6 tokens on an H200, see
    benchmarks/bench_decode_kernels.py); False decodes code by code (the reference).
    add_stream: the CUDA stream still producing ``add`` (side_stream.fork): the current stream
    waits for it right before the first kernel that reads ``add`` (the down kernel), so the
    gate/up kernel overlaps it."""
    def add_ready():
        if add_stream is not None:
            torch.cuda.current_stream(add_stream.device).wait_stream(add_stream)

    if x.dim() != 2 or idx.dim() != 2 or weights.shape != idx.shape or idx.shape[0] != x.shape[0]:
        raise ValueError(f"fp4_moe_grouped: x {tuple(x.shape)}, idx {tuple(idx.shape)}, weights "
                         f"{tuple(weights.shape)}: expected [T, D], [T, k], [T, k]")
    if x.dtype not in _DT_NAME:
        raise ValueError(f"fp4_moe_grouped: x dtype {x.dtype} not supported")
    T, D = x.shape
    k = idx.shape[1]
    I = stack.w13.shape[1] // 2
    if stack.w13.shape[2] * 2 != D or stack.w2.shape[1] != D or stack.w2.shape[2] * 2 != I:
        raise ValueError(f"fp4_moe_grouped: x has {D} features; stack w13 {tuple(stack.w13.shape)}"
                         f", w2 {tuple(stack.w2.shape)}")
    auto_gpu = block is None and x.is_cuda and not interpreting()
    per_pair_tc = False
    if auto_gpu and T and k:
        from dspark.kernels import fp4_moe_tc as tc       # tensor-core decode
        per_pair_tc = tc.tc_applies(x, stack, k) and out_dtype in _DT_NAME and (
            add is None or (add.shape == (T, D) and add.stride(-1) == 1))
    if per_pair_tc:
        from dspark.kernels import fp4_moe_tc_grouped as tcg
        if x.stride(-1) != 1:
            x = x.contiguous()
        # experts repeat: one read per block (not batch-invariant: an expert's tokens share
        # the MMA columns)
        if tcg.takes(T * k, stack.emap.numel()) and not invariant.on():
            return tcg.fp4_moe_tc_grouped(x, idx, weights, stack, swiglu_limit, add, out_dtype,
                                          add_ready=add_ready)
        h = tc.fp4_moe_tc_gate_up(x, idx, weights, stack, swiglu_limit)
        add_ready()
        return tc.fp4_moe_tc_down(h, idx, stack, x.dtype, add, out_dtype)
    if auto_gpu and x.dtype == torch.bfloat16 and not invariant.on():
        from dspark.kernels import fp4_moe_mma as mma      # tokens grouped by expert on tensor
        # cores (bf16 x only: exact operands need bf16; not batch-invariant: an expert's tokens
        # share the MMA tiles, and the path starts at MMA_MIN_TOKENS)
        if mma.mma_applies(D, I) and mma.mma_takes(T):
            routed = mma.fp4_moe_mma(x, idx, weights, stack, swiglu_limit)
            add_ready()
            return _finish(routed, add, out_dtype)
    if T == 0 or k == 0:
        add_ready()
        return _finish(torch.zeros(T, D, dtype=torch.float32, device=x.device), add, out_dtype)
    if out_dtype not in _DT_NAME or (add is not None and (add.shape != (T, D)
                                                          or add.stride(-1) != 1)):
        raise ValueError(f"fp4_moe_grouped: add {None if add is None else tuple(add.shape)} / "
                         f"out_dtype {out_dtype}: expected [T, D] rows and a 16/32-bit float")
    out = torch.empty(T, D, dtype=out_dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    idx = idx.contiguous()
    weights = weights.contiguous()
    P = T * k
    full = D % 32 == 0 and I % 32 == 0        # every scale group whole (V4: always)
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    dt = _DT_NAME[x.dtype]
    # bf16 activations read as int32 pairs: even widths, 4-byte aligned rows (h is ours)
    pairs = (dt == "bf16" and D % 2 == 0 and I % 2 == 0 and x.stride(0) % 2 == 0
             and x.data_ptr() % 4 == 0)
    w13, s13, w2, s2, emap = stack
    up_args = (x, x.stride(0), idx, weights, emap, w13, w13.stride(0), w13.stride(1), s13,
               s13.stride(0), s13.stride(1), h, h.stride(0), k, I, D, float(swiglu_limit),
               _np_bucket(P))
    down_args = (h, h.stride(0), idx, emap, w2, w2.stride(0), w2.stride(1), s2, s2.stride(0),
                 s2.stride(1), out, out.stride(0), k, D, I, _np_bucket(T))
    down_kw = dict(add_ptr=out if add is None else add, stride_at=0 if add is None
                   else add.stride(0), HAS_ADD=add is not None, OUT_DT=_DT_NAME[out_dtype])
    if block is None and autotune_enabled():
        _tuned(_fp4_moe_gate_up_kernel, ["NP", "KSLOTS", "I", "D"])[
            lambda m: (P, triton.cdiv(I, m["BLOCK_N"]))](*up_args, DT=dt, BF16_PAIRS=pairs,
                                                          PAIR_DECODE=pair_decode, FULL_GROUPS=full)
        add_ready()
        _tuned(_fp4_moe_down_kernel, ["NP", "KSLOTS", "D", "I"])[
            lambda m: (T, triton.cdiv(D, m["BLOCK_N"]))](*down_args, DT=dt,
                                                          BF16_PAIRS=pairs,
                                                          PAIR_DECODE=pair_decode, FULL_GROUPS=full,
                                                          **down_kw)
        return out
    bn1, bg1 = block or _grouped_blocks(P, I)
    bn2, bg2 = block or _grouped_blocks(T, D)
    _fp4_moe_gate_up_kernel[(P, triton.cdiv(I, bn1))](*up_args, BLOCK_N=bn1, BLOCK_G=bg1, DT=dt,
                                                      BF16_PAIRS=pairs, PAIR_DECODE=pair_decode,
                                                      FULL_GROUPS=full)
    add_ready()
    grid = (T, triton.cdiv(D, bn2))
    _fp4_moe_down_kernel[grid](*down_args, BLOCK_N=bn2, BLOCK_G=bg2, DT=dt, BF16_PAIRS=pairs,
                               PAIR_DECODE=pair_decode, FULL_GROUPS=full, **down_kw)
    return out


def _finish(routed: torch.Tensor, add, out_dtype) -> torch.Tensor:
    """out_dtype(routed + add) in fp32, for the paths whose kernels do not add / cast."""
    if add is not None:
        routed += add
    return routed.to(out_dtype)
