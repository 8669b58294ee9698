"""The fixed-shape forward of a DeepSeek-V4 decode / verify step over a `PagedKVCache`: every shape
a function of the bucket (B requests x q tokens, P pages per request) alone, so that
dspark/models/deepseek_v4/graph.py can replay it as a CUDA graph.

`StaticInputs` are views of the runner's one static int64 buffer; `StaticPlan` is the step's
attention plan read from views of that buffer (`plan_from_views`: the host computed it,
`host_plan.py`) or derived from the inputs with device ops (`derive_plan`, the reference).
`static_forward` runs the model's own modules (projections, compressor rows, norms, RoPE, MoE,
mHC) with fixed-shape attention (`static_attention`): `StepKernels("triton")` calls the Triton
kernels the Triton backend uses (sparse MQA over fp8 records or plain rows, indexer top-k, fused
quantize-and-write), `StepKernels("torch")` their pure-torch twins. On CPU the same path runs
eagerly and is checked against the eager paged forward in tests/test_v4_graph.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from dspark.cuda import side_stream
from dspark.kvcache.paged import copy_rows

from .compressor import gated_pool
from .indexer import topk_lowest_ties
from .norm import fp32
from .rope import Rope


@dataclass
class StaticInputs:
    """Views of the static int buffer for one bucket (B requests × q tokens, P pages)."""
    B: int
    q: int
    P: int
    token_ids: torch.Tensor     # [B*q] int64
    positions: torch.Tensor     # [B*q] int64
    req_start: torch.Tensor     # [B] first new position of each request (0 for padding)
    req_slot: torch.Tensor      # [B] state slot (the scratch slot for padding)
    req_valid: torch.Tensor     # [B] 1 = real request, 0 = padding
    page_table: torch.Tensor    # [B, P] int64 (unused entries: the scratch page)


@dataclass
class RatioStatic:
    ratio: int
    per_page: int
    n_visible: torch.Tensor         # [T] int64 (0 for padding rows)
    n_visible_i32: torch.Tensor
    emit_valid: torch.Tensor        # [E] bool: the candidate entry completes in this forward
    emit_dst: torch.Tensor          # [E] global entry id (scratch row when not valid)
    emit_pos: torch.Tensor          # [E] RoPE position j*m of the entry (0 when not valid)
    from_ring: torch.Tensor         # [E, c*m] bool: pooling row comes from the compressor ring
    ring_rows: torch.Tensor         # [E, c*m] ring row to read (when from_ring)
    fresh_rows: torch.Tensor        # [E, c*m] flat token row of this forward (otherwise)
    before_zero: torch.Tensor       # [E, c*m] bool: position < 0 (entry 0's empty A-half)
    persist_dst: torch.Tensor       # [T] ring row each token's compressor rows go to
    all_visible_ids: torch.Tensor | None = None      # HCA [T, P*N] global ids, -1 pad (None
    #                                                  in the host plan: the int32 copy is read)
    all_visible_ids_i32: torch.Tensor | None = None


@dataclass
class StaticPlan:
    B: int
    q: int
    P: int
    positions: torch.Tensor
    req_index: torch.Tensor         # [T] int64 = t // q
    req_index_i32: torch.Tensor
    page_table: torch.Tensor        # [B, P] int64
    page_table_i32: torch.Tensor
    window_ids: torch.Tensor | None  # [T, W] int64 ids into the SWA pool, -1 = none (None:
    #                                  host plan, which uploads only the int32 copy the kernels read)
    window_ids_i32: torch.Tensor
    stage_ids: torch.Tensor         # [T]
    ring_src: torch.Tensor          # [T] staged rows -> ring rows (padding: scratch slot)
    ring_dst: torch.Tensor
    ring_split: torch.Tensor        # [4, T] (copy_rows' split)
    ratios: dict
    position_bound: int             # RoPE table bound (host int, fixed per graph object)
    rope_memo: dict = field(default_factory=dict)


def derive_plan(cache, inp: StaticInputs, bound: int, scratch_slot: int,
                scratch_page: int) -> StaticPlan:
    """Every per-forward list the layers need, from the static inputs, with fixed shapes and
    device ops only (no host sync, no data-dependent shapes)."""
    B, q, P = inp.B, inp.q, inp.P
    T, dev = B * q, inp.positions.device
    pos, pt = inp.positions, inp.page_table
    tok = torch.arange(T, device=dev)
    req = tok // q
    valid_r = inp.req_valid != 0
    valid_t, s_t, slot_t = valid_r[req], inp.req_start[req], inp.req_slot[req]
    W, C = cache.window, cache.capacity
    qw = pos[:, None] - (W - 1) + torch.arange(W, device=dev)
    win = torch.where(qw >= s_t[:, None], cache.stage_base + tok[:, None] + qw - pos[:, None],
                      slot_t[:, None] * C + qw % C)
    window_ids = torch.where((qw >= 0) & valid_t[:, None], win, -1)
    stage = cache.stage_base + tok
    ring_dst = slot_t * C + pos % C
    plan = StaticPlan(
        B, q, P, pos, req, req.int(), pt, pt.int(), window_ids, window_ids.int(), stage,
        stage, ring_dst, torch.stack([stage // C, stage % C, ring_dst // C, ring_dst % C]),
        {}, bound)
    for m in sorted({m for m in cache.ratios if m}):
        N, R = cache.entries_per_page(m), cache.comp_ring(m)
        c = 2 if m == 4 else 1
        K = -(-q // m)                        # at most ceil(q/m) entries complete per request
        e = torch.arange(B * K, device=dev)   # candidate e: request e // K, entry k = e % K
        i = e // K
        j = inp.req_start[i] // m + e % K
        ok = (j < (inp.req_start[i] + q) // m) & valid_r[i]
        page = pt[i, (j // N).clamp(max=P - 1)]
        dst = torch.where(ok, page * N + j % N, scratch_page * N)
        p = (j - (c - 1))[:, None] * m + torch.arange(c * m, device=dev)     # [E, c*m]
        s_i = inp.req_start[i][:, None]
        n_vis = torch.where(valid_t, (pos + 1) // m, 0)
        rp = RatioStatic(
            m, N, n_vis, n_vis.int(), ok, dst, torch.where(ok, j, 0) * m, p < s_i,
            inp.req_slot[i][:, None] * R + p % R, (i[:, None] * q + p - s_i).clamp(0, T - 1),
            p < 0, slot_t * R + pos % R)
        if m != 4:
            local = torch.arange(P * N, device=dev)
            ids = pt[req[:, None], local // N] * N + local % N
            rp.all_visible_ids = torch.where(local < n_vis[:, None], ids, -1)
            rp.all_visible_ids_i32 = rp.all_visible_ids.int()
        plan.ratios[m] = rp
    return plan


def plan_from_views(cache, v: dict, inp: StaticInputs, bound: int) -> StaticPlan:
    """The StaticPlan over the uploaded host plan (`host_plan.views`): views only, no op."""
    plan = StaticPlan(
        inp.B, inp.q, inp.P, inp.positions, v["req_index"], v["req_index_i32"], inp.page_table,
        v["page_table_i32"], None, v["window_ids_i32"], v["stage_ids"], v["stage_ids"],
        v["ring_dst"], v["ring_split"], {}, bound)
    for m in sorted({m for m in cache.ratios if m}):
        f = {k.split(".", 1)[1]: t for k, t in v.items() if k.startswith(f"{m}.")}
        plan.ratios[m] = RatioStatic(
            m, cache.entries_per_page(m), f["n_visible"], f["n_visible_i32"], f["emit_valid"],
            f["emit_dst"], f["emit_pos"], f["from_ring"], f["ring_rows"], f["fresh_rows"],
            f["before_zero"], f["persist_dst"], None, f.get("all_visible_ids_i32"))
    return plan


# ---- the fixed-shape layer ---------------------------------------------------------------------

class StepKernels:
    """The storage / selection / attention calls of the fixed-shape forward: the Triton kernels
    of dspark/attention/triton.py ('triton') or their pure-torch twins ('torch')."""

    def __init__(self, cache, kind: str):
        if kind not in ("triton", "torch"):
            raise ValueError(f"kernels={kind!r}: use 'triton' or 'torch'")
        self.cache, self.kind = cache, kind

    def store(self, pool, per_page, ids, x):
        if pool.dtype != torch.uint8:
            pool.index_copy_(0, ids, x.to(pool.dtype))
            return
        from dspark.formats import layouts as L
        if self.kind == "triton":
            from dspark.kernels.cache_write import write_fp8_ds_mla_triton, write_indexer_fp8_triton
            (write_fp8_ds_mla_triton if x.shape[1] == L.HEAD_DIM else write_indexer_fp8_triton)(
                pool, per_page, ids, x)
        elif x.shape[1] == L.HEAD_DIM:
            L.write_fp8_ds_mla(pool, per_page, ids, x)
        else:
            L.write_indexer_fp8(pool, per_page, ids, x)

    def copy_rows(self, pool, per_page, sp: StaticPlan):
        """The staged window rows into the rings (after attention read them)."""
        if self.kind == "triton" and pool.dtype == torch.uint8:
            from dspark.kernels.decode_fused import copy_records
            copy_records(pool, per_page, sp.ring_split)      # one launch instead of four
        else:
            copy_rows(pool, per_page, sp.ring_src, sp.ring_dst, sp.ring_split)

    def select(self, sp: StaticPlan, layer: int, qi, wi, topk: int):
        """(int32 [T, topk] global entry ids of the top-k visible scores, int32 [T] their
        counts): stable descending score order, -1 padded at each row's tail."""
        rp, pool = sp.ratios[4], self.cache.index_keys[layer]
        N, n_cols = rp.per_page, sp.P * rp.per_page
        if self.kind == "triton" and pool.dtype == torch.uint8:
            from dspark.kernels.indexer import indexer_select
            return indexer_select(qi, wi, pool, N, sp.req_index_i32, sp.page_table_i32,
                                  rp.n_visible_i32, topk, n_cols=n_cols, global_ids=True)
        from dspark.attention.reference import load_rows
        local = torch.arange(n_cols, device=qi.device)
        ids = sp.page_table[:, local // N] * N + local % N                     # [B, n_cols]
        keys = load_rows(pool, N, ids)                                          # [B, n_cols, 128]
        qb = qi.view(sp.B, sp.q, *qi.shape[1:]).float()
        scores = (torch.einsum("bqhd,bjd->bqhj", qb, keys.float()).relu()
                  * wi.view(sp.B, sp.q, -1)[..., None]).sum(2).view(sp.B * sp.q, n_cols)
        scores = scores.masked_fill(local[None, :] >= rp.n_visible[:, None], float("-inf"))
        out = torch.full((scores.shape[0], topk), -1, dtype=torch.long, device=qi.device)
        k = min(topk, n_cols)
        vals, idx = topk_lowest_ties(scores, k)
        out[:, :k] = torch.where(vals == float("-inf"), -1, idx)
        from dspark.kernels.sparse_mqa import global_indices_from_page_table
        return (global_indices_from_page_table(out, sp.req_index, sp.page_table, N),
                (out >= 0).sum(1, dtype=torch.int32))

    def attend(self, q, window_pool, capacity, window_ids, entry_pool, per_page, entry_ids,
               entry_lens, sink, scale, rope=None):
        """The attention core's output [T, H, 512]: fp32, or with rope = (cis, positions, dtype)
        (Triton kernels and fp8 pages only: `fuses_rope`) already inversely rotated and cast
        the way Attention.output's norm_rope would."""
        from dspark.kernels import sparse_mqa as K
        fp8 = window_pool.dtype == torch.uint8
        extra = {}
        if entry_ids is not None:
            extra = dict(extra_indices=entry_ids, extra_lengths=entry_lens)
            extra.update(dict(extra_cache=entry_pool, extra_entries_per_page=per_page) if fp8
                         else dict(extra_kv=entry_pool))
        if self.kind == "triton":
            fn = K.sparse_mqa_fp8 if fp8 else K.sparse_mqa_dense
        else:
            from dspark.kernels import sparse_mqa_torch as R
            fn = R.sparse_mqa_fp8_torch if fp8 else R.sparse_mqa_dense_torch
        if fp8:
            if rope is not None:
                extra["rope"] = rope
            return fn(q, window_pool, capacity, window_ids, sink, scale, **extra)
        return fn(q, window_pool, window_ids, sink, scale, **extra)

    def fuses_rope(self, window_pool, rope) -> bool:
        """Whether `attend` takes the attention output's inverse RoPE (the split-KV combine does
        it in its launch, else Attention.output's own norm_rope launch follows)."""
        return (self.kind == "triton" and window_pool.dtype == torch.uint8
                and isinstance(rope, Rope))


def static_attention(attn, x, kern: StepKernels, sp: StaticPlan, layer: int, quant):
    """Fixed-shape twin of dspark.attention.layer.paged_attention (same math, same order)."""
    cache = kern.cache
    pos, bound, memo = sp.positions, sp.position_bound, sp.rope_memo
    # On CUDA the branches that do not feed the queries run on side streams (side_stream.py),
    # next to the query / key projections: in CSA layers the indexer's head weights, then (all
    # layers with a compressor) the compressor's entries (lane 1); the indexer compressor's keys
    # (lane 4); from cq on the index queries, then, once the head weights and this step's keys
    # are there, their scores and top-k (lane 2); the window key's norm / RoPE / cache store
    # (lane 3, from the fused wq_a + wkv rows on). All joined before attention; after it the
    # staged window rows' copy into the ring (lane 3 again) runs next to the output
    # projection. The RoPE table all of them read is grown here first.
    dev = x.device
    attn.rope.table(bound, dev)
    csa = attn.ratio == 4
    # the side lanes fork here (they need x only) but their kernels are queued after the
    # critical path's first GEMM: a CUDA graph launches ready branches in capture order
    entries = side_stream.fork(dev, 1) if attn.ratio else None
    keys = side_stream.fork(dev, 4) if csa else None
    xq, xkv = attn.fused_rows(x)
    weights_ready = keys_ready = None
    with side_stream.on(entries):
        if csa:
            wi = attn.indexer.head_weights(x)
            weights_ready = side_stream.record(entries)
        if attn.ratio:
            _emit(attn, attn.compressor, kern, sp, layer, "main", x, quant)
    with side_stream.on(keys):
        if csa:
            _emit(attn, attn.indexer.compressor, kern, sp, layer, "indexer", x, quant)
            keys_ready = side_stream.record(keys)
    window = side_stream.fork(dev, 3) if xkv is not None else None
    with side_stream.on(window):
        if xkv is not None:
            kv = attn.project_kv(x, pos, quant, bound, memo, xkv)
            kern.store(cache.swa[layer], cache.capacity, sp.stage_ids, kv)
    cq = attn.query_latent(x, xq)
    selected = index = None
    if csa:
        index = side_stream.fork(dev, 2)                    # after cq
        with side_stream.on(index):
            qi = attn.indexer.index_queries(cq, pos, attn.rope, quant, bound, memo)
            side_stream.wait(index, weights_ready)
            side_stream.wait(index, keys_ready)
            selected = kern.select(sp, layer, qi, wi, attn.indexer.topk)
    q = attn.queries_from_latent(cq, pos, x.dtype, bound, memo)
    if xkv is None:
        kv = attn.project_kv(x, pos, quant, bound, memo, xkv)
        kern.store(cache.swa[layer], cache.capacity, sp.stage_ids, kv)
    side_stream.join(entries)
    side_stream.join(keys)
    side_stream.join(index)
    side_stream.join(window)
    entry_pool, N, ids, lens = None, 0, None, None
    if attn.ratio:
        rp = sp.ratios[attn.ratio]
        entry_pool, N = cache.entries[layer], rp.per_page
        if selected is None:
            ids, lens = rp.all_visible_ids_i32, rp.n_visible_i32
        else:
            ids, lens = selected
    rope = None
    if kern.fuses_rope(cache.swa[layer], attn.rope):
        rope = (attn.rope.table(bound, dev, inverse=True), pos, x.dtype)
    o = kern.attend(q, cache.swa[layer], cache.capacity, sp.window_ids_i32, entry_pool, N, ids,
                    lens, attn.attn_sink, attn.head_dim ** -0.5, rope)
    ring = side_stream.fork(dev, 3)
    with side_stream.on(ring):
        kern.copy_rows(cache.swa[layer], cache.capacity, sp)
    out = attn.output(o, pos, x.dtype, bound, memo, rotated=rope is not None)
    side_stream.join(ring)
    return out


def _emit(attn, comp, kern, sp, layer, kind, x, quant):
    """Compressor rows of every token; pool the fixed set of candidate entries (rows read from
    the ring before this forward's rows are persisted) and store them (non-completing ones to
    the scratch row)."""
    cache = kern.cache
    rp = sp.ratios[attn.ratio]
    ring_a, ring_z = cache.comp_rows[layer, kind]
    m, d = comp.ratio, comp.out_dim
    if kern.kind == "triton":
        # the rows' ape term, gathers, masks, overlap halves, gated pool and the ring writes:
        # one launch (it reads no ring row it rewrites: see the module doc)
        from dspark.kernels.decode_fused import gather_pool
        a, z = comp.rows_raw(x)
        pooled = gather_pool(ring_a, ring_z, a, z, rp.from_ring, rp.ring_rows, rp.fresh_rows,
                             rp.before_zero, rp.emit_valid, m, d, ape=fp32(comp.ape),
                             positions=sp.positions, persist_dst=rp.persist_dst)
    else:
        a, z = comp.rows(x, sp.positions)
        pooled = _gather_pool_torch(comp, ring_a, ring_z, a, z, rp)
        ring_a.index_copy_(0, rp.persist_dst, a)    # after the ring rows were read
        ring_z.index_copy_(0, rp.persist_dst, z)
    e = attn.finish_entries_at(pooled, rp.emit_pos, sp.position_bound, comp, x.dtype, quant,
                               indexer=kind == "indexer")
    pool = cache.entries[layer] if kind == "main" else cache.index_keys[layer]
    kern.store(pool, rp.per_page, rp.emit_dst, e)


def _gather_pool_torch(comp, ring_a, ring_z, a, z, rp):
    """The torch definition of `decode_fused.gather_pool` (see there)."""
    sel = rp.from_ring[..., None]
    A = torch.where(sel, ring_a[rp.ring_rows], a[rp.fresh_rows])          # [E, c*m, c*d]
    Z = torch.where(sel, ring_z[rp.ring_rows], z[rp.fresh_rows])
    A = A.masked_fill(rp.before_zero[..., None], 0.0)
    Z = Z.masked_fill(rp.before_zero[..., None], float("-inf"))
    Z = Z.masked_fill(~rp.emit_valid[:, None, None], 0.0)    # keep unused candidates finite
    m, d = comp.ratio, comp.out_dim
    if comp.overlap:       # A-halves of the previous window, B-halves of the entry's own
        A = torch.cat([A[:, :m, :d], A[:, m:, d:]], dim=1)
        Z = torch.cat([Z[:, :m, :d], Z[:, m:, d:]], dim=1)
    return gated_pool(A, Z)


def static_forward(model, kern: StepKernels, sp: StaticPlan, token_ids, tap_layers=()):
    """(final streams X [T, n, D], taps) of the fixed-shape forward."""
    from dspark.attention.layer import RecordQuant
    quant = RecordQuant() if kern.cache.fp8 else None

    def attn_fn(attn, x, batch, layer_id, _model_quant=None):
        return static_attention(attn, x, kern, sp, layer_id, quant)
    batch = SimpleNamespace(token_ids=token_ids, positions=sp.positions)
    return model.forward_hidden(batch, attn_fn=attn_fn, tap_layers=tap_layers)
