"""Sparse multi-query attention with a per-head sink (spec §3.4, §3.11, §6.1).

One query token t attends, with all its H heads, to the key set given by an index list:

    ℓ_hj = scale · q_h · k_j,   o_h = Σ_j e^{ℓ_hj} v_j / (Σ_j e^{ℓ_hj} + e^{sink_h}),   k_j = v_j

(MQA: a single shared 512-d key/value head, K = V). Entries listed as −1 are masked; a token whose
keys are all masked gets o_h = 0 (only the sink is left in the softmax).

Index convention: a *global entry id* ``page · N + row`` into a paged cache (N entries per page),
which is what FlashMLA-style sparse kernels consume. Callers that hold request-local entry numbers
(the indexer's output, ring slots) convert them once per layer with
:func:`global_indices_from_page_table` — one tiny gather, shared by all heads and all layers of
the same cache group, so the kernel itself keeps a flat, cheap address computation.

Because the sliding-window keys and the compressed keys usually live in two different caches
(§6.4), both entry points take an optional *second* index list over an optional second cache
(``extra_*``); both lists go into the same softmax with the sink applied once, exactly as REF
concatenates the window and compressed index lists.

Two cache formats:
* ``sparse_mqa_fp8``  — ``fp8_ds_mla`` pages (584-B records, §6.1): de-quantized in the kernel.
* ``sparse_mqa_dense`` — plain rows ``kv[num_entries, 512]`` in bf16 or fp32.
Each has a pure-torch twin (``*_torch``) with the identical contract; the ``reference`` attention
backend calls those.

Kernel design (Hopper): one program = one query token × BLOCK_H heads. Since K = V is shared by all
heads, each key tile is loaded and de-quantized once and used by every head of the block for both
products (S = Q·Kᵀ and O += P·K), so BLOCK_H should cover as many heads as registers allow (64 on
H200 puts the whole V4-Flash head set in one wgmma M=64 tile). Online softmax in base 2 over key
tiles of BLOCK_K, fp32 statistics and accumulator; the sink joins at the end. Two implementations,
chosen per call (``impl``) or by the DEFAULT_CONFIGS table (keyed by the number of query tokens,
filled from benchmarks/sweep_attention.py):

* ``v1``: the first kernel, the fallback off the production case (fp32 q, fewer than 64 heads);
  split_d > 1 re-gathers the value slice.
* ``v3`` (sparse_mqa_v3.py), every DEFAULT_CONFIGS row: the key tile is decoded as four
  128-column chunks, each written once to shared memory and read there by both wgmmas (four
  64x128 accumulators), one loop over both index lists, shift/mask page math; spill-free at
  BLOCK_K 16-32 (offline, triton 3.6). ``kv_splits>1`` is flash-decoding: each split takes an
  equal share of the token's key tiles and writes a normalised partial output and log-sum-exp;
  a small combine kernel merges the splits with the sink (fills the GPU when T is small).
Knobs: impl, block_h, block_k, split_d (v1), kv_splits (v3), num_warps, num_stages, maxnreg,
precision.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from dspark.cuda import pdl
from dspark.kernels.norm_rope import _rnd
from dspark.kernels import invariant
from dspark.kernels.common import interpreting, mma, mma_operand, pick_precision

D_HEAD = 512        # full record width: 448 NoPE + 64 RoPE dims
RECORD_STRIDE = 576  # bytes per data row inside a page (448 fp8 + 128 bf16)
SCALE_STRIDE = 8     # bytes per scale row (7 UE8M0 + 1 pad)
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------

@triton.jit
def _softmax_step(s, valid, qk_scale_log2, m_i, l_i):
    """One online-softmax step (base 2) over a score tile s [heads, keys] of raw q.k products:
    (p, alpha, new running max, new running sum); the caller rescales its accumulator by alpha
    and adds p @ V. Masked keys get -inf; a row masked so far pivots on 0 (p = 0, alpha = 1)."""
    s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _sink_factor(sink_ptr, h, h_ok, m_i, l_i):
    """Output factor per head [BLOCK_H] after the last tile (no split): the sink is one extra
    logit in the denominator only; pivot on max(m, sink); 0 for a row with every key masked."""
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m_fin = tl.maximum(m_i, sink)
    m_fin = tl.where(m_fin == float("-inf"), 0.0, m_fin)
    alpha = tl.exp2(m_i - m_fin)                      # 0 for an all-masked row
    return alpha / (l_i * alpha + tl.exp2(sink - m_fin))


@triton.jit
def _list_lengths(t, a_K, a_len_ptr, b_K, b_len_ptr, HAS_B: tl.constexpr, A_HAS_LEN: tl.constexpr,
                  B_HAS_LEN: tl.constexpr):
    """Entries token t reads from list a and list b (0 without b): the list width, cut by the
    token's length when the list has a length array."""
    n_a = a_K
    if A_HAS_LEN:
        n_a = tl.minimum(tl.load(a_len_ptr + t), a_K)
    n_b = 0
    if HAS_B:
        n_b = b_K
        if B_HAS_LEN:
            n_b = tl.minimum(tl.load(b_len_ptr + t), b_K)
    return n_a, n_b


@triton.jit
def _load_kv_tile(ent, valid, d_off, cache_u8_ptr, cache_bf16_ptr, page_bytes, N,
                  FP8: tl.constexpr, BLOCK_K: tl.constexpr, D_COLS: tl.constexpr):
    """De-quantise columns [d_off, d_off + D_COLS) of BLOCK_K keys -> fp32 [BLOCK_K, D_COLS].

    ent: int64 [BLOCK_K] global entry ids (0 where invalid), valid: bool [BLOCK_K].
    FP8 layout (§6.1): the tile is viewed as [BLOCK_K, D_COLS/64, 64] 64-wide groups; global
    groups 0..6 are FP8 NoPE (scale = byte g of the row's scale record), group 7 is the bf16
    RoPE part. The two parts are loaded with complementary masks (no byte fetched twice).
    Dense layout: cache_u8_ptr is the kv base pointer (bf16 or fp32), page_bytes its row stride.
    Invalid keys come back as zero rows.
    """
    if FP8:
        page = ent // N
        row = ent - page * N
        rec = page * page_bytes + row * 576                        # byte offset of the data row
        sc = page * page_bytes + N * 576 + row * 8                  # byte offset of its scales
        g = tl.arange(0, D_COLS // 64)[None, :, None] + d_off // 64  # global group id
        i = tl.arange(0, 64)[None, None, :]                         # lane in the group
        v3 = valid[:, None, None]
        rec3 = rec[:, None, None]
        is_nope = g < 7
        f8 = tl.load(cache_u8_ptr + rec3 + g * 64 + i, mask=v3 & is_nope, other=0)
        nope = f8.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        # RoPE dims: 64 bf16 at byte rec + 448 (= element (rec + 448) / 2 of the bf16 view),
        # loaded as a 2-D [BLOCK_K, 64] tile and broadcast over the group axis: a masked
        # full-width [BLOCK_K, G, 64] load would hold G times the registers for nothing
        rope = tl.load(cache_bf16_ptr + (rec[:, None] + 448) // 2 + tl.arange(0, 64)[None, :],
                       mask=valid[:, None], other=0.0).to(tl.float32)
        sbyte = tl.load(cache_u8_ptr + sc[:, None, None] + g, mask=v3 & is_nope, other=127)
        # UE8M0 byte b -> 2^(b-127), built exactly from the fp32 exponent field
        scale = (sbyte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        kv = tl.where(is_nope, nope * scale, rope[:, None, :])
        kv = tl.reshape(kv, (BLOCK_K, D_COLS))
    else:
        d = d_off + tl.arange(0, D_COLS)[None, :]
        kv = tl.load(cache_u8_ptr + ent[:, None] * page_bytes + d, mask=valid[:, None],
                     other=0.0).to(tl.float32)
    return kv


@triton.jit
def _attend_list(q, m_i, l_i, acc, d_off, idx_row_ptr, n_keys, cache_u8_ptr, cache_bf16_ptr,
                 page_bytes, N, qk_scale_log2,
                 FP8: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_D: tl.constexpr,
                 PRECISION: tl.constexpr):
    """Online-softmax (base 2) pass over one index list; returns updated (m, l, acc).

    Scores always use all 512 dims; acc holds only this program's 512/SPLIT_D output columns.
    With SPLIT_D > 1 the value slice is gathered a second time (L1/L2 hits) instead of slicing
    the key tile, which Triton cannot do on a register tensor."""
    for k0 in range(0, n_keys, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        ent = tl.load(idx_row_ptr + offs, mask=offs < n_keys, other=-1)
        valid = ent >= 0
        ent = tl.where(valid, ent, 0).to(tl.int64)  # int64: caches can exceed 2^31 bytes
        k = _load_kv_tile(ent, valid, 0, cache_u8_ptr, cache_bf16_ptr, page_bytes, N,
                          FP8, BLOCK_K, 512)
        k = mma_operand(k, PRECISION)
        s = mma(q, tl.trans(k), PRECISION) * qk_scale_log2           # [BLOCK_H, BLOCK_K]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row that has seen only masked keys keeps m = -inf; use 0 as its pivot so that
        # exp2 never sees (-inf) - (-inf)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SPLIT_D == 1:
            v = k                                                      # K = V: same tile
        else:
            v = mma_operand(_load_kv_tile(ent, valid, d_off, cache_u8_ptr, cache_bf16_ptr,
                                           page_bytes, N, FP8, BLOCK_K, 512 // SPLIT_D),
                             PRECISION)
        acc = acc * alpha[:, None] + mma(p, v, PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _sparse_mqa_kernel(
    q_ptr, stride_qt, stride_qh,
    out_ptr, stride_ot, stride_oh,
    sink_ptr, H, qk_scale_log2,
    a_u8_ptr, a_bf16_ptr, a_page_bytes, a_N, a_idx_ptr, a_stride_it, a_K, a_len_ptr,
    b_u8_ptr, b_bf16_ptr, b_page_bytes, b_N, b_idx_ptr, b_stride_it, b_K, b_len_ptr,
    FP8: tl.constexpr, HAS_B: tl.constexpr, A_HAS_LEN: tl.constexpr, B_HAS_LEN: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Grid (T, cdiv(H, BLOCK_H), SPLIT_D): one token × BLOCK_H heads × 512/SPLIT_D out cols."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    D_OUT: tl.constexpr = 512 // SPLIT_D
    d_off = tl.program_id(2) * D_OUT
    d = tl.arange(0, 512)

    q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None], other=0.0)
    q = mma_operand(q, PRECISION)
    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D_OUT), tl.float32)

    n_a = a_K
    if A_HAS_LEN:
        n_a = tl.minimum(tl.load(a_len_ptr + t), a_K)
    m_i, l_i, acc = _attend_list(q, m_i, l_i, acc, d_off, a_idx_ptr + t * a_stride_it, n_a,
                                 a_u8_ptr, a_bf16_ptr, a_page_bytes, a_N, qk_scale_log2,
                                 FP8, BLOCK_K, SPLIT_D, PRECISION)
    if HAS_B:
        n_b = b_K
        if B_HAS_LEN:
            n_b = tl.minimum(tl.load(b_len_ptr + t), b_K)
        m_i, l_i, acc = _attend_list(q, m_i, l_i, acc, d_off, b_idx_ptr + t * b_stride_it, n_b,
                                     b_u8_ptr, b_bf16_ptr, b_page_bytes, b_N, qk_scale_log2,
                                     FP8, BLOCK_K, SPLIT_D, PRECISION)

    # Sink: one extra logit per head that only enlarges the denominator. Re-pivot on
    # max(m, sink) so neither e^{sink-m} nor the key terms can overflow.
    out = acc * _sink_factor(sink_ptr, h, h_ok, m_i, l_i)[:, None]
    do = d_off + tl.arange(0, D_OUT)
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + do[None, :], out,
             mask=h_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Shared by the v3 kernel (sparse_mqa_v3.py) and the split-KV combine
# ----------------------------------------------------------------------------------------------

@triton.jit
def _combine_kernel(part_ptr, lse_ptr, sink_ptr, out_ptr, stride_ot, stride_oh, H,
                    cis_ptr, pos_ptr,
                    NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, ROPE: tl.constexpr = False,
                    R_HALF: tl.constexpr = 32, ROUND: tl.constexpr = 0,
                    PDL: tl.constexpr = False):
    """out[t, h] = Σ_s 2^(lse_s − m) · part_s / (Σ_s 2^(lse_s − m) + 2^(sink·log2e − m)),
    m = max(lse_s, sink·log2e) (finite: the sink is). Grid (T, cdiv(H, BLOCK_H)).
    ROPE: then as kernels.norm_rope without a norm (the attention output's inverse RoPE): the
    row rounded to out's dtype (ROUND 1: bf16), its last R_HALF interleaved pairs rotated by
    cis[pos[t]] (float32 [rows, R_HALF, 2], already conjugated) and rounded again.
    PDL: the output projection's GEMV after it may start (fetching its weights) now."""
    pdl.launch_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    d = tl.arange(0, 512)
    if ROPE:        # the rotation's table row first: its two dependent loads overlap the rest
        i = tl.arange(0, 256) - (256 - R_HALF)                      # rope pair index, < 0: none
        rot = i >= 0
        at = tl.load(pos_ptr + t).to(tl.int64) * (2 * R_HALF) + 2 * tl.maximum(i, 0)
        cos = tl.load(cis_ptr + at, mask=rot, other=1.0)        # (broadcast at the use: a
        sin = tl.load(cis_ptr + at + 1, mask=rot, other=0.0)    # layout change here would wait)
    sink = tl.load(sink_ptr + h, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    m = sink
    for s in tl.static_range(NUM_SPLITS):
        lse = tl.load(lse_ptr + (t * NUM_SPLITS + s) * H + h, mask=h_ok, other=float("-inf"))
        m = tl.maximum(m, lse)
    denom = tl.exp2(sink - m)
    acc = tl.zeros((BLOCK_H, 512), tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        row = (t * NUM_SPLITS + s) * H + h
        w = tl.exp2(tl.load(lse_ptr + row, mask=h_ok, other=float("-inf")) - m)
        denom += w
        acc += w[:, None] * tl.load(part_ptr + row[:, None] * 512 + d[None, :],
                                    mask=h_ok[:, None], other=0.0)
    acc = acc / denom[:, None]
    if ROPE:
        acc = _rnd(acc, ROUND)
        re, im = tl.split(tl.reshape(acc, (BLOCK_H, 256, 2)))     # pair i: dims 2i, 2i + 1
        cos, sin = cos[None, :], sin[None, :]
        re2 = tl.where(rot[None, :], _rnd(re * cos - im * sin, ROUND), re)
        im2 = tl.where(rot[None, :], _rnd(re * sin + im * cos, ROUND), im)
        acc = tl.reshape(tl.join(re2, im2), (BLOCK_H, 512))
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


# ----------------------------------------------------------------------------------------------
# Python wrappers
# ----------------------------------------------------------------------------------------------

# Default launch configuration for the production case (bf16 q -> bf16 MMAs, H >= 64), keyed by
# the number of query tokens T: the first row with T <= max_tokens wins (None = no bound).
# Paste the table printed by benchmarks/sweep_attention.py (H200 sweep) here.
# H200 sweeps (benchmarks/results/sweep_attention_v3*_h200.json; FlashMLA anchors 48.8 / 91.5 /
# 174 us at 64 / 128 / 256 requests x 2 tokens): up to 32 query tokens BLOCK_K 32 with split-KV
# 4 (39.4 us at 16 requests); from 128 tokens BLOCK_K 64, 2 stages, early_decode (a tile's four
# chunks decoded before its first score wgmma). fp16 MMA operands (q, the decoded keys, P; an
# e4m3 pair becomes an f16 pair in one conversion, the power-of-two scale one f16 multiply, where
# the bf16 path goes through fp32): 72.1 / 136.6 / 260.9 us = 1.48 / 1.49 / 1.50x FlashMLA (bf16
# operands 77.3 / 146.1 / 280.5), 38.0 us at 16. fp16 keeps 3 more mantissa bits than bf16; its
# range (|value| < 65504, scales >= 2^-24) holds for RMS-normed latents.
# Up to 8 tokens (the batch-1 V4-Flash decode graph on the H200, 64 heads, 128 window + 0 / 512
# compressed keys): 16 heads x 8 KV splits per program with
# 4 warps (128 programs per token, each reading a quarter of q and writing a quarter of the
# partials of a 64-head program) took 8.8 / 9.2 us per SWA / compressed layer against 9.7 / 13.9
# for 64 heads x 4 splits x 8 warps (16 heads x 4 splits: 8.6 / 12.8; 32 heads: 10.6 / 17.7;
# 2 splits: 12.6 / 16.3); device time per step 0.810 -> 0.800 ms. Measured at 1 token only: from
# 9 tokens on (verify rounds of several requests) the 64-head row of the sweep below stays.
DEFAULT_CONFIGS: list[tuple[int | None, dict]] = [
    (8, dict(impl="v3", block_h=16, block_k=32, split_d=1, kv_splits=8, num_warps=4,
             num_stages=2, fp16_operands=True)),
    (32, dict(impl="v3", block_h=64, block_k=32, split_d=1, kv_splits=4, num_warps=8,
              num_stages=2, fp16_operands=True)),
    (None, dict(impl="v3", block_h=64, block_k=64, split_d=1, kv_splits=1, num_warps=8,
                num_stages=2, early_decode=True, fp16_operands=True)),
]


# heads per program of the split-KV combine. H200, batch-1
# V4-Flash decode graph (64 heads, 4 splits, inverse RoPE in the launch): 4.9 us at 16 heads,
# 2.4 at 4, 1.8 at 2 (each program reads its heads' partials: 128 KB at 16 heads); device time
# per step 0.821 -> 0.808 ms from 16 to 4 heads.
COMBINE_BLOCK_H = 2


def _resolve_config(T: int, H: int, prec: str, user: dict) -> dict:
    """Full launch configuration.

    No tuning knob given, bf16 MMAs (bf16 q) and H ≥ 64 (the production case): the
    DEFAULT_CONFIGS row for T. Otherwise a simple heuristic for the chosen implementation (v1
    unless ``impl`` says otherwise) with the given knobs on top: BLOCK_H = all heads up to 64 (one
    wgmma M-tile; every key tile is shared by all of them), BLOCK_K 64 for bf16 operands and
    32 for fp32 ones (an fp32 K tile of 64 rows next to q exceeds the 227 KB of an H200 SM), 8
    warps for 64 heads, one stage, no splits.
    """
    user = {k: v for k, v in user.items() if v is not None}
    cfg = None
    if not user and prec in ("bf16", "fp16") and H >= 64:
        # batch-invariant mode: the first row for every token count, past its bound too (the
        # heuristic below is a function of H and the precision alone already)
        for bound, row in DEFAULT_CONFIGS:
            if bound is None or T <= bound or invariant.on():
                cfg = dict(row)
                break
    if cfg is None:
        impl = user.get("impl", "v1")
        bh = user.get("block_h", min(64, max(16, triton.next_power_of_2(H))))
        bk = 64 if prec in ("bf16", "fp16") else 32
        cfg = dict(impl=impl, block_h=bh, block_k=bk, split_d=1, kv_splits=1,
                   num_warps=8 if bh >= 64 else 4, num_stages=1)
    cfg.update(user)
    cfg.setdefault("kv_splits", 1)
    cfg.setdefault("split_d", 1)
    cfg.setdefault("maxnreg", None)
    cfg.setdefault("early_decode", False)
    cfg.setdefault("fp16_operands", False)
    assert cfg["impl"] == "v3" or not cfg["early_decode"], "early_decode needs impl='v3'"
    assert cfg["impl"] in ("v1", "v3"), f"impl must be 'v1' or 'v3', got {cfg['impl']!r}"
    assert cfg["block_h"] >= 16 and cfg["block_k"] >= 16, "tl.dot needs tiles of at least 16"
    if cfg["impl"] == "v1":
        assert cfg["split_d"] in (1, 2, 4), "split_d must be 1, 2 or 4"
        assert cfg["kv_splits"] == 1, "kv_splits > 1 needs impl='v3'"
    else:
        assert cfg["split_d"] == 1, "impl='v3' always covers the 512 columns in one program"
        assert cfg["kv_splits"] >= 1, "kv_splits must be >= 1"
    return cfg


def _check_list(indices: torch.Tensor, lengths, T: int, name: str):
    assert indices.dim() == 2 and indices.shape[0] == T, f"{name}: expected [T, K] indices"
    indices = indices.to(torch.int32).contiguous()
    if lengths is not None:
        assert lengths.shape == (T,), f"{name}: lengths must be [T]"
        lengths = lengths.to(torch.int32).contiguous()
    return indices, lengths


def _prep_q(q: torch.Tensor, sink: torch.Tensor):
    assert q.dim() == 3 and q.shape[2] == D_HEAD, "q must be [T, H, 512]"
    if q.dtype not in (torch.bfloat16, torch.float32):
        q = q.float()
    if q.stride(2) != 1:
        q = q.contiguous()
    assert sink.shape == (q.shape[1],), "sink must be [H]"
    return q, sink.float().contiguous()


# The resolved configuration and compiled kernel of the latest launch (diagnostics for the sweep:
# registers, spills, shared memory); the kernel entry is None under TRITON_INTERPRET.
LAST_LAUNCH: dict = {}


def _launch(q, sink, scale, fp8, a, b, tuning: dict, precision, rope=None):
    """a / b = (u8 view, bf16 view, page_bytes_or_row_stride, N, indices, lengths) or None.
    rope = (cis, positions, dtype) or None: see `sparse_mqa_fp8`."""
    T, H, _ = q.shape
    out = torch.empty((T, H, D_HEAD), dtype=torch.float32, device=q.device)
    if T == 0 or H == 0:
        return out if rope is None else out.to(rope[2])
    prec = pick_precision(q.dtype, precision)
    cfg = _resolve_config(T, H, prec, tuning)
    if precision is None and prec == "bf16" and cfg["fp16_operands"] and fp8:
        prec = "fp16"           # a DEFAULT_CONFIGS row's choice for fp8 pages (see there); bf16
                                # caches keep bf16 operands (their range is bf16's)
    has_b = b is not None
    if not has_b:
        b = a  # dummy arguments, never read (HAS_B = False)
    a_u8, a_bf, a_pb, a_N, a_idx, a_len = a
    b_u8, b_bf, b_pb, b_N, b_idx, b_len = b
    list_args = (
        a_u8, a_bf, a_pb, a_N, a_idx, a_idx.stride(0), a_idx.shape[1],
        a_len if a_len is not None else a_idx,
        b_u8, b_bf, b_pb, b_N, b_idx, b_idx.stride(0), b_idx.shape[1],
        b_len if b_len is not None else b_idx,
    )
    launch_opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg["maxnreg"] is not None and not interpreting():
        launch_opts["maxnreg"] = cfg["maxnreg"]
    flags = dict(FP8=fp8, HAS_B=has_b, A_HAS_LEN=a_len is not None,
                 B_HAS_LEN=has_b and b_len is not None, BLOCK_H=cfg["block_h"],
                 SPLIT_D=cfg["split_d"], PRECISION=prec)
    LAST_LAUNCH["config"] = cfg
    if cfg["impl"] == "v1":
        grid = (T, triton.cdiv(H, cfg["block_h"]), cfg["split_d"])
        LAST_LAUNCH["kernel"] = _sparse_mqa_kernel[grid](
            q, q.stride(0), q.stride(1), out, out.stride(0), out.stride(1),
            sink, H, float(scale) * LOG2E, *list_args,
            BLOCK_K=cfg["block_k"], **flags, **launch_opts)
        return _rotated(out, rope)
    ns = cfg["kv_splits"]
    if ns > 1:
        part = torch.empty((T, ns, H, D_HEAD), dtype=torch.float32, device=q.device)
        lse = torch.empty((T, ns, H), dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # never read or written
    from dspark.kernels.sparse_mqa_v3 import launch_v3
    flags.pop("SPLIT_D")
    LAST_LAUNCH["kernel"] = launch_v3(q, out, part, lse, sink, float(scale) * LOG2E, a, b,
                                      has_b, cfg, flags, launch_opts)
    if ns > 1:
        bh = min(COMBINE_BLOCK_H, triton.next_power_of_2(H))
        cis, pos, dtype, r_half = out, out, out.dtype, 32          # (unread without rope)
        if rope is not None:                  # the inverse RoPE and the cast in this launch
            cis, pos, dtype = rope
            r_half, cis = cis.shape[1], torch.view_as_real(cis)
            out = torch.empty((T, H, D_HEAD), dtype=dtype, device=q.device)
        _combine_kernel[(T, triton.cdiv(H, bh))](
            part, lse, sink, out, out.stride(0), out.stride(1), H, cis, pos,
            NUM_SPLITS=ns, BLOCK_H=bh, ROPE=rope is not None, R_HALF=r_half,
            ROUND=int(dtype == torch.bfloat16), PDL=pdl.enabled(out.device), num_warps=4)
        return out
    return _rotated(out, rope)


def _rotated(out: torch.Tensor, rope) -> torch.Tensor:
    """out, or (rope = (cis, positions, dtype)) its inverse RoPE by the norm_rope kernel."""
    if rope is None:
        return out
    from dspark.kernels.norm_rope import norm_rope
    cis, pos, dtype = rope
    return norm_rope(out, cis=cis, rope_dim=2 * cis.shape[1], dtype=dtype, positions=pos)


def _fp8_cache_args(cache: torch.Tensor, N: int, indices, lengths, T, name):
    assert cache.dtype == torch.uint8 and cache.dim() == 2, f"{name}: cache must be uint8 [P, B]"
    assert cache.is_contiguous(), f"{name}: cache must be contiguous"
    page_bytes = cache.shape[1]
    assert page_bytes % 2 == 0 and page_bytes >= N * (RECORD_STRIDE + SCALE_STRIDE), \
        f"{name}: page of {page_bytes} B cannot hold {N} fp8_ds_mla records"
    indices, lengths = _check_list(indices, lengths, T, name)
    return (cache, cache.view(torch.bfloat16), page_bytes, N, indices, lengths)


def sparse_mqa_fp8(q: torch.Tensor, cache: torch.Tensor, entries_per_page: int,
                   indices: torch.Tensor, sink: torch.Tensor, scale: float, *,
                   lengths: torch.Tensor | None = None,
                   extra_cache: torch.Tensor | None = None,
                   extra_entries_per_page: int | None = None,
                   extra_indices: torch.Tensor | None = None,
                   extra_lengths: torch.Tensor | None = None,
                   block_h: int | None = None, block_k: int | None = None,
                   split_d: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   precision: str | None = None, kv_splits: int | None = None,
                   impl: str | None = None, maxnreg: int | None = None,
                   early_decode: bool | None = None, rope=None) -> torch.Tensor:
    """Sparse MQA with sink over a paged ``fp8_ds_mla`` cache (Triton).

    q:        [T, H, 512] bf16 or fp32 (other float dtypes are upcast to fp32).
    cache:    uint8 [num_pages, page_bytes], page_bytes ≥ N·584 (multiple of 576 in practice).
    entries_per_page: N.
    indices:  int32 [T, K] global entry ids (page·N + row); −1 = masked. Order is irrelevant.
    sink:     fp32 [H] raw sink logits (not multiplied by ``scale``).
    scale:    softmax scale (1/√512 for V4).
    lengths:  optional int32 [T]; only indices[t, :lengths[t]] are read (tiles past it are
              skipped, not just masked — use it when lists are padded with long −1 tails).
    extra_*:  optional second cache / index list (e.g. compressed entries next to the SWA
              window), joined into the same softmax. ``extra_cache`` defaults to ``cache``.
    impl ('v1' | 'v3'), block_h, block_k, split_d, kv_splits, num_warps, num_stages,
    maxnreg, early_decode, precision ('bf16' | 'fp16' | 'tf32' | 'ieee'; None: bf16 operands for
    bf16 q, fp16 where the DEFAULT_CONFIGS row says fp16_operands, tf32 for fp32 q):
              tuning knobs (none given: the DEFAULT_CONFIGS row for T). split_d > 1 splits the
              512 output columns over that many programs (v1; scores computed by each);
              kv_splits > 1 (v3) splits each token's keys over that many programs plus a
              combine kernel.
              v3 only: early_decode (default False): decode all four chunks of a key tile
              before its first product. See sparse_mqa_v3.py.
    rope:     optional (cis, positions, dtype): the output then comes back as
              `kernels.norm_rope.norm_rope(out, cis=cis, rope_dim=2 * cis.shape[1], dtype=dtype,
              positions=positions)` would return it (rounded to dtype, its last rope dims rotated
              by cis[positions[t]], a complex64 table [rows, r/2], conjugated for the attention
              output's inverse RoPE), in the split-KV combine launch when there is one.
    Returns float32 [T, H, 512]; rows with every key masked are 0.
    """
    q, sink = _prep_q(q, sink)
    T = q.shape[0]
    if rope is not None:
        cis, pos, _ = rope
        assert cis.dtype == torch.complex64 and cis.dim() == 2 and 2 * cis.shape[1] <= D_HEAD
        assert pos.shape == (T,) and pos.is_contiguous() and cis.is_contiguous()
    a = _fp8_cache_args(cache, entries_per_page, indices, lengths, T, "cache")
    b = None
    if extra_indices is not None:
        b = _fp8_cache_args(cache if extra_cache is None else extra_cache,
                            entries_per_page if extra_entries_per_page is None
                            else extra_entries_per_page,
                            extra_indices, extra_lengths, T, "extra_cache")
    tuning = dict(impl=impl, block_h=block_h, block_k=block_k, split_d=split_d,
                  kv_splits=kv_splits, num_warps=num_warps,
                  num_stages=num_stages, maxnreg=maxnreg, early_decode=early_decode)
    return _launch(q, sink, scale, True, a, b, tuning, precision, rope)


def _dense_args(kv: torch.Tensor, indices, lengths, T, name):
    assert kv.dim() == 2 and kv.shape[1] == D_HEAD, f"{name}: kv must be [num_entries, 512]"
    assert kv.dtype in (torch.bfloat16, torch.float32), f"{name}: kv must be bf16 or fp32"
    if kv.stride(1) != 1:
        kv = kv.contiguous()
    indices, lengths = _check_list(indices, lengths, T, name)
    return (kv, kv, kv.stride(0), 1, indices, lengths)


def sparse_mqa_dense(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor,
                     sink: torch.Tensor, scale: float, *,
                     lengths: torch.Tensor | None = None,
                     extra_kv: torch.Tensor | None = None,
                     extra_indices: torch.Tensor | None = None,
                     extra_lengths: torch.Tensor | None = None,
                     block_h: int | None = None, block_k: int | None = None,
                     split_d: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     precision: str | None = None, kv_splits: int | None = None,
                     impl: str | None = None, maxnreg: int | None = None,
                       early_decode: bool | None = None) -> torch.Tensor:
    """Sparse MQA with sink over a non-quantised cache ``kv`` [num_entries, 512] (bf16/fp32).

    Same contract as :func:`sparse_mqa_fp8` with row ids into ``kv`` as indices (−1 = masked);
    ``extra_kv`` defaults to ``kv``. Returns float32 [T, H, 512].
    """
    q, sink = _prep_q(q, sink)
    T = q.shape[0]
    a = _dense_args(kv, indices, lengths, T, "kv")
    b = None
    if extra_indices is not None:
        b = _dense_args(kv if extra_kv is None else extra_kv, extra_indices, extra_lengths, T,
                        "extra_kv")
    tuning = dict(impl=impl, block_h=block_h, block_k=block_k, split_d=split_d,
                  kv_splits=kv_splits, num_warps=num_warps,
                  num_stages=num_stages, maxnreg=maxnreg, early_decode=early_decode)
    return _launch(q, sink, scale, False, a, b, tuning, precision)


def global_indices_from_page_table(local: torch.Tensor, req_index: torch.Tensor,
                                   page_table: torch.Tensor, entries_per_page: int) -> torch.Tensor:
    """Map request-local entry numbers to global entry ids for the sparse-MQA kernels.

    local:      int [T, K] entry numbers j within each token's request (−1 = masked).
    req_index:  int [T] row of ``page_table`` for each token.
    page_table: int32 [R, max_pages] physical page of the request's logical page.
    Returns int32 [T, K]: page_table[req, j // N] · N + j % N, −1 kept.
    """
    N = entries_per_page
    j = local.long()
    valid = j >= 0
    j = torch.where(valid, j, 0)
    pages = page_table.long()[req_index.long()[:, None], j // N]
    glob = pages * N + j % N
    return torch.where(valid, glob, -1).to(torch.int32)


__all__ = [
    "sparse_mqa_fp8", "sparse_mqa_dense",
    "global_indices_from_page_table",
]
