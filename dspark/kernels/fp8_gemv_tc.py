"""Few-token FP8 linears on tensor cores, one warp per 16 weight rows, no shared memory: y = x W^T
with W kept as e4m3 + UE8M0 128 x 128 tile scales (fp8_gemm's contract), for up to 16 tokens
(decode, verify). The default for bf16 x on CUDA sm_90+ where it applies (`tc_applies`);
elsewhere fp8_gemm's skinny kernel.

    y = fp8_gemv_tc(x2, wu, su, N, K, groups=1)     # x2 [T, K] (or [T, groups, K]) bf16

Why: fp8_gemm's skinny kernel stages weight tiles through shared memory (cp.async, then
ldmatrix-style loads, conversion, MMA): on the H200 it streams 33.6 MB at 2.2-2.6 TB/s (ncu:
14% occupancy at 96 registers, stalls on dependent waits and the shared-memory queue). Here a
lane loads its MMA fragments straight from global memory into registers, as fp4_moe_tc does:

* lane (g = lane / 4, c = lane % 4) of a warp owns weight rows g and g + 8 of the warp's 16 and,
  per 128-column step, 16 bytes of each row at columns 16c (chunk 0) and 64 + 16c (chunk 1): one
  128-bit load per row and chunk, 4 per step;
* the 32-bit word j of a 16-byte piece holds columns 4j .. 4j + 3: its low half (columns 4j,
  4j + 1) is the A fragment's k = (2c, 2c + 1) and its high half (4j + 2, 4j + 3) k = (2c + 8,
  2c + 9), each converted by one `cvt.rn.f16x2.e4m3x2` (exact: every e4m3 value is an f16); the
  k order inside an MMA is free as long as B matches, and B's (b0, b1) are x at the same columns,
  which are x's words 2j and 2j + 1 of the lane's 16 columns, converted bf16 -> f16 pairs;
* B's column n = g is token g (clamped to T - 1; the extra columns are discarded), so one
  m16n8k16 MMA covers 8 tokens; 9-16 tokens use a second B fragment (token g + 8) against the
  same A;
* each step's 8 MMAs (two chains of 4, one per chunk) start from zero; the step's sum times the
  tile's power-of-two scale (fp32, exact) is added to the lane's accumulators;
* the whole step is one inline-PTX block per lane that reads %laneid / %tid itself, so nothing
  depends on Triton's layout of the [32 * warps, 4] accumulator tensors.

H200 (benchmarks/results/bench_decode_kernels_fp8_gemv_tc_h200.txt, cold L2, 1 token):
wq_b 12.5 -> 11.7 us (2.86 TB/s), wo_b 15.5 -> 13.0, wo_a's 8 groups 13.8 -> 12.7, shared w1 + w3
9.6 -> 8.1, w2 7.0 -> 6.0 vs the skinny kernel; the V4-Flash 4-layer decode step's device time
0.880 -> 0.823 ms. ~1.5 SASS instructions per weight byte, 68 registers. Measured slower: 2 or 4
steps per asm block (equal at 1-6 tokens, slower at 16), K-split targets 1024 / 4096 warps, 2-4
warps per program; at 16 tokens (two n-tiles) 0.71-1.0x the skinny kernel (DISPATCH_MAX_T).

Numerics equal the skinny kernel's fp16 mode: x rounded to fp16 (exact for |x| in [2^-14, 65504],
absolute error < 2^-25 below), fp32 accumulation. A program whose sums are not finite (an x past
the fp16 range) recomputes them with bf16 operands (e4m3 -> f16 -> f32 -> bf16, exact), as the
skinny kernel does. K is split over programs when the row tiles alone leave SMs idle; each split
stores its partial to a workspace and the program that arrives last for a tile sums the splits
in order (deterministic), rounds to x's dtype and stores y.

With PDL (sm_90+: dspark.cuda.pdl) the launch may start
while the kernel ahead still runs: it lets the next kernel start at once and waits before reading
x; before that wait each lane loads its first step's weights (`_preload_asm`, a wait predicated
on them so ptxas keeps the loads ahead of it) and runs that step on them
(`_step_asm(given=True)`).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from dspark.cuda import pdl
from dspark.kernels.fp8_gemm import _arrival_counters

STEP = 128          # columns per warp step: 4 lanes x 16 bytes x 2 chunks
MAX_T = 16          # two n8 B fragments
# fp8_linear takes this kernel up to this many tokens. H200 (bench_decode_kernels,
# cold L2): at 1 and 6 tokens 1.07-1.21x faster than the skinny kernel on every decode shape; at
# 16 (two n-tiles) 0.71-1.0x, so the skinny kernel keeps 9-64 tokens.
DISPATCH_MAX_T = 8


def _x_pairs(words: list[str], bf16: bool, out: list[str]) -> list[str]:
    """PTX: x's bf16 pair words -> the B registers `out` (f16 pairs; bf16 operands: as loaded)."""
    if bf16:
        return [f"mov.b32 {o}, {w};" for o, w in zip(out, words)]
    L = []
    for o, w in zip(out, words):
        L += [f"and.b32 %fh, {w}, 0xFFFF0000;", f"shl.b32 %fl, {w}, 16;",
              f"cvt.rn.f16x2.f32 {o}, %fh, %fl;"]
    return L


def _w_pairs(word: str, lo: str, hi: str, bf16: bool) -> list[str]:
    """PTX: the e4m3 bytes of `word` -> lo (bytes 0, 1) and hi (bytes 2, 3) as f16 pairs (bf16:
    through fp32, exact)."""
    L = [f"mov.b32 {{%q0, %q1}}, {word};", f"cvt.rn.f16x2.e4m3x2 {lo}, %q0;",
         f"cvt.rn.f16x2.e4m3x2 {hi}, %q1;"]
    if bf16:
        for r in (lo, hi):
            L += [f"mov.b32 {{%q0, %q1}}, {r};", "cvt.f32.f16 %fl, %q0;", "cvt.f32.f16 %fh, %q1;",
                  f"cvt.rn.bf16x2.f32 {r}, %fh, %fl;"]
    return L


GIVEN_REGS = 20     # `_preload_asm`'s outputs: 16 weight words, the scale byte, 3 unused


def _lane_addresses(op: dict) -> list[str]:
    """PTX shared by `_step_asm` and `_preload_asm` (they must load the same bytes): the lane's
    row (%row, from %tid / %laneid and op['rowblk']), its scale byte's address for column
    op['koff'] (%ps), its weight addresses (%pw: row g at koff + 16c, %pw8: row g + 8), leaving
    %t = koff + 16c (the lane's first column). Needs .u32 %lane %g %c %t %row and .u64 %pw %pw8
    %ps %q declared; op: operand names of wbase, sbase, koff, rowblk, wstride, sstride."""
    return ["mov.u32 %lane, %laneid;", "shr.u32 %g, %lane, 2;", "and.b32 %c, %lane, 3;",
            "mov.u32 %t, %tid.x;", "shr.u32 %t, %t, 5;", f"add.u32 %t, %t, {op['rowblk']};",
            "shl.b32 %t, %t, 4;", "add.u32 %row, %t, %g;",
            "shr.u32 %t, %row, 7;", f"mul.wide.u32 %q, %t, {op['sstride']};",
            f"add.u64 %ps, {op['sbase']}, %q;", f"shr.u32 %t, {op['koff']}, 7;",
            "cvt.u64.u32 %q, %t;", "add.u64 %ps, %ps, %q;",
            f"mul.wide.u32 %q, %row, {op['wstride']};", f"add.u64 %pw, {op['wbase']}, %q;",
            f"mad.lo.u32 %t, %c, 16, {op['koff']};", "cvt.u64.u32 %q, %t;",
            "add.u64 %pw, %pw, %q;", f"mul.wide.u32 %q, {op['wstride']}, 8;",
            "add.u64 %pw8, %pw, %q;"]


def _weight_loads(W: list[str], off: int) -> list[str]:
    """PTX: one step's 16 weight words W of the lane at byte offset `off` of its addresses: chunk
    h (+ 64 h bytes) of row g into W[4h .. 4h + 3], of row g + 8 into W[8 + 4h ..]."""
    L = []
    for h in range(2):
        L += [f"ld.global.nc.v4.u32 {{{', '.join(W[4 * h:4 * h + 4])}}}, [%pw+{off + 64 * h}];",
              f"ld.global.nc.v4.u32 {{{', '.join(W[8 + 4 * h:12 + 4 * h])}}}, "
              f"[%pw8+{off + 64 * h}];"]
    return L


def _step_asm(nt: int, unroll: int, bf16: bool = False, given: bool = False) -> str:
    """`unroll` 128-column steps of one warp, every load issued before the first conversion.
    Operands (pack 4): outputs A0 [, A1] (4 floats each: rows g, g + 8 x tokens 2c, 2c + 1 of
    n-tile 0 [, 1]); inputs A0 [, A1], then uniform scalars (only the first register read):
    wbase, xbase, sbase (u64), koff, rowblk, wstride, sstride, xstride (bytes), tmax (T - 1).
    given (one step): the step's weight words and scale byte are not loaded but come in as the
    5 int32 tensors `_preload_asm` returned, between the accumulators and the scalars."""
    na = 4 * nt
    o = [f"${i}" for i in range(na)]
    i0 = 2 * na + (GIVEN_REGS if given else 0)
    assert not given or unroll == 1
    names = ["wbase", "xbase", "sbase", "koff", "rowblk", "wstride", "sstride", "xstride", "tmax"]
    op = {n: f"${i0 + 4 * k}" for k, n in enumerate(names)}
    ty = "bf16" if bf16 else "f16"
    L = ["{", ".reg .u32 %lane, %g, %c, %t, %row, %tok, %s;",
         ".reg .u64 %pw, %pw8, %px, %py, %ps, %q;", ".reg .b16 %q0, %q1;",
         ".reg .b32 %fh, %fl, %a<4>, %b<4>, %sc;", ".reg .f32 %e, %z;", ".reg .pred %pz;",
         f".reg .f32 %t0_<{na}>, %t1_<{na}>;"]
    for u in range(unroll):
        L.append(f".reg .b32 %w{u}_<16>, %x{u}_<{16 * nt}>, %s{u};")
    L += ["mov.f32 %z, 0f00000000;"] + [f"mov.f32 {o[k]}, ${na + k};" for k in range(na)]
    # weights / scale byte (`_lane_addresses`); x: token min(g, T-1) at column koff + 16c (%t;
    # n-tile 1: token min(g + 8, T-1))
    L += _lane_addresses(op)
    L += [f"min.u32 %tok, %g, {op['tmax']};", f"mul.wide.u32 %q, %tok, {op['xstride']};",
          f"add.u64 %px, {op['xbase']}, %q;", "mul.wide.u32 %q, %t, 2;", "add.u64 %px, %px, %q;"]
    if nt == 2:
        L += ["add.u32 %tok, %g, 8;", f"min.u32 %tok, %tok, {op['tmax']};",
              f"mul.wide.u32 %q, %tok, {op['xstride']};", f"add.u64 %py, {op['xbase']}, %q;",
              "mul.wide.u32 %q, %t, 2;", "add.u64 %py, %py, %q;"]
    for u in range(unroll):           # step u: + 128 u weight bytes, + 256 u x bytes, + u scales
        W = [f"%w{u}_{i}" for i in range(16)]
        X = [f"%x{u}_{i}" for i in range(16 * nt)]
        if not given:
            L += _weight_loads(W, 128 * u)
        for h in range(2):            # chunk h: x + 128 h bytes
            xo = 256 * u + 128 * h
            for n, p in enumerate(["%px", "%py"][:nt]):
                for k in range(2):
                    xs = X[16 * n + 8 * h + 4 * k:16 * n + 8 * h + 4 * k + 4]
                    L.append(f"ld.global.nc.v4.u32 {{{', '.join(xs)}}}, [{p}+{xo + 16 * k}];")
        if given:                     # the words as `_preload_asm` loaded them, in its order
            L += [f"mov.b32 {W[i]}, ${2 * na + i};" for i in range(16)]
            L.append(f"mov.b32 %s{u}, ${2 * na + 16};")
        else:
            L.append(f"ld.global.nc.u8 %s{u}, [%ps+{u}];")
    for u in range(unroll):
        # the tile's scale 2^(s - 127) as fp32 bits (s = 0: 2^-127, subnormal; 255: NaN)
        L += [f"shl.b32 %sc, %s{u}, 23;", f"setp.eq.u32 %pz, %s{u}, 0;",
              "selp.b32 %sc, 0x00400000, %sc, %pz;", f"setp.eq.u32 %pz, %s{u}, 255;",
              "selp.b32 %sc, 0x7FC00000, %sc, %pz;"]
        for h in range(2):
            for j in range(4):        # word j of the chunk: columns 4j .. 4j + 3
                w = f"%w{u}_{4 * h + j}"
                w8 = f"%w{u}_{8 + 4 * h + j}"
                L += _w_pairs(w, "%a0", "%a2", bf16) + _w_pairs(w8, "%a1", "%a3", bf16)
                for n in range(nt):
                    d = [f"%t{h}_{4 * n + i}" for i in range(4)]
                    xw = [f"%x{u}_{16 * n + 8 * h + 2 * j}", f"%x{u}_{16 * n + 8 * h + 2 * j + 1}"]
                    L += _x_pairs(xw, bf16, ["%b0", "%b1"])
                    acc = "%z, %z, %z, %z" if j == 0 else ", ".join(d)
                    L.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 "
                             f"{{{', '.join(d)}}}, {{%a0, %a1, %a2, %a3}}, {{%b0, %b1}}, "
                             f"{{{acc}}};")
        for k in range(na):
            L += [f"add.f32 %e, %t0_{k}, %t1_{k};", f"fma.rn.f32 {o[k]}, %e, %sc, {o[k]};"]
    L.append("}")
    return "\n".join(L)


def _preload_asm() -> str:
    """The weight words and scale byte of one step (column koff) of the lane, loaded as
    `_step_asm` loads them, for a step run later with given=True: PDL programs issue these loads
    before waiting for the kernel ahead (the weights are constant), so the step's HBM latency
    overlaps that kernel's tail. Operands (pack 4): outputs 5 int32 tensors (20 registers: the
    16 words, the scale byte, 3 unused); inputs a float tensor of the accumulators' shape (not
    read: it gives the outputs their layout), then wbase, sbase (u64), koff, rowblk, wstride,
    sstride (u32)."""
    i0 = GIVEN_REGS + 4
    op = {n: f"${i0 + 4 * k}" for k, n in enumerate(["wbase", "sbase", "koff", "rowblk",
                                                       "wstride", "sstride"])}
    L = ["{", ".reg .u32 %lane, %g, %c, %t, %row;", ".reg .u64 %pw, %pw8, %ps, %q;"]
    L += _lane_addresses(op) + _weight_loads([f"${i}" for i in range(16)], 0)
    L += ["ld.global.nc.u8 $16, [%ps];"] + [f"mov.b32 ${i}, 0;" for i in range(17, GIVEN_REGS)]
    return "\n".join(L + ["}"])


_PRELOAD_CONS = ",".join(["=r"] * GIVEN_REGS + ["f"] * 4 + ["l"] * 8 + ["r"] * 16)


def _store_asm(nt: int) -> str:
    """Every lane stores its 4 floats per n-tile at ws + warp * 128 nt floats, laid out [token
    (8 nt), row (16)]: (g, 2c) (g, 2c + 1) (g + 8, 2c) (g + 8, 2c + 1). Operands (pack 4): dummy
    output; inputs A0 [, A1], ws (u64)."""
    na = 4 * nt
    ws = f"${4 + na}"
    L = ["{", ".reg .u32 %lane, %g, %c, %t;", ".reg .u64 %a, %q;",
         "mov.u32 %lane, %laneid;", "shr.u32 %g, %lane, 2;", "and.b32 %c, %lane, 3;",
         "mov.u32 %t, %tid.x;", "shr.u32 %t, %t, 5;", f"mul.lo.u32 %t, %t, {128 * nt};",
         "mad.lo.u32 %t, %c, 32, %t;", "add.u32 %t, %t, %g;", "mul.wide.u32 %q, %t, 4;",
         f"add.u64 %a, {ws}, %q;"]
    for n in range(nt):
        for i, off in enumerate((0, 16, 8, 24)):      # d0..d3: (token 2c + i % 2, row + 8 (i / 2))
            L.append(f"st.global.f32 [%a+{4 * (128 * n + off)}], ${4 + 4 * n + i};")
    L += [f"mov.b32 ${i}, 0;" for i in range(4)] + ["}"]
    return "\n".join(L)


def _constraints(nt: int, given: bool = False) -> str:
    na = 4 * nt
    return ",".join(["=f"] * na + ["f"] * na + ["r"] * (GIVEN_REGS if given else 0)
                    + ["l"] * 12 + ["r"] * 24)


def _store_constraints(nt: int) -> str:
    return ",".join(["=r"] * 4 + ["f"] * 4 * nt + ["l"] * 4)


@functools.lru_cache(maxsize=None)
def _launch_strings(nt: int, unroll: int) -> dict:
    """The kernel's asm / constraint arguments for (n-tiles, steps per block), built once:
    generating them takes ~120 us of host time, which every eager launch would pay."""
    return dict(ASM=_step_asm(nt, unroll), ASM_BF16=_step_asm(nt, unroll, True),
                CONS=_constraints(nt), STORE=_store_asm(nt), STORE_C=_store_constraints(nt),
                PRE=_preload_asm(), PRE_C=_PRELOAD_CONS, GIVEN=_step_asm(nt, 1, given=True),
                GIVEN_C=_constraints(nt, given=True))


@triton.jit
def _rows(a0, a1, wbase, xbase, sbase, k_lo, k_hi, rowblk, wstride, sstride, xstride, tmax,
          ASM: tl.constexpr, CONS: tl.constexpr, NT: tl.constexpr, UNROLL: tl.constexpr):
    """Steps k_lo .. k_hi (a multiple of UNROLL steps) of each warp's 16 rows; ASM: `_step_asm`
    for NT n-tiles and UNROLL steps, CONS its constraints."""
    for koff in range(k_lo, k_hi, 128 * UNROLL):
        if NT == 2:
            a0, a1 = tl.inline_asm_elementwise(
                ASM, CONS, [a0, a1, wbase, xbase, sbase, koff, rowblk, wstride, sstride, xstride,
                            tmax], dtype=(tl.float32, tl.float32), is_pure=False, pack=4)
        else:
            a0 = tl.inline_asm_elementwise(
                ASM, CONS, [a0, wbase, xbase, sbase, koff, rowblk, wstride, sstride, xstride,
                            tmax], dtype=tl.float32, is_pure=False, pack=4)
    return a0, a1


# griddepcontrol.wait under a predicate computed from the preloaded words (true either way:
# the wait always runs). ptxas hoists a plain wait above independent loads and sinks loads to
# their use (offline SASS, Triton 3.6: ACQBULK first, the preload's LDGs after it, which
# defeats them; with a predicate on one word, that word's load alone came first); this one
# cannot run before every preloaded word has arrived, so all of the step's weight loads are in
# flight while the kernel ahead ends.
_WAIT_AFTER = tl.constexpr("{ .reg .pred %p; .reg .b32 %v; xor.b32 %v, $4, $8; "
                           "xor.b32 %v, %v, $12; xor.b32 %v, %v, $16; xor.b32 %v, %v, $20; "
                           "setp.ne.u32 %p, %v, $24; @%p griddepcontrol.wait; "
                           "@!%p griddepcontrol.wait; mov.u32 $0, 0; mov.u32 $1, 0; "
                           "mov.u32 $2, 0; mov.u32 $3, 0; }")
_WAIT_AFTER_C = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 24))


@triton.jit
def _wait_after(w0, w1, w2, w3, w4, opaque):
    """pdl.wait() once the words w0..w4 (`_preload_asm`'s outputs) are loaded; opaque: any
    runtime integer (the predicate's other side)."""
    tl.inline_asm_elementwise(_WAIT_AFTER, _WAIT_AFTER_C, [w0, w1, w2, w3, w4, opaque],
                              dtype=tl.int32, is_pure=False, pack=4)


@triton.jit
def _given_step(a0, a1, w0, w1, w2, w3, w4, wbase, xbase, sbase, koff, rowblk, wstride, sstride,
                xstride, tmax, GIVEN: tl.constexpr, GIVEN_C: tl.constexpr, NT: tl.constexpr):
    """One step at koff with the weight words w0..w4 `_preload_asm` loaded."""
    if NT == 2:
        a0, a1 = tl.inline_asm_elementwise(
            GIVEN, GIVEN_C, [a0, a1, w0, w1, w2, w3, w4, wbase, xbase, sbase, koff, rowblk,
                             wstride, sstride, xstride, tmax],
            dtype=(tl.float32, tl.float32), is_pure=False, pack=4)
    else:
        a0 = tl.inline_asm_elementwise(
            GIVEN, GIVEN_C, [a0, w0, w1, w2, w3, w4, wbase, xbase, sbase, koff, rowblk, wstride,
                             sstride, xstride, tmax], dtype=tl.float32, is_pure=False, pack=4)
    return a0, a1


@triton.jit
def _fp8_gemv_tc_kernel(x_ptr, stride_xt, stride_xg, w_ptr, stride_wn, s_ptr, stride_sn, y_ptr,
                        stride_yt, ws_ptr, cnt_ptr, T, N, K, KCH, GROUP_ROWS,
                        SPLIT: tl.constexpr, WARPS: tl.constexpr, NT: tl.constexpr,
                        UNROLL: tl.constexpr, ASM: tl.constexpr, ASM_BF16: tl.constexpr,
                        CONS: tl.constexpr, STORE: tl.constexpr, STORE_C: tl.constexpr,
                        PRE: tl.constexpr, PRE_C: tl.constexpr, GIVEN: tl.constexpr,
                        GIVEN_C: tl.constexpr, PDL: tl.constexpr = False,
                        PRELOAD: tl.constexpr = False):
    """ASM / ASM_BF16: `_step_asm(NT, UNROLL)` with f16 / bf16 operands, CONS their
    constraints; STORE / STORE_C: `_store_asm(NT)` and its constraints (asm strings are
    compile-time arguments: Triton takes no string built inside a kernel).
    PDL (dspark.cuda.pdl, on by default): launched while the kernel ahead still runs, this one
    lets the next start at once and waits for the one ahead before reading x; PRELOAD (UNROLL 1):
    before that wait each lane loads its first step's weight words (PRE, `_preload_asm`; the
    weights are constant), then runs that step on them (GIVEN, `_step_asm(given=True)`)."""
    pdl.launch_dependents(PDL)          # the next GEMV may start fetching its weights
    pid_n = tl.program_id(0)
    ch = tl.program_id(1)
    rowblk = pid_n * WARPS                                   # first 16-row tile of the program
    xg = ((pid_n * WARPS * 16) // GROUP_ROWS).to(tl.int64) * stride_xg
    wbase = w_ptr.to(tl.int64, bitcast=True)
    xbase = (x_ptr + xg).to(tl.int64, bitcast=True)
    sbase = s_ptr.to(tl.int64, bitcast=True)
    k_lo = ch * KCH
    k_hi = tl.minimum(k_lo + KCH, K)
    zero = tl.zeros((32 * WARPS, 4), dtype=tl.float32)
    if PRELOAD:
        w0, w1, w2, w3, w4 = tl.inline_asm_elementwise(
            PRE, PRE_C, [zero, wbase, sbase, k_lo, rowblk, stride_wn, stride_sn],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=4)
        _wait_after(w0, w1, w2, w3, w4, T)
        a0, a1 = _given_step(zero, zero, w0, w1, w2, w3, w4, wbase, xbase, sbase, k_lo, rowblk,
                             stride_wn, stride_sn, stride_xt * 2, T - 1, GIVEN, GIVEN_C, NT)
        a0, a1 = _rows(a0, a1, wbase, xbase, sbase, k_lo + 128, k_hi, rowblk, stride_wn,
                       stride_sn, stride_xt * 2, T - 1, ASM, CONS, NT, UNROLL)
    else:
        pdl.wait(PDL)
        a0, a1 = _rows(zero, zero, wbase, xbase, sbase, k_lo, k_hi, rowblk, stride_wn, stride_sn,
                       stride_xt * 2, T - 1, ASM, CONS, NT, UNROLL)
    # an x past fp16's range: redo this program's sums with bf16 operands
    bad = tl.sum(tl.sum(tl.where(tl.abs(a0) < float("inf"), 0, 1), axis=1), axis=0)
    if NT == 2:
        bad += tl.sum(tl.sum(tl.where(tl.abs(a1) < float("inf"), 0, 1), axis=1), axis=0)
    if bad > 0:
        a0, a1 = _rows(zero, zero, wbase, xbase, sbase, k_lo, k_hi, rowblk, stride_wn, stride_sn,
                       stride_xt * 2, T - 1, ASM_BF16, CONS, NT, UNROLL)
    TILE: tl.constexpr = WARPS * 128 * NT                    # floats per (program, split)
    tile_ws = ws_ptr + (pid_n * SPLIT * TILE).to(tl.int64)
    part = (tile_ws + ch * TILE).to(tl.int64, bitcast=True)
    if NT == 2:
        tl.inline_asm_elementwise(STORE, STORE_C, [a0, a1, part], dtype=tl.int32, is_pure=False,
                                  pack=4)
    else:
        tl.inline_asm_elementwise(STORE, STORE_C, [a0, part], dtype=tl.int32, is_pure=False,
                                  pack=4)
    tl.debug_barrier()
    last = True
    if SPLIT > 1:
        last = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    if last:
        r = tl.arange(0, TILE)
        warp = r // (128 * NT)
        tok = (r % (128 * NT)) // 16
        row = (rowblk + warp) * 16 + r % 16
        tot = tl.zeros((TILE,), dtype=tl.float32)
        for c in tl.static_range(SPLIT):
            tot += tl.load(tile_ws + c * TILE + r, cache_modifier=".cg")
        tl.store(y_ptr + tok.to(tl.int64) * stride_yt + row, tot.to(y_ptr.dtype.element_ty),
                 mask=tok < T)
        if SPLIT > 1:
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")


# Tuning (H200, V4-Flash shapes, 1-6 tokens): 1 warp per program, 1 step per asm block, K split
# until the launch has ~2048 warps (~16 per SM); 2-4 warps, 2 / 4 steps and 1024 / 4096 warps
# measured slower (see the module docstring). One step per block is also what the PDL preload
# needs (the kernel preloads only with UNROLL 1).
TUNING = dict(warps=1, unroll=1, target_warps=2048)


def tc_applies(x2: torch.Tensor, wu: torch.Tensor, N: int, K: int, groups: int = 1,
               max_t: int | None = None) -> bool:
    """bf16 x of 1..max_t tokens (default DISPATCH_MAX_T) on an sm_90+ GPU, e4m3 weight bytes,
    16-row tiles (inside each group), whole 128-column steps, 16-byte aligned weight and x rows."""
    if not (x2.is_cuda and x2.dtype == torch.bfloat16 and wu.element_size() == 1):
        return False
    if torch.cuda.get_device_capability(x2.device) < (9, 0):
        return False
    T = x2.shape[0]
    return (1 <= T <= (max_t or DISPATCH_MAX_T) and N % (16 * groups) == 0 and K % STEP == 0
            and wu.stride(-1) == 1 and wu.stride(0) % 16 == 0 and wu.data_ptr() % 16 == 0
            and x2.stride(-1) == 1 and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0
            and (groups == 1 or x2.stride(1) % 8 == 0))


def _plan(N: int, K: int, groups: int, warps: int | None, unroll: int | None,
          target: int | None) -> tuple[int, int, int, int]:
    """(warps per program, steps per asm block, K splits, columns per split): K split until the
    launch has ~`target` warps; each None: TUNING's value."""
    W = warps or TUNING["warps"]
    while W > 1 and (N // groups) % (16 * W):
        W //= 2
    steps = K // STEP
    u = unroll or TUNING["unroll"]
    u = next(v for v in (4, 2, 1) if v <= u and steps % v == 0)
    target = target or TUNING["target_warps"]
    units = steps // u
    split = max(1, min(units, target // max(1, N // 16)))
    per = triton.cdiv(units, split)
    split = triton.cdiv(units, per)
    return W, u, split, per * u * STEP


def fp8_gemv_tc(x2: torch.Tensor, wu: torch.Tensor, su: torch.Tensor, N: int, K: int,
                groups: int = 1, out_dtype: torch.dtype | None = None, warps: int | None = None,
                unroll: int | None = None, target: int | None = None) -> torch.Tensor:
    """[T, N] in out_dtype (x's dtype) from x2 [T, K] (groups > 1: [T, groups, K], weight rows
    g * N / groups .. times x2[:, g]) and the weight / scale bytes; `tc_applies` must hold."""
    T = x2.shape[0]
    assert 1 <= T <= MAX_T, f"fp8_gemv_tc: {T} tokens, this kernel takes 1..{MAX_T}"
    W, u, split, kch = _plan(N, K, groups, warps, unroll, target)
    nt = 1 if T <= 8 else 2
    y = torch.empty(T, N, dtype=out_dtype or x2.dtype, device=x2.device)
    programs = N // (16 * W)
    ws = torch.empty(programs * split * W * 128 * nt, dtype=torch.float32, device=x2.device)
    on = pdl.enabled(x2.device)
    _fp8_gemv_tc_kernel[(programs, split)](
        x2, x2.stride(0), x2.stride(1) if groups > 1 else 0, wu, wu.stride(0), su, su.stride(0),
        y, y.stride(0), ws, _arrival_counters(x2.device, programs), T, N, K, kch, N // groups,
        SPLIT=split, WARPS=W, NT=nt, UNROLL=u, PDL=on, PRELOAD=on and u == 1,
        num_warps=W, **_launch_strings(nt, u), **pdl.launch_kwargs(on))
    return y
