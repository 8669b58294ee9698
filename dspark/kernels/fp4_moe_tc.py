"""Few-token routed experts on tensor cores, one warp per 16 weight rows (`fp4_moe_grouped`'s
contract; the default for decode / verify batches below the expert-grouped MMA path on CUDA
sm_90+, bf16 activations; elsewhere the CUDA-core kernels of fp4_moe.py).

H200 (benchmarks/results/bench_decode_fp4_moe_tc_ab_h200.json): the grouped MoE of one
V4-Flash layer at 1 token takes 38.0 us (K split 4 / 2, 2 steps per asm block) vs 51.4 us for
the CUDA-core kernels; the 4-layer decode step's device time 0.883 vs 0.909 ms. Still below the
HBM's rate (~2.1 TB/s): ncu's top stall is global-memory latency (long scoreboard 34-39% of
warp cycles, benchmarks/results/ncu_fp4_moe_tc_h200.txt), each warp waiting on its loads once
per asm block (2 steps; 4 steps, more K splits, more warps per program or 4 independent MMA
chains measured no better: TUNING).

    out = fp4_moe_tc(x, idx, weights, stack, swiglu_limit, add=None, out_dtype=torch.float32)

Why: the CUDA-core kernels of fp4_moe.py decode every e2m1 code to fp32 and FMA it (~12.6 SASS
instructions per weight byte); ncu on the H200 shows them issue-bound (75% issue slots, ALU pipe
70%) at ~1.5 TB/s. Here each lane decodes its codes straight into bf16 pairs (2 shifts and 2
logic ops per pair, no fp32 conversion), scales them with one packed bf16 multiply and feeds
`mma.sync.m16n8k16` (bf16 x bf16 -> fp32): ~6 SASS instructions per weight byte (offline).

How one warp computes 16 rows of W x (the GEMV of one token), per 128 columns:
* lane (g = lane / 4, c = lane % 4) loads 16 bytes (32 codes) of rows g and g + 8: columns
  32c .. 32c + 31 of the step, i.e. exactly one 32-column scale group per row;
* a 32-bit word holds codes of columns i = 0..7 (nibble i); its bf16 pair i holds columns (i,
  i + 4): bits (sign << 15 | eem << 6), the e2m1 value times 2^-126 (a bf16 subnormal for the
  code 0.5), then `mul.rn.bf16x2` by 2^(s - 1) (s: the UE8M0 byte) gives the exact weight
  e2m1 * 2^(s - 127) in bf16. This needs 1 <= s <= 128 (2^(s-1) must be a finite bf16); the
  stack builder checks it (`tc_scales_ok`), else the CUDA-core kernels run;
* pairs (0, 4) and (1, 5) of a word are one MMA's A fragment (row g: a0a1, a4a5; row g + 8:
  a2a3, a6a7), pairs (2, 6) and (3, 7) the next; the k order inside an MMA is free as long as B
  matches: lane c's B fragment holds x of the same columns, (x0, x4), (x1, x5) etc., built
  from the activation words with `prmt`. Every lane supplies the same x for its c, so the 8
  columns of the MMA's result are equal and c0 / c2 are the sums of rows g / g + 8;
* the whole step (loads, decode, MMAs) is one inline-PTX block per lane that reads the lane id
  itself, so nothing depends on how Triton lays out the [32 * warps, 2] accumulator tensor: each
  lane carries its own (c0, c2) from step to step.

Grids (K chunks and slots split over programs for parallelism; every partial goes to a
workspace and the program that arrives last for its output tile sums them in a fixed order, as
fp8_gemm's split-K, so results are deterministic):
* gate/up: (pairs, I / (16 * warps), KSPLIT): gate and up rows share the step's x; the last
  chunk sums the chunks in order, then the clamped SwiGLU of `_swiglu_h` -> h [T * k, I] x.dtype.
* down: (tokens, D / (16 * warps), k * NCH): slot j, chunk c of h[t, j] W2[e]^T; the last one
  sums each slot's chunks in order, rounds the slot to x.dtype (as every other path), sums the
  slots in slot order, adds `add`, rounds to out_dtype.
Values: exact bf16 weights and activations, fp32 accumulation (the MMA's internal order), so
equal to the other paths up to fp32 summation order.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from dspark.kernels.fp4_moe import _DT_NAME, FP4ExpertStack, _round_to, _swiglu_h
from dspark.kernels.fp8_gemm import _arrival_counters

STEP = 128                 # columns per warp step (4 lanes x 32)


def _decode(word: str, dst: str, sc: str) -> list[str]:
    """PTX: the 4 bf16 pairs (nibble i, nibble i + 4) of `word` into dst0..3, times sc: the
    eem bits of nibble i moved to bits 6-8 (and 22-24), its sign to bit 15 (and 31), each by one
    shift of the word and a mask (2 shifts + 2 logic ops per pair, 1 shift for i = 3)."""
    out = []
    for i in range(4):
        sh = 6 - 4 * i                                # eem: bit 4i -> bit 6
        out.append(f"shl.b32 %t1, {word}, {sh};" if sh >= 0 else f"shr.b32 %t1, {word}, {-sh};")
        sign = "%t2"
        if i < 3:                                     # sign: bit 4i + 3 -> bit 15
            out.append(f"shl.b32 %t2, {word}, {12 - 4 * i};")
        else:
            sign = word
        out += ["and.b32 %t1, %t1, 0x01C001C0;", f"and.b32 %t2, {sign}, 0x80008000;",
                f"or.b32 {dst}{i}, %t1, %t2;", f"mul.rn.bf16x2 {dst}{i}, {dst}{i}, {sc};"]
    return out


def _step_asm(two: bool, unroll: int = 1) -> str:
    """`unroll` 128-column steps of one warp (see the module docstring): every load of the
    steps is issued before the first decode, so a warp keeps `unroll` steps of loads in flight.
    Operands (pack 2): outputs G (c0, c2) [, U]; inputs G [, U], then uniform scalars (only
    their first register is read): wbase, xrow, sbase (u64: the expert's weight / scale rows 0
    and the token's activations), koff (column), rowblk (first 16-row tile of the program),
    wstride, sstride [, upw, ups] (u32: byte offsets of the up rows). The lane's rows come from
    %tid / %laneid here, never from Triton's layout of the operands."""
    n_out = 2 if two else 1
    o = [f"${i}" for i in range(2 * n_out)]                  # outputs, 2 per accumulator
    i0 = 4 * n_out                                           # inputs after the accumulators
    names = ["wbase", "xrow", "sbase", "koff", "rowblk", "wstride", "sstride"] + (
        ["upw", "ups"] if two else [])
    op = {n: f"${i0 + 2 * k}" for k, n in enumerate(names)}
    L = ["{", ".reg .u32 %lane, %g, %c, %t, %t1, %t2, %row;",
         ".reg .u64 %pw, %pw8, %pv, %pv8, %px, %ps, %ps8, %pu, %pu8, %q, %r;",
         ".reg .b32 %a<4>, %p<4>, %b<4>;", ".reg .f32 %dm<4>;"]
    for u in range(unroll):
        L.append(f".reg .b32 %w{u}_<8>, %v{u}_<8>, %x{u}_<16>, %s{u}_<4>, %sc{u}_<4>;")
    L += ["mov.u32 %lane, %laneid;", "shr.u32 %g, %lane, 2;", "and.b32 %c, %lane, 3;",
          "mov.u32 %t, %tid.x;", "shr.u32 %t, %t, 5;",                 # warp of the program
          f"add.u32 %t, %t, {op['rowblk']};", "shl.b32 %t, %t, 4;",    # its first row
          "add.u32 %row, %t, %g;"]                                     # the lane's row g
    for k in range(2 * n_out):                               # carry the accumulators
        L.append(f"mov.f32 {o[k]}, ${2 * n_out + k};")
    # c1 / c3 (columns 2c + 1) equal c0 / c2 (every column of B is x): one copy per block, then
    # each MMA accumulates in place in {c0, c1, c2, c3}
    for k in range(n_out):
        L += [f"mov.f32 %dm{2 * k}, {o[2 * k]};", f"mov.f32 %dm{2 * k + 1}, {o[2 * k + 1]};"]
    # addresses: weights row g at byte koff / 2 + 16 c, row g + 8, up rows (+ upw); activations
    # at column koff + 32 c; scales of group koff / 32 + c of the same rows. Step u: +64 u weight
    # bytes, +256 u activation bytes, +4 u scale bytes.
    L += [f"mad.lo.u32 %t, %c, 32, {op['koff']};", "mul.wide.u32 %q, %t, 2;",
          f"add.u64 %px, {op['xrow']}, %q;"]
    accs = [[o[0], "%dm0", o[1], "%dm1"]] + ([[o[2], "%dm2", o[3], "%dm3"]] if two else [])
    L += _steps(op, unroll, accs)
    L.append("}")
    return "\n".join(L)


def _steps(op: dict, unroll: int, accs: list) -> list[str]:
    """PTX of `unroll` 128-column steps once %row (the lane's row g), %c and %px (the lane's
    activations at column koff + 32 c) are set: weight / scale addresses of rows g, g + 8 (and
    the up rows), every load of the steps before the first decode (a warp keeps `unroll` steps
    of loads in flight), then decode and MMAs. accs: per matrix (gate [, up]) the 4 MMA
    accumulator operands {c0, c1, c2, c3}; op: the asm operand of each scalar by name (wbase,
    sbase, koff, wstride, sstride [, upw, ups])."""
    two = len(accs) == 2
    L = [f"mul.wide.u32 %q, %row, {op['wstride']};", f"add.u64 %pw, {op['wbase']}, %q;",
         f"shr.u32 %t, {op['koff']}, 1;", "mad.lo.u32 %t, %c, 16, %t;",
         "cvt.u64.u32 %q, %t;", "add.u64 %pw, %pw, %q;",
         f"mul.wide.u32 %r, {op['wstride']}, 8;", "add.u64 %pw8, %pw, %r;",
         f"mul.wide.u32 %q, %row, {op['sstride']};", f"add.u64 %ps, {op['sbase']}, %q;",
         f"shr.u32 %t, {op['koff']}, 5;", "add.u32 %t, %t, %c;", "cvt.u64.u32 %q, %t;",
         "add.u64 %ps, %ps, %q;", f"mul.wide.u32 %r, {op['sstride']}, 8;",
         "add.u64 %ps8, %ps, %r;"]
    if two:
        L += [f"cvt.u64.u32 %q, {op['upw']};", "add.u64 %pv, %pw, %q;", "add.u64 %pv8, %pw8, %q;",
              f"cvt.u64.u32 %q, {op['ups']};", "add.u64 %pu, %ps, %q;", "add.u64 %pu8, %ps8, %q;"]
    for u in range(unroll):
        wo, xo, so = 64 * u, 256 * u, 4 * u
        W = [f"%w{u}_{i}" for i in range(8)]
        V = [f"%v{u}_{i}" for i in range(8)]
        L += [f"ld.global.nc.v4.u32 {{{', '.join(W[:4])}}}, [%pw+{wo}];",
              f"ld.global.nc.v4.u32 {{{', '.join(W[4:])}}}, [%pw8+{wo}];"]
        if two:
            L += [f"ld.global.nc.v4.u32 {{{', '.join(V[:4])}}}, [%pv+{wo}];",
                  f"ld.global.nc.v4.u32 {{{', '.join(V[4:])}}}, [%pv8+{wo}];"]
        for k in range(4):
            X = ", ".join(f"%x{u}_{4 * k + q}" for q in range(4))
            L.append(f"ld.global.nc.v4.u32 {{{X}}}, [%px+{xo + 16 * k}];")
        L += [f"ld.global.nc.u8 %s{u}_0, [%ps+{so}];", f"ld.global.nc.u8 %s{u}_1, [%ps8+{so}];"]
        if two:
            L += [f"ld.global.nc.u8 %s{u}_2, [%pu+{so}];",
                  f"ld.global.nc.u8 %s{u}_3, [%pu8+{so}];"]
    for u in range(unroll):
        for k in range(2 * len(accs)):  # 2^(s - 1) as a bf16 pair: (s + 126) << 7 in both halves
            L.append(f"mad.lo.u32 %sc{u}_{k}, %s{u}_{k}, 0x00800080, 0x3F003F00;")
        mats = [(f"%w{u}_", f"%sc{u}_0", f"%sc{u}_1", accs[0])]
        if two:
            mats.append((f"%v{u}_", f"%sc{u}_2", f"%sc{u}_3", accs[1]))
        for j in range(4):            # word j: columns 8 j .. 8 j + 7 of the lane's 32
            x = [f"%x{u}_{4 * j + q}" for q in range(4)]  # (x0 x1) (x2 x3) (x4 x5) (x6 x7)
            L += [f"prmt.b32 %b0, {x[0]}, {x[2]}, 0x5410;",
                  f"prmt.b32 %b1, {x[0]}, {x[2]}, 0x7632;",
                  f"prmt.b32 %b2, {x[1]}, {x[3]}, 0x5410;",
                  f"prmt.b32 %b3, {x[1]}, {x[3]}, 0x7632;"]
            for w, sg, sg8, acc in mats:
                L += _decode(f"{w}{j}", "%a", sg) + _decode(f"{w}{j + 4}", "%p", sg8)
                d = ", ".join(acc)
                for lo, hi, b0, b1 in (("0", "1", "%b0", "%b1"), ("2", "3", "%b2", "%b3")):
                    L.append("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                             f"{{{d}}}, {{%a{lo}, %p{lo}, %a{hi}, %p{hi}}}, {{{b0}, {b1}}}, "
                             f"{{{d}}};")
    return L


def _store_asm(two: bool) -> str:
    """Lanes with c == 0 store their rows' sums at ws + warp * (32 or 16 floats): [g], [g + 8]
    (and up: [16 + g], [24 + g]). Operands (pack 2): dummy output; inputs G [, U], ws (u64)."""
    n = 2 if two else 1
    ws = f"${2 + 2 * n}"
    L = ["{", ".reg .pred %pc;", ".reg .u32 %lane, %g, %c, %t;", ".reg .u64 %a, %q;",
         "mov.u32 %lane, %laneid;", "shr.u32 %g, %lane, 2;", "and.b32 %c, %lane, 3;",
         "mov.u32 %t, %tid.x;", "shr.u32 %t, %t, 5;", f"mad.lo.u32 %t, %t, {16 * n}, %g;",
         "setp.eq.u32 %pc, %c, 0;", "mul.wide.u32 %q, %t, 4;", f"add.u64 %a, {ws}, %q;",
         "@%pc st.global.f32 [%a], $2;", "@%pc st.global.f32 [%a+32], $3;"]
    if two:
        L += ["@%pc st.global.f32 [%a+64], $4;", "@%pc st.global.f32 [%a+96], $5;"]
    L += ["mov.b32 $0, 0;", "mov.b32 $1, 0;", "}"]
    return "\n".join(L)


_STEP_UP, _STEP_DOWN = tl.constexpr(_step_asm(True)), tl.constexpr(_step_asm(False))
# (the constraint strings `_rows_gemv` spells out; tests check both agree with the PTX)
_STEP_UP_C = tl.constexpr("=f,=f,=f,=f,f,f,f,f,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r")
_STEP_DOWN_C = tl.constexpr("=f,=f,f,f,l,l,l,l,l,l,r,r,r,r,r,r,r,r")
_STEP_UP2, _STEP_DOWN2 = tl.constexpr(_step_asm(True, 2)), tl.constexpr(_step_asm(False, 2))
_STEP_UP4, _STEP_DOWN4 = tl.constexpr(_step_asm(True, 4)), tl.constexpr(_step_asm(False, 4))
_STORE_UP, _STORE_DOWN = tl.constexpr(_store_asm(True)), tl.constexpr(_store_asm(False))


@triton.jit
def _rows_gemv(acc_g, acc_u, wbase, xrow, sbase, k_lo, k_hi, rowblk, wstride, sstride, upw,
               ups, TWO: tl.constexpr, UNROLL: tl.constexpr):
    """Steps k_lo .. k_hi (columns) of each warp's 16 rows (and 16 up rows when TWO), UNROLL
    steps per asm block (k_hi - k_lo a multiple of UNROLL steps)."""
    for koff in range(k_lo, k_hi, 128 * UNROLL):
        if UNROLL == 4 and TWO:
            acc_g, acc_u = tl.inline_asm_elementwise(
                _STEP_UP4, "=f,=f,=f,=f,f,f,f,f,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r",
                [acc_g, acc_u, wbase, xrow, sbase, koff, rowblk, wstride, sstride, upw, ups],
                dtype=(tl.float32, tl.float32), is_pure=False, pack=2)
        elif UNROLL == 4:
            acc_g = tl.inline_asm_elementwise(
                _STEP_DOWN4, "=f,=f,f,f,l,l,l,l,l,l,r,r,r,r,r,r,r,r",
                [acc_g, wbase, xrow, sbase, koff, rowblk, wstride, sstride],
                dtype=tl.float32, is_pure=False, pack=2)
        elif UNROLL == 2 and TWO:
            acc_g, acc_u = tl.inline_asm_elementwise(
                _STEP_UP2, "=f,=f,=f,=f,f,f,f,f,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r",
                [acc_g, acc_u, wbase, xrow, sbase, koff, rowblk, wstride, sstride, upw, ups],
                dtype=(tl.float32, tl.float32), is_pure=False, pack=2)
        elif UNROLL == 2:
            acc_g = tl.inline_asm_elementwise(
                _STEP_DOWN2, "=f,=f,f,f,l,l,l,l,l,l,r,r,r,r,r,r,r,r",
                [acc_g, wbase, xrow, sbase, koff, rowblk, wstride, sstride],
                dtype=tl.float32, is_pure=False, pack=2)
        elif TWO:
            acc_g, acc_u = tl.inline_asm_elementwise(
                _STEP_UP, "=f,=f,=f,=f,f,f,f,f,l,l,l,l,l,l,r,r,r,r,r,r,r,r,r,r,r,r",
                [acc_g, acc_u, wbase, xrow, sbase, koff, rowblk, wstride, sstride, upw, ups],
                dtype=(tl.float32, tl.float32), is_pure=False, pack=2)
        else:
            acc_g = tl.inline_asm_elementwise(
                _STEP_DOWN, "=f,=f,f,f,l,l,l,l,l,l,r,r,r,r,r,r,r,r",
                [acc_g, wbase, xrow, sbase, koff, rowblk, wstride, sstride],
                dtype=tl.float32, is_pure=False, pack=2)
    return acc_g, acc_u


@triton.jit
def _store_partial(ws, acc_g, acc_u, TWO: tl.constexpr):
    """ws: the (tile, chunk) base address (int64)."""
    if TWO:
        tl.inline_asm_elementwise(_STORE_UP, "=r,=r,f,f,f,f,l,l", [acc_g, acc_u, ws],
                                  dtype=tl.int32, is_pure=False, pack=2)
    else:
        tl.inline_asm_elementwise(_STORE_DOWN, "=r,=r,f,f,l,l", [acc_g, ws],
                                  dtype=tl.int32, is_pure=False, pack=2)


@triton.jit
def _tc_gate_up_kernel(x_ptr, stride_xt, idx_ptr, rw_ptr, emap_ptr, w_ptr, stride_we, stride_wn,
                       s_ptr, stride_se, stride_sn, h_ptr, stride_hp, ws_ptr, cnt_ptr,
                       KSLOTS, I, D, limit, KCH,
                       KSPLIT: tl.constexpr, WARPS: tl.constexpr, DT: tl.constexpr,
                       UNROLL: tl.constexpr = 1):
    p = tl.program_id(0)
    pid_n = tl.program_id(1)
    ch = tl.program_id(2)
    row = tl.load(emap_ptr + tl.load(idx_ptr + p))            # stack row, -1: not held
    tile = p * tl.num_programs(1) + pid_n
    tile_ws = ws_ptr + (tile * KSPLIT * WARPS * 32).to(tl.int64)   # per chunk: W x (16 g, 16 u)
    acc = tl.zeros((32 * WARPS, 2), dtype=tl.float32)
    g, u = acc, acc
    if row >= 0:
        wbase = (w_ptr + row.to(tl.int64) * stride_we).to(tl.int64, bitcast=True)
        sbase = (s_ptr + row.to(tl.int64) * stride_se).to(tl.int64, bitcast=True)
        xrow = (x_ptr + (p // KSLOTS).to(tl.int64) * stride_xt).to(tl.int64, bitcast=True)
        g, u = _rows_gemv(acc, acc, wbase, xrow, sbase, ch * KCH, tl.minimum(ch * KCH + KCH, D),
                          pid_n * WARPS, stride_wn, stride_sn, I * stride_wn, I * stride_sn, True,
                          UNROLL)
    _store_partial((tile_ws + ch * WARPS * 32).to(tl.int64, bitcast=True), g, u, True)
    tl.debug_barrier()
    last = True
    if KSPLIT > 1:
        last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == KSPLIT - 1
    if last:
        r = tl.arange(0, 16 * WARPS)
        wofs = (r // 16) * 32 + r % 16                       # warp w's 32 floats: g then u
        gs = tl.zeros((16 * WARPS,), dtype=tl.float32)
        us = tl.zeros((16 * WARPS,), dtype=tl.float32)
        for c in tl.static_range(KSPLIT):
            gs += tl.load(tile_ws + c * WARPS * 32 + wofs, cache_modifier=".cg")
            us += tl.load(tile_ws + c * WARPS * 32 + wofs + 16, cache_modifier=".cg")
        h = _swiglu_h(gs, us, limit, tl.load(rw_ptr + p).to(tl.float32), DT)
        rn = pid_n * 16 * WARPS + r
        tl.store(h_ptr + p.to(tl.int64) * stride_hp + rn, h, mask=rn < I)
        if KSPLIT > 1:
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _tc_down_kernel(h_ptr, stride_hp, idx_ptr, emap_ptr, w_ptr, stride_we, stride_wn, s_ptr,
                    stride_se, stride_sn, out_ptr, stride_ot, add_ptr, stride_at, ws_ptr, cnt_ptr,
                    KSLOTS, D, I, KCH,
                    NCH: tl.constexpr, KS: tl.constexpr, WARPS: tl.constexpr, DT: tl.constexpr,
                    HAS_ADD: tl.constexpr, OUT_DT: tl.constexpr, UNROLL: tl.constexpr = 1):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    jc = tl.program_id(2)                                      # slot * NCH + chunk
    j = jc // NCH
    ch = jc % NCH
    p = t * KSLOTS + j
    row = tl.load(emap_ptr + tl.load(idx_ptr + p))
    tile = t * tl.num_programs(1) + pid_n
    tile_ws = ws_ptr + (tile * KS * NCH * WARPS * 16).to(tl.int64)   # per (slot, chunk): W x 16
    acc = tl.zeros((32 * WARPS, 2), dtype=tl.float32)
    y = acc
    if row >= 0:
        wbase = (w_ptr + row.to(tl.int64) * stride_we).to(tl.int64, bitcast=True)
        sbase = (s_ptr + row.to(tl.int64) * stride_se).to(tl.int64, bitcast=True)
        xrow = (h_ptr + p.to(tl.int64) * stride_hp).to(tl.int64, bitcast=True)
        y, _ = _rows_gemv(acc, acc, wbase, xrow, sbase, ch * KCH, tl.minimum(ch * KCH + KCH, I),
                          pid_n * WARPS, stride_wn, stride_sn, 0, 0, False, UNROLL)
    _store_partial((tile_ws + jc * WARPS * 16).to(tl.int64, bitcast=True), y, y, False)
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == KS * NCH - 1:
        r = tl.arange(0, 16 * WARPS)
        out = tl.zeros((16 * WARPS,), dtype=tl.float32)
        for jj in tl.static_range(KS):
            yj = tl.zeros((16 * WARPS,), dtype=tl.float32)
            for c in tl.static_range(NCH):
                yj += tl.load(tile_ws + (jj * NCH + c) * WARPS * 16 + r, cache_modifier=".cg")
            out += _round_to(yj, DT)
        rn = pid_n * 16 * WARPS + r
        if HAS_ADD:
            out += tl.load(add_ptr + t.to(tl.int64) * stride_at + rn, mask=rn < D,
                           other=0.0).to(tl.float32)
        out = _round_to(out, OUT_DT)
        tl.store(out_ptr + t.to(tl.int64) * stride_ot + rn, out, mask=rn < D)
        tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")


# Tuning (H200, V4-Flash widths, 1 token; see the module docstring): steps per asm block, warps
# per program, K chunks of the gate/up and of the down launch.
TUNING = dict(unroll=2, warps=1, up_split=4, down_split=2)


def tc_scales_ok(stack: FP4ExpertStack) -> bool:
    """Every UE8M0 byte in [1, 128] (2^(s-1) a finite bf16), as `stack_fp4_experts` recorded;
    a stack whose emap was replaced carries no record and is checked here (a host sync, never
    during CUDA graph capture: then it does not qualify)."""
    ok = getattr(stack.emap, "_dspark_tc_ok", None)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        ok = all(int(s.min()) >= 1 and int(s.max()) <= 128 for s in (stack.s13, stack.s2))
        stack.emap._dspark_tc_ok = ok
    return ok


def tc_applies(x: torch.Tensor, stack: FP4ExpertStack, k: int) -> bool:
    """bf16 x on an sm_90+ GPU, widths in whole 128-column steps and 16-row tiles, aligned rows,
    the scales in range."""
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    D = x.shape[1]
    I = stack.w13.shape[1] // 2
    return (D % STEP == 0 and I % STEP == 0 and stack.w13.stride(1) % 16 == 0
            and stack.w2.stride(1) % 16 == 0 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
            and stack.w13.data_ptr() % 16 == 0 and stack.w2.data_ptr() % 16 == 0
            and tc_scales_ok(stack))


def _split(K: int, n: int, unroll: int = 1) -> tuple[int, int]:
    """(chunks, columns per chunk): up to n chunks of whole units of `unroll` steps."""
    units = K // (STEP * unroll)
    n = max(1, min(n, units))
    per = triton.cdiv(units, n)
    return triton.cdiv(units, per), per * STEP * unroll


def _unroll(K: int, unroll: int | None) -> int:
    """Steps per asm block (1, 2 or 4; None: TUNING's), the largest of those <= the request
    that divides K's steps."""
    u = unroll or TUNING["unroll"]
    return next(v for v in (4, 2, 1) if v <= u and (K // STEP) % v == 0)


def _warps(W, n: int) -> int:
    W = W or TUNING["warps"]
    if n % (16 * W):
        raise ValueError(f"fp4_moe_tc: {W} warps of 16 rows do not tile {n} rows")
    return W


def fp4_moe_tc(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, stack: FP4ExpertStack,
               swiglu_limit: float, add: torch.Tensor | None = None,
               out_dtype: torch.dtype = torch.float32, up_split: int | None = None,
               down_split: int | None = None, warps: int | None = None,
               unroll: int | None = None) -> torch.Tensor:
    """Routed-expert output [T, D] (`fp4_moe_grouped`'s contract; `tc_applies` must hold)."""
    h = fp4_moe_tc_gate_up(x, idx, weights, stack, swiglu_limit, up_split, warps, unroll)
    return fp4_moe_tc_down(h, idx, stack, x.dtype, add, out_dtype, down_split, warps, unroll)


def fp4_moe_tc_gate_up(x, idx, weights, stack: FP4ExpertStack, swiglu_limit: float,
                       up_split: int | None = None, warps: int | None = None,
                       unroll: int | None = None) -> torch.Tensor:
    """h [T * k, I] x.dtype: the clamped SwiGLU of every (token, slot) pair, times its weight."""
    T, D = x.shape
    k = idx.shape[1]
    I = stack.w13.shape[1] // 2
    W = _warps(warps, I)
    un = _unroll(D, unroll)
    ks_up, kch_up = _split(D, up_split or TUNING["up_split"], un)
    idx = idx.contiguous()
    weights = weights.contiguous()
    P = T * k
    dev = x.device
    w13, s13, w2, s2, emap = stack
    h = torch.empty(P, I, dtype=x.dtype, device=dev)
    up_grid = (P, I // (16 * W), ks_up)
    ws_up = torch.empty(P * up_grid[1] * ks_up * W * 32, dtype=torch.float32, device=dev)
    _tc_gate_up_kernel[up_grid](
        x, x.stride(0), idx, weights, emap, w13, w13.stride(0), w13.stride(1), s13, s13.stride(0),
        s13.stride(1), h, h.stride(0), ws_up, _arrival_counters(dev, P * up_grid[1]), k, I, D,
        float(swiglu_limit), kch_up, KSPLIT=ks_up, WARPS=W, DT=_DT_NAME[x.dtype], UNROLL=un,
        num_warps=W)
    return h


def fp4_moe_tc_down(h: torch.Tensor, idx, stack: FP4ExpertStack, x_dtype,
                    add: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                    down_split: int | None = None, warps: int | None = None,
                    unroll: int | None = None) -> torch.Tensor:
    """out_dtype(sum over slots of x_dtype(h W2^T) [+ add]) [T, D]."""
    T, k = idx.shape
    I = stack.w13.shape[1] // 2
    w13, s13, w2, s2, emap = stack
    D = w2.shape[1]
    W = _warps(warps, D)
    un = _unroll(I, unroll)
    nch, kch_dn = _split(I, down_split or TUNING["down_split"], un)
    idx = idx.contiguous()
    dev = h.device
    out = torch.empty(T, D, dtype=out_dtype, device=dev)
    dn_grid = (T, D // (16 * W), k * nch)
    ws_dn = torch.empty(T * dn_grid[1] * k * nch * W * 16, dtype=torch.float32, device=dev)
    _tc_down_kernel[dn_grid](
        h, h.stride(0), idx, emap, w2, w2.stride(0), w2.stride(1), s2, s2.stride(0), s2.stride(1),
        out, out.stride(0), out if add is None else add, 0 if add is None else add.stride(0),
        ws_dn, _arrival_counters(dev, T * dn_grid[1]), k, D, I, kch_dn, NCH=nch, KS=k, WARPS=W,
        DT=_DT_NAME[x_dtype], HAS_ADD=add is not None, OUT_DT=_DT_NAME[out_dtype], UNROLL=un,
        num_warps=W)
    return out
