"""Lightning-indexer scoring and top-k over the paged FP8 indexer-key cache (spec §3.6, §6.2).

    score(t, j) = Σ_h w[t, h] · ReLU(q[t, h] · K_j)      for j < valid_counts[t], else excluded

and the result is the set of the ``topk`` best-scoring entries j (request-local entry numbers),
padded with −1 when fewer than ``topk`` entries are visible. Order inside a row is unspecified and
so is the choice among tied scores (ReLU makes exact ties common — compare score multisets).

Key addressing (ragged batches): entry j of token t is row j % N of physical page
``page_table[req_index[t], j // N]`` of the indexer cache (132-B rows: N·128 e4m3 bytes, then N
fp32 scales, §6.2). Tokens of the same request share a ``page_table`` row, so a batch mixing
decode tokens of many requests and prefill chunks needs no per-token key lists. The selected j
are request-local; :func:`dspark.kernels.sparse_mqa.global_indices_from_page_table` turns them
into global ids for the attention kernel (with the main compressed cache's page table).

Implementation: a Triton kernel writes fp32 scores [T, n_cols] (−inf where not visible), then
one sorting program per token picks the top-k (select_topk_ids; the torch stable sort past
SORT_MAX_COLS columns), optionally mapping them to global ids on the way. Scores: one program
= one token × BLOCK_J entries: the q block [H_I, 128] is the MMA's
M×K operand (H_I = 64 → one wgmma tile), keys [BLOCK_J, 128] FP8 are de-quantised exactly to
bf16 and the per-row scale is applied to the logits afterwards (it is a power of two).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.formats.layouts import dequantize_indexer_fp8
from dspark.kernels.common import interpreting, mma, pick_precision
from dspark.kernels.sparse_mqa import global_indices_from_page_table

D_INDEX = 128


@triton.jit
def _indexer_score_kernel(
    q_ptr, stride_qt, stride_qh, w_ptr, stride_wt,
    cache_u8_ptr, cache_f32_ptr, page_bytes, N,
    req_ptr, pt_ptr, stride_pt, valid_ptr,
    out_ptr, stride_ot, n_cols, HI,
    BLOCK_HI: tl.constexpr, BLOCK_J: tl.constexpr, PRECISION: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j0 = tl.program_id(1) * BLOCK_J
    j = j0 + tl.arange(0, BLOCK_J)
    in_cols = j < n_cols
    n_valid = tl.load(valid_ptr + t)
    out_row = out_ptr + t * stride_ot
    if j0 < n_valid:
        visible = j < n_valid
        req = tl.load(req_ptr + t).to(tl.int64)
        page = tl.load(pt_ptr + req * stride_pt + j // N, mask=visible, other=0).to(tl.int64)
        row = j % N
        base = page * page_bytes
        d = tl.arange(0, 128)
        kb = tl.load(cache_u8_ptr + base[:, None] + row[:, None] * 128 + d[None, :],
                     mask=visible[:, None], other=0)
        k = kb.to(tl.float8e4nv, bitcast=True).to(tl.float32)                 # [BLOCK_J, 128]
        kscale = tl.load(cache_f32_ptr + (base + N * 128 + row * 4) // 4, mask=visible,
                         other=0.0)
        h = tl.arange(0, BLOCK_HI)
        h_ok = h < HI
        q = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
                    mask=h_ok[:, None], other=0.0)
        w = tl.load(w_ptr + t * stride_wt + h, mask=h_ok, other=0.0).to(tl.float32)
        logits = mma(q, tl.trans(k), PRECISION) * kscale[None, :]            # [BLOCK_HI, BLOCK_J]
        score = tl.sum(tl.maximum(logits, 0.0) * w[:, None], axis=0)
        score = tl.where(visible, score, float("-inf"))
        tl.store(out_row + j, score, mask=in_cols)
    else:
        # whole block past the visible prefix: no loads, no math
        tl.store(out_row + j, tl.full((BLOCK_J,), float("-inf"), tl.float32), mask=in_cols)


def _check_inputs(q, weights, cache, entries_per_page, req_index, page_table, valid_counts):
    assert q.dim() == 3 and q.shape[2] == D_INDEX, "q must be [T, H_I, 128]"
    T, HI, _ = q.shape
    assert weights.shape == (T, HI), "weights must be [T, H_I]"
    assert cache.dtype == torch.uint8 and cache.dim() == 2 and cache.is_contiguous(), \
        "cache must be a contiguous uint8 [num_pages, page_bytes] tensor"
    assert cache.shape[1] >= entries_per_page * 132 and cache.shape[1] % 4 == 0, \
        "indexer page too small or not 4-byte aligned"
    assert req_index.shape == (T,) and valid_counts.shape == (T,), \
        "req_index and valid_counts must be [T]"
    assert page_table.dim() == 2, "page_table must be [R, max_pages]"


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                   entries_per_page: int, req_index: torch.Tensor, page_table: torch.Tensor,
                   valid_counts: torch.Tensor, n_cols: int | None = None, *,
                   block_j: int = 64, num_warps: int = 4, num_stages: int = 1,
                   precision: str | None = None) -> torch.Tensor:
    """Triton scoring: fp32 [T, n_cols] with −inf for j ≥ valid_counts[t].

    n_cols defaults to page_table.shape[1] · N (every entry a request can address); pass a
    smaller bound (e.g. the batch's max visible count) to save work. Arguments as in
    :func:`indexer_topk`.
    """
    _check_inputs(q, weights, cache, entries_per_page, req_index, page_table, valid_counts)
    T, HI, _ = q.shape
    if n_cols is None:
        n_cols = page_table.shape[1] * entries_per_page
    out = torch.empty((T, n_cols), dtype=torch.float32, device=q.device)
    if T == 0 or n_cols == 0:
        return out
    if q.dtype not in (torch.bfloat16, torch.float32):
        q = q.float()
    if q.stride(2) != 1:
        q = q.contiguous()
    weights = weights.float().contiguous()
    grid = (T, triton.cdiv(n_cols, block_j))
    _indexer_score_kernel[grid](
        q, q.stride(0), q.stride(1), weights, weights.stride(0),
        cache, cache.view(torch.float32), cache.shape[1], entries_per_page,
        req_index.to(torch.int32).contiguous(), page_table.to(torch.int32).contiguous(),
        page_table.shape[1], valid_counts.to(torch.int32).contiguous(),
        out, out.stride(0), n_cols, HI,
        BLOCK_HI=max(16, triton.next_power_of_2(HI)), BLOCK_J=block_j,
        PRECISION=pick_precision(q.dtype, precision),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out


# scores rows up to this many columns are selected by one sorting program each (the top-k kernel
# below); longer rows (contexts past 4 x SORT_MAX_COLS tokens) take the torch sort
SORT_MAX_COLS = 8192
_NEG_INF_KEY = tl.constexpr(-2139095041)   # _score_key(-inf): 0xff800000 ^ 0x7fffffff (int32)


@triton.jit
def _score_key(s):
    """Order-preserving int32 of fp32 scores: a > b (as floats) iff key(a) > key(b); -0.0 is
    folded into +0.0 first (the torch sort holds them equal)."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _topk_ids_kernel(
    s_ptr, stride_st, n_cols, req_ptr, pt_ptr, stride_pt, N, out_ptr, stride_ot, len_ptr, K,
    BLOCK: tl.constexpr, FILL: tl.constexpr, GLOBAL: tl.constexpr,
):
    """One token's row: the K best scores' entries in the order of a stable descending sort
    (ties: lower column first), -1 for -inf / missing picks (always the row's tail), their
    count in len_ptr[t]. The column rides in the low 32 bits of one int64 sort key under the
    score's order-preserving high half, so one bitonic sort orders scores and breaks ties.
    GLOBAL: entry j written as its global id page_table[req_index[t], j // N] * N + j % N."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    s = tl.load(s_ptr + t * stride_st + c, mask=c < n_cols, other=float("-inf"))
    low = 4294967295 - c.to(tl.int64)                        # larger for lower columns
    comb = tl.sort((_score_key(s).to(tl.int64) << 32) | low, descending=True)
    col = (4294967295 - (comb & 4294967295)).to(tl.int32)
    rank = tl.arange(0, BLOCK)
    take = ((comb >> 32).to(tl.int32) > _NEG_INF_KEY) & (rank < K)
    ids = col
    if GLOBAL:
        req = tl.load(req_ptr + t).to(tl.int64)
        page = tl.load(pt_ptr + req * stride_pt + col // N, mask=take, other=0)
        ids = page * N + col % N
    tl.store(out_ptr + t * stride_ot + rank, tl.where(take, ids, -1), mask=rank < K)
    for k0 in range(BLOCK, K, FILL):                         # topk past the row: all -1
        f = k0 + tl.arange(0, FILL)
        tl.store(out_ptr + t * stride_ot + f, tl.full((FILL,), -1, tl.int32), mask=f < K)
    tl.store(len_ptr + t, tl.sum(take.to(tl.int32), axis=0))


def select_topk_ids(scores: torch.Tensor, topk: int, page_table: torch.Tensor | None = None,
                    req_index: torch.Tensor | None = None, entries_per_page: int = 0):
    """(ids int32 [T, topk], counts int32 [T]) of fp32 scores [T, n]: the columns of
    `_select_topk` in the same order (stable descending sort: equal scores lowest column
    first), -1 for -inf picks and padding (a tail: `counts` entries lead each row). With
    page_table / req_index / entries_per_page (N) the columns j come back as global entry ids
    page_table[req_index[t], j // N] * N + j % N (what the attention kernels read).
    One Triton launch (one program per row) for rows of at most SORT_MAX_COLS columns on CUDA
    / the interpreter; torch ops otherwise."""
    T, n = scores.shape
    to_global = page_table is not None
    if _launchable(scores) and 0 < n <= SORT_MAX_COLS and T > 0:
        ids = torch.empty((T, topk), dtype=torch.int32, device=scores.device)
        counts = torch.empty(T, dtype=torch.int32, device=scores.device)
        block = max(16, triton.next_power_of_2(n))
        pt = page_table if to_global else counts
        _topk_ids_kernel[(T,)](
            scores, scores.stride(0), n, req_index if to_global else counts, pt,
            pt.stride(0) if to_global else 0, max(1, entries_per_page), ids, ids.stride(0),
            counts, topk, BLOCK=block, FILL=256, GLOBAL=to_global,
            num_warps=4 if block < 2048 else (8 if block < 8192 else 16))   # <= ~128 regs
        return ids, counts
    ids = _select_topk(scores, topk)
    counts = (ids >= 0).sum(1, dtype=torch.int32)
    if to_global:
        ids = global_indices_from_page_table(ids, req_index, page_table, entries_per_page)
    return ids, counts


def _launchable(t: torch.Tensor) -> bool:
    return t.is_cuda or interpreting()


def _select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k column ids of fp32 scores [T, n]; −inf picks and padding become −1 (int32)."""
    T, n = scores.shape
    out = torch.full((T, topk), -1, dtype=torch.int32, device=scores.device)
    k = min(topk, n)
    if k > 0:
        # ties: lowest entry id, whatever the row length (the model's topk_lowest_ties rule)
        vals, idx = torch.sort(scores, dim=-1, descending=True, stable=True)
        vals, idx = vals[:, :k], idx[:, :k]
        out[:, :k] = torch.where(vals == float("-inf"), -1, idx).to(torch.int32)
    return out


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor,
                 entries_per_page: int, req_index: torch.Tensor, page_table: torch.Tensor,
                 valid_counts: torch.Tensor, topk: int, n_cols: int | None = None,
                 **tuning) -> torch.Tensor:
    """Lightning-indexer top-k (Triton scores + torch.topk).

    q:            [T, H_I, 128] bf16 or fp32 (already RoPE'd / fake-quantised as the model does).
    weights:      [T, H_I] float (the weights_proj output incl. its d_I^-½·H_I^-½ factor).
    cache:        uint8 [num_pages, page_bytes] indexer pages (N·128 e4m3, then N fp32 scales).
    entries_per_page: N.
    req_index:    int [T] request row of each token in ``page_table``.
    page_table:   int32 [R, max_pages] physical page of each logical page of each request.
    valid_counts: int32 [T]; entry j is visible to token t iff j < valid_counts[t]
                  (≤ max_pages·N; page-table slots past a request's pages are never read).
    topk:         number of entries to select.
    n_cols:       optional bound on the scored entries (default page_table.shape[1]·N; must be
                  ≥ max(valid_counts) — entries at or past it are never selected).
    Returns int32 [T, topk] request-local entry ids, −1 padded (see indexer_select for the
    order and the global-id form).
    """
    return indexer_select(q, weights, cache, entries_per_page, req_index, page_table,
                          valid_counts, topk, n_cols, **tuning)[0]


def indexer_select(q, weights, cache, entries_per_page, req_index, page_table, valid_counts,
                   topk: int, n_cols: int | None = None, global_ids: bool = False, **tuning):
    """(ids int32 [T, topk], counts int32 [T]): :func:`indexer_topk`'s picks in the order of a
    stable descending sort of the scores, the -1 padding as each row's tail after its
    `counts` picks (an attention kernel given them as lengths skips the tail's tiles);
    global_ids: as global entry ids of the same cache's pages (page_table[req, j // N] * N +
    j % N) instead of request-local j. Two launches on CUDA (scores, then select_topk_ids)."""
    scores = indexer_scores(q, weights, cache, entries_per_page, req_index, page_table,
                            valid_counts, n_cols, **tuning)
    if not global_ids:
        return select_topk_ids(scores, topk)
    return select_topk_ids(scores, topk, page_table, req_index, entries_per_page)


def indexer_scores_torch(q, weights, cache, entries_per_page, req_index, page_table,
                         valid_counts, n_cols=None) -> torch.Tensor:
    """Pure-torch scores with the same contract as :func:`indexer_scores` (fp32 [T, n_cols]).

    Works on chunks of tokens so the gathered keys stay around 2^26 floats."""
    _check_inputs(q, weights, cache, entries_per_page, req_index, page_table, valid_counts)
    N = entries_per_page
    T = q.shape[0]
    if n_cols is None:
        n_cols = page_table.shape[1] * N
    out = torch.empty((T, n_cols), dtype=torch.float32, device=q.device)
    j = torch.arange(n_cols, device=q.device)
    lp = torch.clamp(j // N, max=page_table.shape[1] - 1)          # logical page of entry j
    d = torch.arange(D_INDEX, device=q.device)
    flat = cache.reshape(-1)
    chunk = max(1, (1 << 26) // max(1, n_cols * D_INDEX))
    for t0 in range(0, T, chunk):
        sl = slice(t0, min(T, t0 + chunk))
        visible = j[None, :] < valid_counts[sl].long()[:, None]                 # [t, n_cols]
        pages = page_table.long()[req_index[sl].long()[:, None], lp[None, :]]
        base = torch.where(visible, pages, 0) * cache.shape[1]
        rows = (j % N)[None, :]
        vals = flat[(base + rows * D_INDEX).unsqueeze(-1) + d]
        scl = flat[(base + N * D_INDEX + rows * 4).unsqueeze(-1) + d[:4]]
        keys = dequantize_indexer_fp8(vals.reshape(-1, D_INDEX), scl.reshape(-1, 4))
        keys = keys.view(vals.shape[0], n_cols, D_INDEX)
        logits = torch.einsum("thd,tjd->thj", q[sl].float(), keys)
        score = (torch.relu(logits) * weights[sl].float()[:, :, None]).sum(dim=1)
        out[sl] = score.masked_fill(~visible, float("-inf"))
    return out


def indexer_topk_torch(q, weights, cache, entries_per_page, req_index, page_table,
                       valid_counts, topk, n_cols=None, **_tuning) -> torch.Tensor:
    """Pure-torch reference of :func:`indexer_topk` (same arguments and result contract)."""
    scores = indexer_scores_torch(q, weights, cache, entries_per_page, req_index, page_table,
                                  valid_counts, n_cols)
    return _select_topk(scores, topk)


__all__ = ["indexer_topk", "indexer_select", "indexer_scores", "select_topk_ids",
           "indexer_topk_torch", "indexer_scores_torch"]
