"""Sparse-MQA decode kernel v3 (``impl="v3"`` of :func:`dspark.kernels.sparse_mqa.sparse_mqa_fp8`).

The contract of sparse_mqa.py; the kernel is shaped to keep the live registers of a 64-head
program under the 255 of a Hopper thread (a whole [BLOCK_K, 512] tile decoded in fp32 registers
next to the 64x512 fp32 accumulator spills 1.3 KB per thread at BLOCK_K 64 / 8 warps):

* The 512 dims are four 128-column *chunks* (fp8 groups 0-1, 2-3, 4-5, and group 6 + RoPE). Each
  chunk of the key tile is decoded on its own ([BLOCK_K, 128]: a quarter of a whole tile's transient) and
  written once to shared memory as bf16 (its ``local_alloc``), where both wgmmas read it: the score
  S = sum_c Q_c K_c^T is accumulated chunk by chunk, and after the softmax each chunk's
  accumulator takes O_c += P K_c from the same shared-memory copy (K = V: nothing is decoded or
  gathered twice). Q is four resident shared-memory chunks; the accumulator is four 64x128 fp32
  tensors (the same 128 registers per thread at 8 warps, but no [64, 512] temporaries around it).
* One loop over the token's combined tile sequence (window list, then the extra list): the list's
  cache pointers and page geometry are per-tile scalar selects, so the loop body and its state
  exist once (a second loop per list re-derives its invariants and spills); with power-of-two
  entries per page (64 in production) page / row are a shift and a mask, computed once per tile
  for all four chunks, instead of a runtime integer division per key, chunk and layout.
* The next tile's index entries are loaded one iteration ahead (one dependent global round trip
  less per tile).
With fp16 operands (precision 'fp16', the shipped default rows) an e4m3 pair becomes an f16 pair
in one conversion and the power-of-two scale is one f16 multiply (the bf16 path goes through
fp32 and back): 1.48-1.50x FlashMLA instead of 1.58-1.61x at 64-256 requests.
Knobs: block_h, block_k, kv_splits (flash-decoding + the shared combine kernel), num_warps,
num_stages, maxnreg; split_d does not apply (always the full 512 columns); early_decode=True
decodes the tile's four chunks before its first score product (more loads and decode in flight;
offline the k64 s2 spills drop from 164 to 48 B/thread; on the H200 77.3 vs 79.5 us at 64
requests: the default for long batches).
Offline sm_90 compile (triton 3.6 = the H200's, benchmarks/kernel_regs.py), 64 heads, 8 warps:
v3 BLOCK_K 64: 240 B, 32 (2 stages): 16 B, 16 (2 stages): 0,
the loads of the next tile's chunks then go to shared memory by cp.async while this tile computes.
"""
from __future__ import annotations

import triton
import triton.language as tl

from dspark.kernels.common import dot, mma_operand
from dspark.kernels.sparse_mqa import _list_lengths, _sink_factor, _softmax_step


@triton.jit
def _v3_load_chunk(rec, sc, valid, c: tl.constexpr, cache_u8_ptr, cache_bf16_ptr,
                   FP8: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """Chunk c (columns [128c, 128c + 128)) of BLOCK_N keys -> MMA operand [BLOCK_N, 128].

    FP8: rec / sc = int64 [BLOCK_N] byte offsets of each key's data row and scale row (0 where
    invalid); the chunk is decoded as [BLOCK_N, 2, 64] (two 64-wide groups, scale byte broadcast
    over each; chunk 3's second group is the bf16 RoPE part). Dense: rec = element offset of the
    row in the kv tensor (cache_u8_ptr is then the bf16 / fp32 kv base pointer)."""
    if FP8:
        g = 2 * c + tl.arange(0, 2)[None, :, None]                 # global 64-wide group
        i = tl.arange(0, 64)[None, None, :]
        v3 = valid[:, None, None]
        rec3 = rec[:, None, None]
        if c < 3:
            f8 = tl.load(cache_u8_ptr + rec3 + g * 64 + i, mask=v3, other=0)
            sbyte = tl.load(cache_u8_ptr + sc[:, None, None] + g, mask=v3, other=127)
            scale = (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            if PRECISION == "fp16":
                # one conversion per value pair (e4m3x2 -> f16x2) and an f16 multiply by the
                # power-of-two scale: exact while the value is inside f16's range
                kv = f8.to(tl.float8e4nv, bitcast=True).to(tl.float16) * scale.to(tl.float16)
            else:
                kv = f8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
        else:
            is_nope = g < 7
            f8 = tl.load(cache_u8_ptr + rec3 + g * 64 + i, mask=v3 & is_nope, other=0)
            sbyte = tl.load(cache_u8_ptr + sc[:, None, None] + g, mask=v3 & is_nope, other=127)
            rope = tl.load(cache_bf16_ptr + ((rec3 >> 1) + 224) + i, mask=v3, other=0.0)
            scale = (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
            kv = tl.where(is_nope, f8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale,
                          rope.to(tl.float32))
        kv = tl.reshape(kv, (BLOCK_N, 128))
    else:
        d = c * 128 + tl.arange(0, 128)[None, :]
        kv = tl.load(cache_u8_ptr + rec[:, None] + d, mask=valid[:, None], other=0.0)
    return mma_operand(kv, PRECISION)


@triton.jit
def _v3_tile_ids(j, ta, a_idx_row, n_a, b_idx_row, n_b, BLOCK_N: tl.constexpr):
    """Index entries of combined tile j (tiles of list a first, then list b; -1 past the end)."""
    in_a = j < ta
    offs = tl.where(in_a, j, j - ta) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.where(in_a, a_idx_row, b_idx_row)
    return tl.load(row + offs, mask=offs < tl.where(in_a, n_a, n_b), other=-1)


@triton.jit
def _sparse_mqa_v3_kernel(
    q_ptr, stride_qt, stride_qh,
    out_ptr, stride_ot, stride_oh,
    part_ptr, lse_ptr,
    sink_ptr, H, qk_scale_log2,
    a_u8_ptr, a_bf16_ptr, a_page_bytes, a_N, a_shift, a_idx_ptr, a_stride_it, a_K, a_len_ptr,
    b_u8_ptr, b_bf16_ptr, b_page_bytes, b_N, b_shift, b_idx_ptr, b_stride_it, b_K, b_len_ptr,
    FP8: tl.constexpr, HAS_B: tl.constexpr, A_HAS_LEN: tl.constexpr, B_HAS_LEN: tl.constexpr,
    POW2_N: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    EARLY: tl.constexpr = False,
):
    """1-D grid over T × NUM_SPLITS × cdiv(H, BLOCK_H) (head blocks fastest). Outputs:
    the final rows (NUM_SPLITS == 1) or normalised partials + log2-sum-exp for _combine_kernel.

    One loop over the token's combined tile sequence (list a's tiles, then list b's; a split
    takes an equal share of it): per tile the list's cache pointers / page geometry are scalar
    selects, so there is one copy of the loop body and its state. POW2_N: both lists' entries per
    page are powers of two (a_shift / b_shift = log2 N): page and row are a shift and a mask.
    EARLY: the tile's four chunks are decoded before its first score product."""
    pid = tl.program_id(0)
    n_hb = tl.cdiv(H, BLOCK_H)
    hb = pid % n_hb
    rest = pid // n_hb
    split = rest % NUM_SPLITS
    t = (rest // NUM_SPLITS).to(tl.int64)

    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    dc = tl.arange(0, 128)
    q_rows = q_ptr + t * stride_qt + h[:, None] * stride_qh + dc[None, :]
    q0 = mma_operand(tl.load(q_rows, mask=h_ok[:, None], other=0.0), PRECISION)
    q1 = mma_operand(tl.load(q_rows + 128, mask=h_ok[:, None], other=0.0), PRECISION)
    q2 = mma_operand(tl.load(q_rows + 256, mask=h_ok[:, None], other=0.0), PRECISION)
    q3 = mma_operand(tl.load(q_rows + 384, mask=h_ok[:, None], other=0.0), PRECISION)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    a0 = tl.zeros((BLOCK_H, 128), tl.float32)
    a1 = tl.zeros((BLOCK_H, 128), tl.float32)
    a2 = tl.zeros((BLOCK_H, 128), tl.float32)
    a3 = tl.zeros((BLOCK_H, 128), tl.float32)

    n_a, n_b = _list_lengths(t, a_K, a_len_ptr, b_K, b_len_ptr, HAS_B, A_HAS_LEN, B_HAS_LEN)
    ta = tl.cdiv(n_a, BLOCK_N)
    n_tiles = ta + tl.cdiv(n_b, BLOCK_N)
    if NUM_SPLITS == 1:
        j_lo = 0
        j_hi = n_tiles
    else:
        per = tl.cdiv(n_tiles, NUM_SPLITS)
        j_lo = tl.minimum(split * per, n_tiles)
        j_hi = tl.minimum(j_lo + per, n_tiles)
    a_row = a_idx_ptr + t * a_stride_it
    b_row = b_idx_ptr + t * b_stride_it

    ent_next = _v3_tile_ids(j_lo, ta, a_row, n_a, b_row, n_b, BLOCK_N)
    for j in range(j_lo, j_hi):
        ent = ent_next
        ent_next = _v3_tile_ids(j + 1, ta, a_row, n_a, b_row, n_b, BLOCK_N)  # one tile ahead
        in_a = j < ta
        valid = ent >= 0
        ent = tl.where(valid, ent, 0)
        u8 = tl.where(in_a, a_u8_ptr, b_u8_ptr)
        bf = tl.where(in_a, a_bf16_ptr, b_bf16_ptr)
        pb = tl.where(in_a, a_page_bytes, b_page_bytes)
        if FP8:
            n = tl.where(in_a, a_N, b_N)
            if POW2_N:
                sh = tl.where(in_a, a_shift, b_shift)
                page = ent >> sh
                row = ent & (n - 1)
            else:
                page = ent // n
                row = ent - page * n
            base = page.to(tl.int64) * pb
            rec = base + row * 576                                 # data row (bytes)
            sc = base + n * 576 + row * 8                          # its scale row (bytes)
        else:
            rec = ent.to(tl.int64) * pb
            sc = rec
        if EARLY:
            # all four chunks decoded before the first product (more loads / decode in flight)
            k_0 = _v3_load_chunk(rec, sc, valid, 0, u8, bf, FP8, BLOCK_N, PRECISION)
            k_1 = _v3_load_chunk(rec, sc, valid, 1, u8, bf, FP8, BLOCK_N, PRECISION)
            k_2 = _v3_load_chunk(rec, sc, valid, 2, u8, bf, FP8, BLOCK_N, PRECISION)
            k_3 = _v3_load_chunk(rec, sc, valid, 3, u8, bf, FP8, BLOCK_N, PRECISION)
            s = dot(q0, tl.trans(k_0), tl.zeros((BLOCK_H, BLOCK_N), tl.float32), PRECISION)
            s = dot(q1, tl.trans(k_1), s, PRECISION)
            s = dot(q2, tl.trans(k_2), s, PRECISION)
            s = dot(q3, tl.trans(k_3), s, PRECISION)
        else:
            k_0 = _v3_load_chunk(rec, sc, valid, 0, u8, bf, FP8, BLOCK_N, PRECISION)
            s = dot(q0, tl.trans(k_0), tl.zeros((BLOCK_H, BLOCK_N), tl.float32), PRECISION)
            k_1 = _v3_load_chunk(rec, sc, valid, 1, u8, bf, FP8, BLOCK_N, PRECISION)
            s = dot(q1, tl.trans(k_1), s, PRECISION)
            k_2 = _v3_load_chunk(rec, sc, valid, 2, u8, bf, FP8, BLOCK_N, PRECISION)
            s = dot(q2, tl.trans(k_2), s, PRECISION)
            k_3 = _v3_load_chunk(rec, sc, valid, 3, u8, bf, FP8, BLOCK_N, PRECISION)
            s = dot(q3, tl.trans(k_3), s, PRECISION)
        p, alpha, m_i, l_i = _softmax_step(s, valid, qk_scale_log2, m_i, l_i)
        p = mma_operand(p, PRECISION)
        a0 = dot(p, k_0, a0 * alpha[:, None], PRECISION)
        a1 = dot(p, k_1, a1 * alpha[:, None], PRECISION)
        a2 = dot(p, k_2, a2 * alpha[:, None], PRECISION)
        a3 = dot(p, k_3, a3 * alpha[:, None], PRECISION)

    if NUM_SPLITS == 1:
        # sink: one extra logit per head, only in the denominator; pivot on max(m, sink)
        f = _sink_factor(sink_ptr, h, h_ok, m_i, l_i)
        o_rows = out_ptr + t * stride_ot + h[:, None] * stride_oh + dc[None, :]
    else:
        has = l_i > 0.0
        f = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        row = (t * NUM_SPLITS + split) * H + h                    # [BLOCK_H] rows of part/lse
        o_rows = part_ptr + row[:, None] * 512 + dc[None, :]
        tl.store(lse_ptr + row, lse, mask=h_ok)
    f = f[:, None]
    tl.store(o_rows, a0 * f, mask=h_ok[:, None])
    tl.store(o_rows + 128, a1 * f, mask=h_ok[:, None])
    tl.store(o_rows + 256, a2 * f, mask=h_ok[:, None])
    tl.store(o_rows + 384, a3 * f, mask=h_ok[:, None])


def launch_v3(q, out, part, lse, sink, qk_scale_log2, a, b, has_b, cfg, flags, launch_opts):
    """Launch the v3 kernel; a / b as in sparse_mqa._launch (b = a when has_b is False)."""
    T, H, _ = q.shape
    assert has_b or b is a
    if has_b:
        assert a[0].dtype == b[0].dtype, "impl='v3': both lists' caches must share a dtype"
    a_u8, a_bf, a_pb, a_N, a_idx, a_len = a
    b_u8, b_bf, b_pb, b_N, b_idx, b_len = b
    ns = cfg["kv_splits"]
    grid = (T * ns * triton.cdiv(H, cfg["block_h"]),)
    pow2 = all(n & (n - 1) == 0 for n in (a_N, b_N))
    return _sparse_mqa_v3_kernel[grid](
        q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1), part, lse,
        sink, H, qk_scale_log2,
        a_u8, a_bf, a_pb, a_N, a_N.bit_length() - 1, a_idx, a_idx.stride(0), a_idx.shape[1],
        a_len if a_len is not None else a_idx,
        b_u8, b_bf, b_pb, b_N, b_N.bit_length() - 1, b_idx, b_idx.stride(0), b_idx.shape[1],
        b_len if b_len is not None else b_idx,
        POW2_N=pow2, BLOCK_N=cfg["block_k"], NUM_SPLITS=ns,
        EARLY=bool(cfg.get("early_decode")),
        **flags, **launch_opts)
