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
split and the fp32 partials are summed (deterministically) by a second launch. Few tokens
(T <= SKINNY_MAX_T: decode, verify) take `_fp8_skinny_kernel` instead: weight rows on the MMA's M
side, split K reduced inside the same launch, output written in x's dtype (one launch per linear).
1-8 bf16 tokens go one step further, to fp8_gemv_tc's tensor-core GEMV (MMA fragments loaded
per lane straight from global memory, no shared memory; same numerics as the skinny kernel's
fp16 mode).
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from dspark.cuda import pdl
from dspark.kernels.argmax import _order_key
from dspark.kernels import invariant
from dspark.kernels.common import interpreting, mma, pick_precision
from dspark.cuda import side_stream
from dspark.cuda.graph_capture import held_buffer
from dspark.formats.quant import FP8_BLOCK, dequant_fp8_blocks, fp8_scale_shape




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
def _fp8_tile(w_ptr, stride_wn, rn, n_ok, kk, k_ok, s_ptr, stride_sn, s_row, k0):
    """Weight rows rn x columns kk as e4m3 (exact -> bf16 / fp32 in _mma) and the fp32 power of
    two of their 128 x 128 scale tile (applied to the tile's partial sum: exact scaling)."""
    wb = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :],
                 mask=n_ok[:, None] & k_ok[None, :], other=0)
    sb = tl.load(s_ptr + s_row * stride_sn + k0 // 128).to(tl.int32)
    return wb.to(tl.float8e4nv, bitcast=True), _e8m0_to_f32(sb)


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
        w, scale = _fp8_tile(w_ptr, stride_wn, rn, n_ok, kk, k_ok, s_ptr, stride_sn, s_row, k0)
        acc += mma(x, tl.trans(w), PRECISION) * scale
    y = y_ptr + pid_k * stride_ys + rm[:, None] * stride_yt + rn[None, :]
    tl.store(y, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _skinny_tiles(x_base, stride_xt, w_ptr, stride_wn, s_ptr, stride_sn, rn, n_ok, rt, t_ok, rk,
                  s_row, k_lo, k_hi, K, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
                  PRECISION: tl.constexpr, UNPIPELINED: tl.constexpr = False,
                  W16: tl.constexpr = False):
    """fp32 [BLOCK_N, BLOCK_T]: the weight rows rn times x^T over columns k_lo..k_hi, each
    128-column tile's scale applied to its partial sum. UNPIPELINED: no cp.async stages (the
    rare overflow rescue: costs no registers / shared memory next to the main loop). W16: the
    weights are 16-bit values (no scales)."""
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, 128, num_stages=1 if UNPIPELINED else None):
        kk = k0 + rk
        k_ok = kk < K
        if W16:
            w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            scale = 1.0
        else:
            w, scale = _fp8_tile(w_ptr, stride_wn, rn, n_ok, kk, k_ok, s_ptr, stride_sn, s_row,
                                 k0)
        xt = tl.load(x_base + rt[None, :] * stride_xt + kk[:, None],
                     mask=t_ok[None, :] & k_ok[:, None], other=0.0)
        acc += mma(w, xt, PRECISION) * scale
    return acc


@triton.jit
def _fp8_skinny_kernel(
    x_ptr, stride_xt, stride_xg, w_ptr, stride_wn, s_ptr, stride_sn, y_ptr, stride_yt, ws_ptr,
    cnt_ptr, T, N, K, K_PER_SPLIT, GROUP_ROWS,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    RESCUE: tl.constexpr = "bf16", PDL: tl.constexpr = False, W16: tl.constexpr = False,
    key_ptr=None, idx_ptr=None,
):
    """Few tokens (decode, verify): y^T = W x^T with the weight rows as the MMA's M side
    ("swap AB": a [BLOCK_N, 128] weight tile against x^T [128, BLOCK_T], so 64-128 weight rows
    fill the MMA instead of 1-16 tokens padded to 16), fp32 accumulation, each 128 x 128 tile's
    power-of-two scale applied to its partial sum (exact). K split over SPLIT programs when
    N / BLOCK_N alone would leave SMs idle: each split stores its fp32 partial to a workspace, and
    the split that arrives last (a per-tile arrival counter) sums the SPLIT partials in split
    order (deterministic whichever arrives last), writes y in its dtype and re-arms the counter
    for the next launch / graph replay. One launch, no sum / cast kernels after it. SPLIT is a
    compile-time constant so that sum unrolls: its SPLIT loads are all issued before the adds
    wait (a runtime loop waited one L2 round trip per partial, at the kernel's tail).
    Grouped weights (attention wo_a): rows g*GROUP_ROWS .. (g+1)*GROUP_ROWS - 1 multiply x's group
    g (x + g * stride_xg); GROUP_ROWS is a multiple of BLOCK_N, and N for plain linears.
    PDL (dspark.cuda.pdl): launched while the kernel ahead still runs; the program waits for
    that kernel and lets the next kernel start once its own weight loop is done.
    W16: 16-bit weights without scales (bf16 / fp16 linears of few tokens, `linear16_skinny`:
    the same kernel, one MMA operand conversion less; s_ptr unused).
    key_ptr / idx_ptr (fp32 y only; the vocabulary head): also each token's argmax over the
    program's BLOCK_N columns, as kernels/argmax.py's first pass stores it for a chunk (the
    largest order key and its first column) at [t, pid_n]: its second pass then finishes the
    rows' argmax without the first pass's launch."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_t = tl.program_id(2)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rt = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    t_ok = rt < T
    s_row = (pid_n * BLOCK_N) // 128                       # BLOCK_N divides 128
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    x_base = x_ptr + ((pid_n * BLOCK_N) // GROUP_ROWS).to(tl.int64) * stride_xg
    pdl.wait(PDL)
    acc = _skinny_tiles(x_base, stride_xt, w_ptr, stride_wn, s_ptr, stride_sn, rn, n_ok, rt, t_ok,
                        rk, s_row, k_lo, k_hi, K, BLOCK_N, BLOCK_T, PRECISION,
                        False, W16)
    pdl.launch_dependents(PDL)
    if PRECISION == "fp16" and not W16:
        # x was rounded to fp16: exact for |x| in [2^-14, 65504] (e4m3 weights always are), an
        # absolute error below 2^-25 under it, inf past it. A partial that is not finite (an
        # overflowed x, or non-finite input) is redone with RESCUE operands (bf16; exact fp32
        # under the interpreter).
        bad = tl.sum(tl.where(tl.abs(acc) < float("inf"), 0, 1), axis=1)
        if tl.sum(bad, axis=0) > 0:
            acc = _skinny_tiles(x_base, stride_xt, w_ptr, stride_wn, s_ptr, stride_sn, rn, n_ok,
                                rt, t_ok, rk, s_row, k_lo, k_hi, K, BLOCK_N,
                                BLOCK_T, RESCUE, True)
    out = y_ptr + rt[None, :] * stride_yt + rn[:, None]
    ok = n_ok[:, None] & t_ok[None, :]
    if SPLIT == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)
        if key_ptr is not None:
            _tile_argmax(acc, rn, n_ok, rt, t_ok, key_ptr, idx_ptr, pid_n, tl.num_programs(0), N)
    else:
        # workspace [SPLIT, T, N] fp32, same [t, n] addressing as y
        part = ws_ptr + pid_k * T * N + rt[None, :] * N + rn[:, None]
        tl.store(part, acc, mask=ok)
        tl.debug_barrier()                                 # all partial stores issued first
        tile = cnt_ptr + pid_t * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:                           # last split of this tile
            total = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
            for j in tl.static_range(SPLIT):
                total += tl.load(ws_ptr + j * T * N + rt[None, :] * N + rn[:, None], mask=ok,
                                 other=0.0, cache_modifier=".cg")
            tl.store(out, total.to(y_ptr.dtype.element_ty), mask=ok)
            if key_ptr is not None:
                _tile_argmax(total, rn, n_ok, rt, t_ok, key_ptr, idx_ptr, pid_n,
                             tl.num_programs(0), N)
            tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")   # re-arm for the next launch


@triton.jit
def _tile_argmax(y, rn, n_ok, rt, t_ok, key_ptr, idx_ptr, chunk, C, N):
    """Per token (column of y [BLOCK_N, BLOCK_T]): the largest order key of its rows rn and the
    first row holding it, stored at [t, chunk] of the [T, C] key / index arrays."""
    key = tl.where(n_ok[:, None], _order_key(y), -2147483647 - 1)
    best = tl.max(key, axis=0)
    first = tl.min(tl.where(key == best[None, :], rn[:, None], N), axis=0)
    tl.store(key_ptr + rt * C + chunk, best, mask=t_ok)
    tl.store(idx_ptr + rt * C + chunk, first.to(tl.int32), mask=t_ok)


SKINNY_MAX_T = 64       # token counts the swap-AB kernel takes (decode, verify, short prefills)
_DEVICE_BUFFERS: dict = {}    # (kind, device[, lane]) -> buffer kept across launches


def _arrival_counters(device, n: int) -> torch.Tensor:
    """Zeroed int32 per-tile arrival counters, one buffer per device and stream lane
    (side_stream.lane(): branches on side streams may run a split launch at the same time),
    reused by the launches of that lane, one after the other: each leaves them at zero again."""
    # (a larger buffer never frees the smaller one: captured graphs keep using theirs)
    return held_buffer(_DEVICE_BUFFERS, ("counters", device, side_stream.lane()), n,
                       lambda m: torch.zeros(max(m, 1 << 16), dtype=torch.int32, device=device))


def _unused_workspace(device) -> torch.Tensor:
    key = ("unused workspace", device)
    if key not in _DEVICE_BUFFERS:
        _DEVICE_BUFFERS[key] = torch.zeros(1, dtype=torch.float32, device=device)
    return _DEVICE_BUFFERS[key]


def _fill_splits(programs: int, K: int) -> int:
    """K splits that bring `programs` (output tiles) up to ~2 per H200 SM (132), at most one per
    128-column K block."""
    return max(1, min(triton.cdiv(K, FP8_BLOCK), triton.cdiv(264, programs)))


def invariant_skinny_blocks(N: int, K: int, interp: bool):
    """`_skinny_blocks` for any token count in the batch-invariant mode: 16-token tiles (the
    grid tiles T), K splits from the weight's shape alone."""
    if interp:
        return _skinny_blocks(1, N, K, True)
    return 64, 16, _fill_splits(triton.cdiv(N, 64), K)


def _skinny_blocks(T: int, N: int, K: int, interp: bool):
    """(BLOCK_N, BLOCK_T, SPLIT): 64 weight rows per program, tokens padded to 16..64, K split
    until ~2 programs per H200 SM (132) would run."""
    if interp:
        return 32, 16, max(1, min(3, triton.cdiv(K, FP8_BLOCK)))
    bt = max(16, triton.next_power_of_2(T))
    bn = 64
    return bn, bt, _fill_splits(triton.cdiv(N, bn) * triton.cdiv(T, bt), K)


def skinny_precision(x_dtype: torch.dtype, precision: str | None = None) -> str:
    """The skinny kernel's MMA operands: fp16 for bf16 x. e4m3 -> f16 is one conversion per
    value pair (-> bf16 goes through fp32: 96 instead of 48 conversions per thread and tile, 312
    vs 225 loop instructions offline on sm_90). H200 (bench_decode_kernels, cold L2, T = 1):
    wq_b 15.8 -> 12.9 us, wo_b 20.0 -> 15.4, wq_a + wkv 7.2 -> 6.1, shared w1 + w3 11.2 -> 9.3
    against bf16 operands. x in fp16 is exact inside its normal range and off by < 2^-25 below
    it; a tile partial that overflowed is redone in bf16 (see the kernel)."""
    if precision is None and x_dtype == torch.bfloat16 and not interpreting():
        return "fp16"
    return pick_precision(x_dtype, precision)


def fp8_skinny_triton(x2: torch.Tensor, wu: torch.Tensor, su: torch.Tensor, N: int, K: int,
                      out_dtype, precision: str, block=None, groups: int = 1, num_warps: int = 4,
                      num_stages: int = 3, tc: bool = True,
                      argmax_out: torch.Tensor | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """[T, N] in out_dtype from x2 [T, K] (unit column stride) and the weight / scale bytes.
    groups > 1: x2 is [T, groups, K] and weight rows g*N/groups.. use x2[:, g] ([T, N] is then
    [T, groups, N/groups]). block = (BLOCK_N, BLOCK_T, K splits), else picked by shape.
    tc: few tokens of bf16 x with fp16 operands (the default precision) run the tensor-core GEMV
    of fp8_gemv_tc where it applies (the same numerics; block given: this kernel; 16-bit
    weights stay here: a 16-bit variant of that GEMV measured no faster, 0.88-1.0x, on the
    compressor shapes).
    argmax_out: int64 [T]: also y.argmax(-1) into it (fp32 y, 16-bit weights: the vocabulary
    head), the chunk pass of kernels/argmax.py done per program in this launch. out: y there
    ([T, N] of out_dtype, unit column stride)."""
    if argmax_out is not None:
        assert su is None and out_dtype == torch.float32 and groups == 1, \
            "argmax_out: fp32 logits of 16-bit weights only"
        assert argmax_out.shape == (x2.shape[0],) and argmax_out.dtype == torch.long
    if invariant.on():
        # one tile shape for every token count, K split by the weight's shape alone; bf16
        # operands for bf16 x (the fp16 ones redo a tile whose partial overflowed in bf16:
        # a row's result would depend on the other rows of its tile)
        block = block or invariant_skinny_blocks(N, K, interpreting())
        if precision == "fp16" and x2.dtype == torch.bfloat16:
            precision = "bf16"
    if tc and block is None and su is not None and precision == "fp16":
        from dspark.kernels import fp8_gemv_tc
        if fp8_gemv_tc.tc_applies(x2, wu, N, K, groups):
            return fp8_gemv_tc.fp8_gemv_tc(x2, wu, su, N, K, groups, out_dtype)
    T = x2.shape[0]
    BN, BT, split = block or _skinny_blocks(T, N, K, interpreting())
    assert FP8_BLOCK % BN == 0, BN
    R = N // groups
    assert groups == 1 or (R * groups == N and R % BN == 0), (N, groups, BN)
    stride_xg = x2.stride(1) if groups > 1 else 0
    nk = triton.cdiv(K, FP8_BLOCK)
    split = max(1, min(split, nk))
    k_per = triton.cdiv(nk, split) * FP8_BLOCK
    split = triton.cdiv(K, k_per)
    if out is not None:
        assert out.shape == (T, N) and out.dtype == out_dtype and out.stride(1) == 1, \
            (out.shape, out.dtype, out.stride())
    y = torch.empty(T, N, dtype=out_dtype, device=x2.device) if out is None else out
    grid = (triton.cdiv(N, BN), split, triton.cdiv(T, BT))
    # the partials' workspace; unsplit launches never touch it (a cached one-element stand-in)
    ws = (torch.empty(split, T, N, dtype=torch.float32, device=x2.device) if split > 1
          else _unused_workspace(x2.device))
    cnt = _arrival_counters(x2.device, grid[0] * grid[2])
    w16 = su is None                         # 16-bit weights (linear16_skinny)
    on = pdl.enabled(x2.device)
    if w16:
        su = wu                              # (never read)
    keys = idx = None
    if argmax_out is not None:
        keys = torch.empty(T, grid[0], dtype=torch.int32, device=x2.device)
        idx = torch.empty(T, grid[0], dtype=torch.int32, device=x2.device)
    _fp8_skinny_kernel[grid](
        x2, x2.stride(0), stride_xg, wu, wu.stride(0), su, su.stride(0), y, y.stride(0), ws,
        cnt,
        T, N, K, k_per, R, BLOCK_N=BN, BLOCK_T=BT, BLOCK_K=FP8_BLOCK, PRECISION=precision,
        SPLIT=split, RESCUE=pick_precision(x2.dtype, None), PDL=on, W16=w16,
        key_ptr=keys, idx_ptr=idx,
        num_warps=num_warps, num_stages=num_stages, **pdl.launch_kwargs(on))
    if argmax_out is not None:
        from dspark.kernels.argmax import row_argmax_of_chunks
        row_argmax_of_chunks(keys, idx, argmax_out)
    return y


LINEAR16_MAX_BYTES = 64 << 20     # larger 16-bit weights stay on cuBLAS, but for the head:
# the vocabulary head (V4-Flash: 1.06 GB bf16) of a decode / verify step. H200, batch-1 decode
# graph: 236.8 us (4.47 TB/s) here vs 244-245 us for cuBLAS's nvjet kernel, which
# also started ~4.5 us after the kernel before it; device time per step 0.810 -> 0.798 ms.
HEAD_SKINNY_MAX_T = 16


def linear16_skinny_applies(x: torch.Tensor, w: torch.Tensor, head: bool = False) -> bool:
    """Whether `linear16_skinny` takes x [..., K] @ w [N, K]^T: CUDA, x and w of one 16-bit
    dtype, few tokens, unit column strides, w up to LINEAR16_MAX_BYTES (head: the vocabulary
    head, any size, up to HEAD_SKINNY_MAX_T tokens)."""
    T = x.numel() // max(x.shape[-1], 1)
    fixed = invariant.on()           # batch-invariant mode: this kernel for every size
    if head and T > HEAD_SKINNY_MAX_T and not fixed:
        return False
    return (x.is_cuda and not interpreting() and w.dim() == 2 and x.dtype == w.dtype
            and w.dtype in (torch.bfloat16, torch.float16) and x.shape[-1] == w.shape[1]
            and 0 < T and (T <= SKINNY_MAX_T or fixed) and w.stride(1) == 1
            and (head or fixed or w.numel() * 2 <= LINEAR16_MAX_BYTES))


def linear16_skinny(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                    argmax_out: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T in out_dtype for 16-bit x and w of few tokens: the skinny kernel
    (swap AB, split K summed in the same launch) with the 16-bit weights as they are. The
    products are exact, the fp32 sum differs from cuBLAS's only in order. (cuBLAS at T = 1 runs
    a split-K GEMV and a separate reduce kernel: two launches per compressor projection; H200,
    the V4-Flash decode step with the three compressor projections here: 1.027 vs 1.026 ms
    device with PDL on, and 0.943 ms together with the Triton row argmax without PDL, against
    0.953 before both.)"""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    prec = pick_precision(x.dtype, "fp16" if w.dtype == torch.float16 else "bf16")
    y = fp8_skinny_triton(x2, w, None, w.shape[0], K, out_dtype, prec, argmax_out=argmax_out,
                          out=None if out is None else out.view(-1, w.shape[0]))
    return y.view(*x.shape[:-1], w.shape[0])


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
        return BM, BN, _fill_splits(triton.cdiv(N, BN), K)
    return (64 if T <= 256 else 128), 128, 1


def fp8_linear_triton(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                      precision: str | None = None, block=None) -> torch.Tensor:
    N, K = _check(x, w, scale)
    lead = x.shape[:-1]
    x2, wu, su = flat_operands(x, K, w, scale)
    T = x2.shape[0]
    if T == 0:
        return x.new_zeros(*lead, N)
    if block is None and (T <= SKINNY_MAX_T or invariant.on()):
        return fp8_skinny_triton(x2, wu, su, N, K, x.dtype,
                                 skinny_precision(x.dtype, precision)).reshape(*lead, N)
    BM, BN, split = block or _pick_blocks(T, N, K, interpreting())
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
        PRECISION=pick_precision(x.dtype, precision))
    y = y[0] if split == 1 else y.sum(0)
    return y.to(x.dtype).reshape(*lead, N)


def fp8_linear_grouped(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, groups: int,
                       backend: str = "auto") -> torch.Tensor | None:
    """Grouped projection x [T, G, K] -> [T, G, N/G] (group g times weight rows g*N/G ..) in one
    skinny launch, or None when that kernel does not apply (not Triton, T > SKINNY_MAX_T, groups
    not 128-row aligned): the caller then runs one fp8_linear per group."""
    if backend == "auto":
        backend = "triton" if x.is_cuda else "torch"
    N, K = _check(x, w, scale)
    T = x.shape[0]
    if (backend != "triton" or x.dim() != 3 or x.shape[1] != groups or T == 0
            or (T > SKINNY_MAX_T and not invariant.on()) or (N // groups) % FP8_BLOCK
            or x.stride(-1) != 1):
        return None
    _, wu, su = flat_operands(x[:, 0], K, w, scale)
    y = fp8_skinny_triton(x, wu, su, N, K, x.dtype, skinny_precision(x.dtype),
                          groups=groups)
    return y.view(T, groups, N // groups)


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
