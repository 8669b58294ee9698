"""Routed experts on tensor cores with the tokens of one expert in the MMA's 8 columns: the
verify / few-token-batch path of `fp4_moe_grouped` (same contract, stack and numerics).

    out = fp4_moe_tc_grouped(x, idx, weights, stack, swiglu_limit, add=None, out_dtype=fp32)

`fp4_moe_tc` issues `mma.sync.m16n8k16` with the same token in all 8 columns of B, so an expert
chosen by n of the batch's tokens is read n times: at 96 tokens x 6 slots over 256 V4-Flash
experts that is 576 expert reads where ~230 distinct experts are used. Here the (token, slot)
pairs are first sorted by expert into blocks of up to 8 pairs of one expert
(`fp4_moe_mma.align_pairs`, fixed shapes, capturable), and lane (g, c) of a warp supplies B's
column g from the activations of its block's pair g: one pass over an expert's weights serves
up to 8 tokens. The weight side is `fp4_moe_tc`'s unchanged (lane g loads rows g and g + 8,
columns 32c .. 32c + 31 of each 128-column step, decodes e2m1 straight to bf16 pairs), and so is
the k order inside each MMA, so every pair gets the per-pair kernel's fp32 sums in the same order
up to the tensor cores' rounding, which is not independent of the MMA's other columns (H200: h
one bf16 step apart at times, outputs within 2e-3 relative of the per-pair kernels').

The MMA leaves each lane 4 sums per matrix: c0, c1 (row g, columns 2c, 2c + 1) and c2, c3 (row
g + 8). The accumulators are [32 * warps, 4] tensors handed to the asm 4 at a time (pack 4: one
call per thread, which reads its lane from %laneid / %tid.x). The same asm also returns each
element's register id (4 * tid.x + i), so the epilogue maps every element to its weight row and
block column from the op that produced it, whatever layout Triton picks for the tensors (a
separate id-asm gets its own layout: Triton placed one in the store's layout, not the
accumulators'), and stores with ordinary Triton stores (no store asm, and no workspace when the
K reduction is not split).

* gate/up, grid (blocks, I / (16 * warps), KSPLIT): gate and up rows of the block's expert;
  split K chunks go to a workspace and the program arriving last sums them in order (as
  fp4_moe_tc); then the clamped SwiGLU of `_swiglu_h` with each column's routing weight ->
  h [T * k, I] x.dtype at the column's pair.
* down, grid (blocks, D / (16 * warps), NCH): y_p = h_p W2[e]^T, rounded to x.dtype per pair
  into y [T * k, D]; `_slot_sum_kernel` then sums each token's k slots in slot order, adds `add`
  and rounds to out_dtype (fp4_moe_tc_down's order).
Blocks past the last used one exit at once (the grid is sized for the worst case); experts not
held (emap -1) give zeros. Padding columns read a valid row (the table's -1 clamped to 0) and are
never stored.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.fp4_moe import _DT_NAME, FP4ExpertStack, _round_to, _swiglu_h
from dspark.kernels.fp4_moe_mma import align_pairs
from dspark.kernels.fp4_moe_tc import _split, _steps, _unroll, _warps
from dspark.kernels.fp8_gemm import _arrival_counters

COLS = 8                    # pairs per block: the MMA's N


def _step_asm(two: bool, unroll: int = 1) -> str:
    """`unroll` 128-column steps of one warp, 8 block columns. Operands (pack 4): outputs G
    (c0..c3) [, U], then each register's id 4 * tid.x + i; inputs G [, U]; then uniform scalars
    (first of 4 registers read): wbase, sbase (u64: the expert's weight / scale rows of the
    program's first 16-row tile), xbase (u64: activation row 0), ptab (u64: the block's 8 table
    entries), koff (column), wstride, sstride, xstride (row bytes), kdiv (table entry ->
    activation row: entry / kdiv) [, upw, ups] (u32)."""
    n_out = 2 if two else 1
    o = [f"${i}" for i in range(4 * n_out)]
    ids = [f"${4 * n_out + i}" for i in range(4)]
    i0 = 8 * n_out + 4
    names = ["wbase", "sbase", "xbase", "ptab", "koff", "wstride", "sstride", "xstride",
             "kdiv"] + (["upw", "ups"] if two else [])
    op = {n: f"${i0 + 4 * k}" for k, n in enumerate(names)}
    L = ["{", ".reg .u32 %lane, %g, %c, %t, %t1, %t2, %row, %xr;", ".reg .s32 %e;",
         ".reg .u64 %pw, %pw8, %pv, %pv8, %px, %ps, %ps8, %pu, %pu8, %q, %r;",
         ".reg .b32 %a<4>, %p<4>, %b<4>;"]
    for u in range(unroll):
        L.append(f".reg .b32 %w{u}_<8>, %v{u}_<8>, %x{u}_<16>, %s{u}_<4>, %sc{u}_<4>;")
    L += ["mov.u32 %lane, %laneid;", "shr.u32 %g, %lane, 2;", "and.b32 %c, %lane, 3;",
          "mov.u32 %t, %tid.x;", "shr.u32 %t, %t, 5;", "shl.b32 %t, %t, 4;",   # warp's 1st row
          "add.u32 %row, %t, %g;"]                                             # lane's row g
    for k in range(4 * n_out):                               # carry the accumulators
        L.append(f"mov.f32 {o[k]}, ${4 * n_out + 4 + k};")
    # which register of which thread each element is: from this op, so the element <-> (lane,
    # register) pairing is the accumulators' own whatever layout Triton gives them
    L += ["mov.u32 %t, %tid.x;", "shl.b32 %t, %t, 2;", f"mov.b32 {ids[0]}, %t;"]
    L += [f"add.u32 {ids[i]}, %t, {i};" for i in range(1, 4)]
    # column g's activations: row max(table[g], 0) / kdiv, columns koff + 32 c ..
    L += [f"mul.wide.u32 %q, %g, 4;", f"add.u64 %q, {op['ptab']}, %q;",
          "ld.global.nc.s32 %e, [%q];", "max.s32 %e, %e, 0;",
          f"div.u32 %xr, %e, {op['kdiv']};", f"mul.wide.u32 %q, %xr, {op['xstride']};",
          f"add.u64 %px, {op['xbase']}, %q;",
          f"mad.lo.u32 %t, %c, 32, {op['koff']};", "mul.wide.u32 %q, %t, 2;",
          "add.u64 %px, %px, %q;"]
    L += _steps(op, unroll, [o[0:4]] + ([o[4:8]] if two else []))   # fp4_moe_tc's steps
    L.append("}")
    return "\n".join(L)


def _constraints(two: bool) -> str:
    n = 2 if two else 1
    return ",".join(["=f"] * 4 * n + ["=r"] * 4 + ["f"] * 4 * n + ["l"] * 16
                    + ["r"] * 4 * (5 + (2 if two else 0)))


_STEP_UP1, _STEP_DOWN1 = tl.constexpr(_step_asm(True)), tl.constexpr(_step_asm(False))
_STEP_UP2, _STEP_DOWN2 = tl.constexpr(_step_asm(True, 2)), tl.constexpr(_step_asm(False, 2))
_UP_C, _DOWN_C = tl.constexpr(_constraints(True)), tl.constexpr(_constraints(False))


@triton.jit
def _block_gemm(acc_g, acc_u, wbase, sbase, xbase, ptab, k_lo, k_hi, wstride, sstride, xstride,
                kdiv, upw, ups, TWO: tl.constexpr, UNROLL: tl.constexpr):
    """(G, U, ids): the block's sums over columns k_lo .. k_hi and each element's register id
    (4 * tid.x + i). Before the first step the ids are any one-to-one numbering (the sums are
    all zero then, so any placement of them is right)."""
    v = tl.reshape(tl.arange(0, acc_g.shape[0] * 4), acc_g.shape)
    for koff in range(k_lo, k_hi, 128 * UNROLL):
        if UNROLL == 2 and TWO:
            acc_g, acc_u, v = tl.inline_asm_elementwise(
                _STEP_UP2, _UP_C, [acc_g, acc_u, wbase, sbase, xbase, ptab, koff, wstride,
                                   sstride, xstride, kdiv, upw, ups],
                dtype=(tl.float32, tl.float32, tl.int32), is_pure=False, pack=4)
        elif UNROLL == 2:
            acc_g, v = tl.inline_asm_elementwise(
                _STEP_DOWN2, _DOWN_C, [acc_g, wbase, sbase, xbase, ptab, koff, wstride, sstride,
                                       xstride, kdiv], dtype=(tl.float32, tl.int32),
                is_pure=False, pack=4)
        elif TWO:
            acc_g, acc_u, v = tl.inline_asm_elementwise(
                _STEP_UP1, _UP_C, [acc_g, acc_u, wbase, sbase, xbase, ptab, koff, wstride,
                                   sstride, xstride, kdiv, upw, ups],
                dtype=(tl.float32, tl.float32, tl.int32), is_pure=False, pack=4)
        else:
            acc_g, v = tl.inline_asm_elementwise(
                _STEP_DOWN1, _DOWN_C, [acc_g, wbase, sbase, xbase, ptab, koff, wstride, sstride,
                                       xstride, kdiv], dtype=(tl.float32, tl.int32),
                is_pure=False, pack=4)
    return acc_g, acc_u, v


@triton.jit
def _element_place(v, row0):
    """(weight row, block column) of every accumulator element from its register id v: lane
    (g, c) register i holds row g + 8 (i // 2) of its warp's 16, column 2 c + i % 2."""
    lane = (v >> 2) & 31
    slot = v & 3
    row = row0 + (v >> 7) * 16 + (lane >> 2) + 8 * (slot >> 1)
    col = 2 * (lane & 3) + (slot & 1)
    return row, col


@triton.jit
def _expert_rows(w_ptr, stride_we, stride_wn, s_ptr, stride_se, stride_sn, row, row0):
    wbase = (w_ptr + row.to(tl.int64) * stride_we + row0.to(tl.int64) * stride_wn).to(
        tl.int64, bitcast=True)
    sbase = (s_ptr + row.to(tl.int64) * stride_se + row0.to(tl.int64) * stride_sn).to(
        tl.int64, bitcast=True)
    return wbase, sbase


@triton.jit
def _split_sum(g, u, v, ws_ptr, tile, ch, cnt_ptr, KSPLIT: tl.constexpr, WARPS: tl.constexpr,
               MATS: tl.constexpr):
    """(whether this program finishes its tile, g, u summed over the K chunks in chunk order):
    each chunk stores its partials at [tile, chunk, matrix, element], and the program arriving
    last reads them back (fp4_moe_tc's split-K)."""
    last = True
    if KSPLIT > 1:
        tile_ws = ws_ptr + (tile * KSPLIT * MATS * WARPS * 128).to(tl.int64)
        tl.store(tile_ws + ch * MATS * WARPS * 128 + v, g)
        if MATS == 2:
            tl.store(tile_ws + ch * MATS * WARPS * 128 + WARPS * 128 + v, u)
        tl.debug_barrier()
        last = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu") == KSPLIT - 1
        if last:
            g = tl.zeros_like(g)
            u = tl.zeros_like(u)
            for c in tl.static_range(KSPLIT):
                g += tl.load(tile_ws + c * MATS * WARPS * 128 + v, cache_modifier=".cg")
                if MATS == 2:
                    u += tl.load(tile_ws + c * MATS * WARPS * 128 + WARPS * 128 + v,
                                 cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")
    return last, g, u


@triton.jit
def _grouped_gate_up_kernel(x_ptr, stride_xt, table_ptr, bexp_ptr, rw_ptr, emap_ptr, w_ptr,
                            stride_we, stride_wn, s_ptr, stride_se, stride_sn, h_ptr, stride_hp,
                            ws_ptr, cnt_ptr, KSLOTS, I, D, limit, KCH,
                            KSPLIT: tl.constexpr, WARPS: tl.constexpr, DT: tl.constexpr,
                            UNROLL: tl.constexpr):
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    ch = tl.program_id(2)
    e = tl.load(bexp_ptr + b)
    if e >= 0:                                               # a used block
        row = tl.load(emap_ptr + e)                          # stack row, -1: not held
        row0 = pid_n * WARPS * 16
        acc = tl.zeros((32 * WARPS, 4), dtype=tl.float32)
        g, u = acc, acc
        v = tl.reshape(tl.arange(0, 128 * WARPS), (32 * WARPS, 4))   # (all sums 0: any order)
        if row >= 0:
            wbase, sbase = _expert_rows(w_ptr, stride_we, stride_wn, s_ptr, stride_se,
                                        stride_sn, row, row0)
            g, u, v = _block_gemm(acc, acc, wbase, sbase, x_ptr.to(tl.int64, bitcast=True),
                               (table_ptr + b * 8).to(tl.int64, bitcast=True), ch * KCH,
                               tl.minimum(ch * KCH + KCH, D), stride_wn, stride_sn,
                               stride_xt * 2, KSLOTS, I * stride_wn, I * stride_sn, True, UNROLL)
        grow, col = _element_place(v, row0)
        last, g, u = _split_sum(g, u, v, ws_ptr, b * tl.num_programs(1) + pid_n, ch, cnt_ptr,
                                KSPLIT, WARPS, 2)
        if last:
            pair = tl.load(table_ptr + b * 8 + col)
            ok = pair >= 0
            rw = tl.load(rw_ptr + pair, mask=ok, other=0.0).to(tl.float32)
            h = _swiglu_h(g, u, limit, rw, DT)
            tl.store(h_ptr + pair.to(tl.int64) * stride_hp + grow, h, mask=ok & (grow < I))


@triton.jit
def _grouped_down_kernel(h_ptr, stride_hp, table_ptr, bexp_ptr, emap_ptr, w_ptr, stride_we,
                         stride_wn, s_ptr, stride_se, stride_sn, y_ptr, stride_yp, ws_ptr,
                         cnt_ptr, D, I, KCH, NCH: tl.constexpr, WARPS: tl.constexpr,
                         DT: tl.constexpr, UNROLL: tl.constexpr):
    b = tl.program_id(0)
    pid_n = tl.program_id(1)
    ch = tl.program_id(2)
    e = tl.load(bexp_ptr + b)
    if e >= 0:
        row = tl.load(emap_ptr + e)
        row0 = pid_n * WARPS * 16
        acc = tl.zeros((32 * WARPS, 4), dtype=tl.float32)
        y = acc
        v = tl.reshape(tl.arange(0, 128 * WARPS), (32 * WARPS, 4))
        if row >= 0:
            wbase, sbase = _expert_rows(w_ptr, stride_we, stride_wn, s_ptr, stride_se,
                                        stride_sn, row, row0)
            y, _, v = _block_gemm(acc, acc, wbase, sbase, h_ptr.to(tl.int64, bitcast=True),
                               (table_ptr + b * 8).to(tl.int64, bitcast=True), ch * KCH,
                               tl.minimum(ch * KCH + KCH, I), stride_wn, stride_sn,
                               stride_hp * 2, 1, 0, 0, False, UNROLL)
        grow, col = _element_place(v, row0)
        last, y, _ = _split_sum(y, y, v, ws_ptr, b * tl.num_programs(1) + pid_n, ch, cnt_ptr,
                                NCH, WARPS, 1)
        if last:
            pair = tl.load(table_ptr + b * 8 + col)
            ok = pair >= 0
            tl.store(y_ptr + pair.to(tl.int64) * stride_yp + grow, _round_to(y, DT),
                     mask=ok & (grow < D))


@triton.jit
def _slot_sum_kernel(y_ptr, stride_yp, add_ptr, stride_at, out_ptr, stride_ot, D,
                     KS: tl.constexpr, BLOCK: tl.constexpr, HAS_ADD: tl.constexpr,
                     OUT_DT: tl.constexpr):
    """out[t] = OUT_DT(sum over slots j in order of y[t * KS + j] (+ add[t])), fp32 sums."""
    t = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = rn < D
    out = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(KS):
        out += tl.load(y_ptr + (t * KS + j).to(tl.int64) * stride_yp + rn, mask=ok,
                       other=0.0).to(tl.float32)
    if HAS_ADD:
        out += tl.load(add_ptr + t.to(tl.int64) * stride_at + rn, mask=ok, other=0.0).to(
            tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + rn, _round_to(out, OUT_DT), mask=ok)


# Tuning (H200, V4-Flash widths, benchmarks/results/bench_moe_paths_h200.json): steps per asm
# block, warps per program, K chunks of the gate/up and the down launch (blocks x row tiles give
# thousands of programs already: every split measured slower, 2 warps the same).
TUNING = dict(unroll=2, warps=1, up_split=1, down_split=1)
# From how many (token, slot) pairs per expert `fp4_moe_grouped` runs these kernels instead of
# the per-pair ones (the align step's launches and the half-empty blocks cost more while
# experts rarely repeat). H200, one V4-Flash layer (256 experts, 6 slots): per-pair / grouped
# 443 / 496 us at 96 pairs, 899 / 843 at 216, 2191 / 1277 at 576.
MIN_PAIRS_PER_EXPERT = 0.6


def takes(pairs: int, num_experts: int) -> bool:
    """Whether `fp4_moe_grouped` groups `pairs` (token, slot) pairs over `num_experts` experts
    here. Shape-only: the same choice for every batch of a size (CUDA graphs)."""
    return pairs >= MIN_PAIRS_PER_EXPERT * num_experts


def _split_buffers(dev, chunks: int, tiles: int, per_tile: int):
    """(fp32 workspace of chunks x per_tile floats per tile, arrival counters) for a split K
    reduction; unsplit launches touch neither (a 1-float stand-in for both)."""
    if chunks == 1:
        one = torch.empty(1, dtype=torch.float32, device=dev)
        return one, one
    ws = torch.empty(tiles * chunks * per_tile, dtype=torch.float32, device=dev)
    return ws, _arrival_counters(dev, tiles)


def fp4_moe_tc_grouped(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                       stack: FP4ExpertStack, swiglu_limit: float,
                       add: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
                       add_ready=None, h_out: torch.Tensor | None = None, up_split: int | None = None,
                       down_split: int | None = None, warps: int | None = None,
                       unroll: int | None = None) -> torch.Tensor:
    """Routed-expert output [T, D] (`fp4_moe_grouped`'s contract; `fp4_moe_tc.tc_applies`
    must hold). add_ready: called before the first launch that reads `add` (the slot sum);
    h_out: where the hidden h [T * k, I] goes (tests)."""
    T, D = x.shape
    k = idx.shape[1]
    I = stack.w13.shape[1] // 2
    w13, s13, w2, s2, emap = stack
    dev = x.device
    table, bexp = align_pairs(idx, emap.numel(), COLS)
    nb = bexp.numel()
    weights = weights.contiguous()
    P = T * k
    un_up = min(_unroll(D, unroll or TUNING["unroll"]), 2)
    un_dn = min(_unroll(I, unroll or TUNING["unroll"]), 2)
    W_up, W_dn = _warps(warps or TUNING["warps"], I), _warps(warps or TUNING["warps"], D)
    ks_up, kch_up = _split(D, up_split or TUNING["up_split"], un_up)
    nch, kch_dn = _split(I, down_split or TUNING["down_split"], un_dn)
    dt = _DT_NAME[x.dtype]
    h = h_out if h_out is not None else torch.empty(P, I, dtype=x.dtype, device=dev)
    up_grid = (nb, I // (16 * W_up), ks_up)
    ws_up, cnt_up = _split_buffers(dev, ks_up, nb * up_grid[1], 2 * W_up * 128)
    _grouped_gate_up_kernel[up_grid](
        x, x.stride(0), table, bexp, weights, emap, w13, w13.stride(0), w13.stride(1), s13,
        s13.stride(0), s13.stride(1), h, h.stride(0), ws_up, cnt_up, k, I, D,
        float(swiglu_limit), kch_up, KSPLIT=ks_up, WARPS=W_up, DT=dt, UNROLL=un_up,
        num_warps=W_up)
    y = torch.empty(P, D, dtype=x.dtype, device=dev)
    dn_grid = (nb, D // (16 * W_dn), nch)
    ws_dn, cnt_dn = _split_buffers(dev, nch, nb * dn_grid[1], W_dn * 128)
    _grouped_down_kernel[dn_grid](
        h, h.stride(0), table, bexp, emap, w2, w2.stride(0), w2.stride(1), s2, s2.stride(0),
        s2.stride(1), y, y.stride(0), ws_dn, cnt_dn, D, I, kch_dn, NCH=nch, WARPS=W_dn, DT=dt,
        UNROLL=un_dn, num_warps=W_dn)
    out = torch.empty(T, D, dtype=out_dtype, device=dev)
    if add_ready is not None:
        add_ready()
    block = 1024
    _slot_sum_kernel[(T, triton.cdiv(D, block))](
        y, y.stride(0), out if add is None else add, 0 if add is None else add.stride(0), out,
        out.stride(0), D, KS=k, BLOCK=block, HAS_ADD=add is not None,
        OUT_DT=_DT_NAME[out_dtype], num_warps=4)
    return out
