"""The fixed-shape V4 step's plan computed on the host (numpy), packed into the static int buffer
and uploaded with the step's inputs in the same single host->device copy.

`derive_plan` (static_forward.py) builds the same lists from the static inputs with ~100 tiny device
integer ops; inside a CUDA graph each one is a kernel launch per step (~2-3 us each), although
every value is a function of integers the engine knows on the host before the step (positions,
request starts, slots, page tables). `host_plan` is its numpy twin (same formulas, same order,
same dtypes: tests/test_v4_host_plan.py compares every field on random schedules); the graph then
only takes views of the uploaded buffer. The plan is on the step's host critical path (a DSpark
round's host work shows 1:1 in its time), so steps take one of two fast paths with the same
fields, values and dtypes in fewer numpy ops: `_block_plan` (one request's q-token block:
batch-1 decode and verify) and `_batch_plan` (several requests); `fast=False` keeps the general
formulas, the fast paths' reference in the tests.

Layout: per bucket (B, q, P) a fixed list of fields (`plan_fields`), each a run of int64 words of
the buffer, viewed as int64, int32 (two per word) or bool (eight per word), so int32 and bool
fields need no in-graph cast. The shapes depend on the bucket only, so a captured graph reads
the same addresses every replay; buckets share one region (one step at a time).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_DTYPES = {"i8": (np.int64, torch.int64), "i4": (np.int32, torch.int32),
           "b1": (np.bool_, torch.bool)}


def _ratios(cache):
    return sorted({m for m in cache.ratios if m})


def _shapes(cache, m, B, q, P):
    """(E = candidate entries, c*m = pooling rows per entry, N = entries per page) of ratio m."""
    c, K = (2 if m == 4 else 1), -(-q // m)     # at most ceil(q/m) entries complete per request
    return B * K, c * m, cache.entries_per_page(m)


def plan_fields(cache, B: int, q: int, P: int) -> list:
    """[(name, shape, dtype)] of what the fixed-shape forward reads, in buffer order. Not
    uploaded: the int64 twins of window_ids / all_visible_ids (the forward reads the int32
    ones; the HCA list is the largest field)."""
    T, W = B * q, cache.window
    out = [("req_index", (T,), "i8"), ("req_index_i32", (T,), "i4"),
           ("page_table_i32", (B, P), "i4"), ("window_ids_i32", (T, W), "i4"),
           ("stage_ids", (T,), "i8"), ("ring_dst", (T,), "i8"), ("ring_split", (4, T), "i8")]
    for m in _ratios(cache):
        E, cm, N = _shapes(cache, m, B, q, P)
        out += [(f"{m}.n_visible", (T,), "i8"), (f"{m}.n_visible_i32", (T,), "i4"),
                (f"{m}.emit_valid", (E,), "b1"), (f"{m}.emit_dst", (E,), "i8"),
                (f"{m}.emit_pos", (E,), "i8"), (f"{m}.from_ring", (E, cm), "b1"),
                (f"{m}.ring_rows", (E, cm), "i8"), (f"{m}.fresh_rows", (E, cm), "i8"),
                (f"{m}.before_zero", (E, cm), "b1"), (f"{m}.persist_dst", (T,), "i8")]
        if m != 4:
            out.append((f"{m}.all_visible_ids_i32", (T, P * N), "i4"))
    return out


@dataclass(frozen=True)
class PlanLayout:
    """Where each field of one bucket's plan lives: {name: (first word, shape, dtype)}, from
    word `base` of the static buffer to `end`."""
    fields: dict
    base: int
    end: int


def plan_layout(cache, B: int, q: int, P: int, base: int) -> PlanLayout:
    fields, w = {}, base
    for name, shape, dt in plan_fields(cache, B, q, P):
        fields[name] = (w, shape, dt)
        n = int(np.prod(shape))
        w += -(-n * np.dtype(_DTYPES[dt][0]).itemsize // 8)     # whole words: aligned views
    return PlanLayout(fields, base, w)


def _view(words, first, shape, dt, np_side: bool):
    """A field's view of an int64 word buffer (numpy array or torch tensor): no copy, no op."""
    n = int(np.prod(shape))
    nbytes = np.dtype(_DTYPES[dt][0]).itemsize
    run = words[first:first + -(-n * nbytes // 8)]
    if np_side:
        return run.view(_DTYPES[dt][0])[:n].reshape(shape)
    if dt == "b1":
        return run.view(torch.uint8)[:n].view(torch.bool).view(shape)
    return run.view(_DTYPES[dt][1])[:n].view(shape)


def host_views(layout: PlanLayout, host_words: np.ndarray) -> dict:
    """{name: numpy view} of the host (pinned) buffer; built once per bucket (a view costs
    microseconds, the per-step copy into it less)."""
    return {name: _view(host_words, first, shape, dt, True)
            for name, (first, shape, dt) in layout.fields.items()}


def pack(dst: dict, values: dict, packed: dict | None = None) -> None:
    """Write a host plan into its fields (`host_views`) of the host buffer. packed: the plan
    these views hold now (nothing written over them since): a field whose array is the one
    written then (a shared read-only array: constants, values looked up by residue) is left."""
    for name, view in dst.items():
        value = values[name]
        if packed is None or packed[name] is not value:
            view[...] = value


def views(layout: PlanLayout, words: torch.Tensor) -> dict:
    """{name: tensor view} of the uploaded buffer (what the graph reads)."""
    return {name: _view(words, first, shape, dt, False)
            for name, (first, shape, dt) in layout.fields.items()}


_STATIC: dict = {}        # (what, every number it depends on) -> position-independent arrays


def _static(key, make):
    """Arrays that depend on the bucket and the cache geometry only (`key` holds every number
    they are made from, not a cache's id, which a later cache may reuse), built once: a step's
    plan is ~100 numpy ops on tiny arrays (~1 us each), so the constant ones are not redone."""
    got = _STATIC.get(key)
    if got is None:
        got = _STATIC[key] = make()
        for a in got:                     # shared by every plan of the bucket (some are plan
            if isinstance(a, np.ndarray):   # fields as they are): nobody may write them
                a.setflags(write=False)
    return got


def host_plan(cache, B: int, q: int, P: int, pos, req_start, req_slot, req_valid, page_table,
              scratch_page: int, fast: bool = True) -> dict:
    """Numpy twin of static_forward.derive_plan: {field: array} for int64 host inputs pos [B*q],
    req_start / req_slot / req_valid [B], page_table [B, P] (also the int64 window_ids and
    all_visible_ids, for tests). Same formulas in the same order; numpy's // and % floor like
    torch's. Arrays of the result may be shared with later plans: read them, do not write.
    fast: one real request (batch-1 decode, DSpark verify at concurrency 1) takes `_block_plan`,
    other steps whose request rows are positions start..start+q-1 (as V4DecodeGraphs fills
    them, padding included) `_batch_plan`; both give the general formulas' fields, values and
    dtypes with fewer numpy ops (False: the general formulas, for tests)."""
    pos, pt = np.asarray(pos, np.int64), np.asarray(page_table, np.int64)
    st, sl = np.asarray(req_start, np.int64), np.asarray(req_slot, np.int64)
    if not fast:
        return _general_plan(cache, B, q, P, pos, st, sl, req_valid, pt, scratch_page)
    b = _bucket(cache, B, q, P)
    if B == 1 and req_valid[0]:
        return _block_plan(b, pos, int(st[0]), int(sl[0]), pt, scratch_page)
    s_t = st[b.req]
    if (pos - s_t - b.tok_in_req).any():      # not start..start+q-1 (V4DecodeGraphs never)
        return _general_plan(cache, B, q, P, pos, st, sl, req_valid, pt, scratch_page)
    return _batch_plan(b, pos, st, sl, np.asarray(req_valid) != 0, pt, scratch_page)


# ---- the general formulas (the reference of the fast paths) -----------------------------------

def _general_plan(cache, B, q, P, pos, st, sl, req_valid, pt, scratch_page) -> dict:
    T, C = B * q, cache.capacity
    req, req_i32, stage_win, offs, stage, stage_page, stage_row = _window_static(cache, B, q)
    valid_r = np.asarray(req_valid) != 0
    valid_t, s_t, slot_t = valid_r[req], st[req], sl[req]
    qw = pos[:, None] + offs
    win = np.where(qw >= s_t[:, None], stage_win, slot_t[:, None] * C + qw % C)
    window_ids = np.where((qw >= 0) & valid_t[:, None], win, -1)
    ring_dst = slot_t * C + pos % C
    split = np.empty((4, T), np.int64)
    split[0], split[1], split[2], split[3] = stage_page, stage_row, ring_dst // C, ring_dst % C
    out = dict(req_index=req, req_index_i32=req_i32,
               page_table_i32=pt.astype(np.int32), window_ids=window_ids,
               window_ids_i32=window_ids.astype(np.int32), stage_ids=stage, ring_dst=ring_dst,
               ring_split=split)
    for m in _ratios(cache):
        out.update(_general_ratio_plan(cache, m, B, q, P, pos, st, sl, valid_r, valid_t, slot_t,
                                       req, pt, scratch_page))
    return out


def _window_static(cache, B: int, q: int):
    """(req, req int32, staged window ids [T, W], window offsets [W], stage ids, their pages,
    their rows) of bucket (B, q): position-independent, built once."""
    T, W, C = B * q, cache.window, cache.capacity

    def make():
        tok = np.arange(T, dtype=np.int64)
        req = tok // q
        # the staged rows' ids of window column w: stage_base + tok + qw - pos, qw - pos fixed
        stage_win = cache.stage_base + tok[:, None] - (W - 1) + np.arange(W)
        stage = cache.stage_base + tok
        return (req, req.astype(np.int32), stage_win, np.arange(W) - (W - 1), stage,
                stage // C, stage % C)
    return _static(("window", B, q, W, C, cache.stage_base), make)


def _ratio_static(cache, m, B, q, P):
    """(entry request i, entry index within the request, pooling offsets [c*m], fresh row base
    [E, 1], local visible entry [P*N], its page, its row) of ratio m and bucket (B, q, P)."""
    E, cm, N = _shapes(cache, m, B, q, P)
    c, K = cm // m, E // B

    def make():
        e = np.arange(E, dtype=np.int64)
        i = e // K
        local = np.arange(P * N)
        return (i, e % K, np.arange(cm) - (c - 1) * m, i[:, None] * q, local, local // N,
                local % N)
    return _static(("ratio", m, B, q, P, E, cm, N), make)


def _general_ratio_plan(cache, m, B, q, P, pos, st, sl, valid_r, valid_t, slot_t, req, pt,
                        scratch_page) -> dict:
    """The ratio-m fields (RatioStatic's): candidate entries e (request e // K, entry
    j = start // m + e % K), their pooling rows, the ring rows this forward persists."""
    T, R = B * q, cache.comp_ring(m)
    N = cache.entries_per_page(m)
    i, e_mod, offs, fresh_base, local, local_page, local_row = _ratio_static(cache, m, B, q, P)
    st_i = st[i]
    j = st_i // m + e_mod
    ok = (j < (st_i + q) // m) & valid_r[i]
    page = pt[i, np.minimum(j // N, P - 1)]
    dst = np.where(ok, page * N + j % N, scratch_page * N)
    p = (j * m)[:, None] + offs                                           # [E, c*m]
    s_i = st_i[:, None]
    n_vis = np.where(valid_t, (pos + 1) // m, 0)
    fresh = fresh_base + p - s_i
    np.minimum(np.maximum(fresh, 0, out=fresh), T - 1, out=fresh)
    f = f"{m}."
    out = {f + "n_visible": n_vis, f + "n_visible_i32": n_vis.astype(np.int32),
           f + "emit_valid": ok, f + "emit_dst": dst, f + "emit_pos": np.where(ok, j, 0) * m,
           f + "from_ring": p < s_i, f + "ring_rows": sl[i][:, None] * R + p % R,
           f + "fresh_rows": fresh, f + "before_zero": p < 0,
           f + "persist_dst": slot_t * R + pos % R}
    if m != 4:
        ids = pt[req[:, None], local_page] * N + local_row
        vis = np.where(local < n_vis[:, None], ids, -1)
        out[f + "all_visible_ids"] = vis
        out[f + "all_visible_ids_i32"] = vis.astype(np.int32)
    return out


# ---- the fast paths ----------------------------------------------------------------------------

class _RatioBucket:
    """Ratio m's numbers, field names and position-independent arrays in bucket (B, q, P)."""

    def __init__(self, cache, m, B, q, P):
        E, cm, N = _shapes(cache, m, B, q, P)
        self.m, self.R, self.N, self.E, self.c = m, cache.comp_ring(m), N, E, cm // m
        (self.i, self.e_mod, self.offs, self.fresh_base, self.local, self.local_page,
         self.local_row) = _ratio_static(cache, m, B, q, P)
        self.names = tuple(f"{m}.{k}" for k in (
            "n_visible", "n_visible_i32", "emit_valid", "emit_dst", "emit_pos", "from_ring",
            "ring_rows", "fresh_rows", "before_zero", "persist_dst", "all_visible_ids",
            "all_visible_ids_i32"))
        self.hca = m != 4              # (the indexer of ratio 4 scores pages, not a list)
        # one request: its entries' pooled positions less j0*m, [E, c*m]; which of them
        # complete, by how many do ([K + 1, K])
        self.block_rel = (np.arange(E) * m)[:, None] + self.offs
        self.done_mask = np.arange(E)[None, :] < np.arange(E + 1)[:, None]
        self.last_visible = None       # (inputs, all_visible_ids, its int32 twin) of the last step
        self.block_entries = {}        # (start % m, min(start // m, c - 1)) -> _block_entries'
        # (j0*m % R, slot) -> one block's ring_rows; (start % R, slot) -> its persist_dst (the
        # page bucket P changes neither: shared by the buckets of every P)
        self.block_ring = _memo(("ring", m, self.R, q, E, cm), self.R)
        self.block_persist = _memo(("persist", m, self.R, q), self.R)
        self.last_emit = None          # (j0, entries done, page row bytes, emit_dst, emit_pos)
        for a in (self.block_rel, self.done_mask):
            a.setflags(write=False)


class _Memo(dict):
    """Read-only arrays of a plan by the residues they depend on, made on a key's first step:
    at most `size` keys (about one ring's worth for the request of a batch-1 run); when a new
    slot's keys would pass that, the old ones go."""

    def __init__(self, size: int):
        super().__init__()
        self.size = size

    def get_or_make(self, key, make):
        got = self.get(key)
        if got is None:
            if len(self) >= self.size:
                self.clear()
            got = self[key] = make()
            for a in got:
                a.setflags(write=False)
        return got


_MEMOS: dict = {}         # (what, every number it depends on but the residue) -> _Memo


def _memo(key, size: int) -> _Memo:
    """The _Memo of `key` (what a field's values depend on besides its residue key), shared by
    the buckets whose values are the same functions of the residue."""
    got = _MEMOS.get(key)
    if got is None:
        got = _MEMOS[key] = _Memo(size)
    return got


class _Bucket:
    """Everything of bucket (B, q, P) on one cache geometry that no position changes."""

    def __init__(self, cache, B, q, P):
        self.B, self.q, self.P, self.T = B, q, P, B * q
        self.C, self.W = cache.capacity, cache.window
        (self.req, self.req_i32, self.stage_win, self.win_offs, self.stage, self.stage_page,
         self.stage_row) = _window_static(cache, B, q)
        self.ratios = [_RatioBucket(cache, m, B, q, P) for m in _ratios(cache)]
        # request rows at positions s..s+q-1: window column w of token k reads position
        # s - (W-1) + k + w, the (k+w)-th of the request's run of W + q - 1 positions, so the
        # window ids are a gather from one [B, W + q - 1] table (positions before s: ring rows,
        # from s on: staged rows, stage_base + i*q + (position - s))
        W, L = self.W, self.W + q - 1
        self.tok_in_req = np.arange(self.T) % q
        self.run_before = np.arange(W - 1) - (W - 1)           # ring part's positions less s
        self.run_staged = cache.stage_base + np.arange(self.T).reshape(B, q)
        self.run_index = ((self.req * L + self.tok_in_req)[:, None] + np.arange(W))
        for a in (self.tok_in_req, self.run_before, self.run_staged, self.run_index):
            a.setflags(write=False)
        self.across = _AcrossRatios(self.ratios)
        # one request's block s..s+q-1 with s >= W - 1 (the window starts past 0): window column
        # w of token k is ring row (s + k + w - (W-1)) % C of its slot or a staged row, so the
        # window fields depend on (s % C, slot) alone
        self.block_window = _memo(("window", q, self.W, self.C, cache.stage_base), self.C)


class _AcrossRatios:
    """The candidate entries of every ratio concatenated: per entry its request i, index k
    within the request, ratio m, entries per page N, ring rows R; each ratio's slice of them;
    the ratios and ring sizes as [ratios, 1] columns."""

    def __init__(self, ratios):
        def per_entry(of):
            return np.concatenate([np.broadcast_to(of(rb), (rb.E,)) for rb in ratios]).astype(
                np.int64)
        self.i, self.k = per_entry(lambda rb: rb.i), per_entry(lambda rb: rb.e_mod)
        self.m, self.N = per_entry(lambda rb: rb.m), per_entry(lambda rb: rb.N)
        self.R = per_entry(lambda rb: rb.R)
        ends = np.cumsum([0] + [rb.E for rb in ratios])
        self.slices = [slice(int(x), int(y)) for x, y in zip(ends[:-1], ends[1:])]
        self.m_col = np.array([[rb.m] for rb in ratios], np.int64)
        self.R_col = np.array([[rb.R] for rb in ratios], np.int64)
        for a in (self.i, self.k, self.m, self.N, self.R, self.m_col, self.R_col):
            a.setflags(write=False)


_BUCKETS: dict = {}       # (bucket, every number of the cache geometry) -> _Bucket


def _bucket(cache, B, q, P) -> _Bucket:
    key = (B, q, P, cache.window, cache.capacity, cache.stage_base, cache.block_size,
           cache.lookahead, cache.ratios)
    got = _BUCKETS.get(key)
    if got is None:
        got = _BUCKETS[key] = _Bucket(cache, B, q, P)
    return got


def _visible(rb: _RatioBucket, key, ids_of, n_vis):
    """all_visible_ids and its int32 twin, the last step's when its inputs `key` are these (the
    visible entries change once per m positions), read-only as the _static arrays."""
    last = rb.last_visible
    if last is None or last[0] != key:
        vis = np.where(rb.local < n_vis[:, None], ids_of(), -1)
        vis32 = vis.astype(np.int32)
        vis.setflags(write=False)
        vis32.setflags(write=False)
        last = rb.last_visible = (key, vis, vis32)
    return last[1], last[2]


def _block_plan(b: _Bucket, pos, s: int, slot: int, pt, scratch_page) -> dict:
    """host_plan of one real request feeding q tokens from start s (batch bucket 1): Python
    integers where the general formulas build one-element arrays, the per-token ratio fields of
    all ratios in one op each, and, for rows s..s+q-1 (every engine step's), the fields that
    are functions of a residue of s and the slot looked up by it (`_Memo`; each numpy op on a
    tiny array costs ~1 us, and a round's host work shows 1:1 in a batch-1 round's time)."""
    C, q = b.C, b.q
    in_block = pos.tobytes() == np.arange(s, s + q, dtype=np.int64).tobytes()
    if in_block and s >= b.W - 1:
        window_ids, window_ids_i32, ring_dst, split = b.block_window.get_or_make(
            (s % C, slot), lambda: _block_window(b, pos, s, slot))
    else:
        window_ids, window_ids_i32, ring_dst, split = _block_window(b, pos, s, slot)
    out = dict(req_index=b.req, req_index_i32=b.req_i32, page_table_i32=pt.astype(np.int32),
               window_ids=window_ids, window_ids_i32=window_ids_i32, stage_ids=b.stage,
               ring_dst=ring_dst, ring_split=split)
    row, a = pt[0], b.across
    row_bytes = row.tobytes()
    n_vis_all = (pos + 1) // a.m_col                                     # [ratios, q]
    n_vis32_all = n_vis_all.astype(np.int32)
    if not in_block:
        persist_all = pos % a.R_col
        persist_all += slot * a.R_col
    for r, rb in enumerate(b.ratios):
        m, R, N, E = rb.m, rb.R, rb.N, rb.E
        j0 = s // m
        done = (s + q) // m - j0                               # entries completing: k < done
        from_ring, fresh, before_zero = _block_entries(rb, q, s % m, min(j0, rb.c - 1))
        # (block_rel + j0*m) % R + slot*R: a function of (j0*m % R, slot)
        ring, = rb.block_ring.get_or_make(
            (j0 * m % R, slot), lambda: ((rb.block_rel + j0 * m) % R + slot * R,))
        if in_block:                     # (s + k) % R + slot*R: a function of (s % R, slot)
            persist, = rb.block_persist.get_or_make((s % R, slot),
                                                    lambda: (pos % R + slot * R,))
        else:
            persist = persist_all[r]
        emit = rb.last_emit
        if emit is None or emit[:4] != (j0, done, row_bytes, scratch_page):
            dst = np.array([int(row[min((j0 + k) // N, b.P - 1)]) * N + (j0 + k) % N
                            if k < done else scratch_page * N for k in range(E)])
            emit_pos = np.array([(j0 + k) * m if k < done else 0 for k in range(E)])
            dst.setflags(write=False)
            emit_pos.setflags(write=False)
            emit = rb.last_emit = (j0, done, row_bytes, scratch_page, dst, emit_pos)
        n_vis = n_vis_all[r]
        nv, nv32, ev, ed, ep, fr, rr, fs, bz, pd, av, av32 = rb.names
        out[nv], out[nv32], out[ev] = n_vis, n_vis32_all[r], rb.done_mask[done]
        out[ed], out[ep] = emit[4], emit[5]
        out[fr], out[rr], out[fs], out[bz], out[pd] = from_ring, ring, fresh, before_zero, persist
        if rb.hca:
            out[av], out[av32] = _visible(rb, (n_vis.tobytes(), row_bytes),
                                          lambda: row[rb.local_page] * N + rb.local_row, n_vis)
    return out


def _block_window(b: _Bucket, pos, s: int, slot: int):
    """(window_ids, window_ids_i32, ring_dst, ring_split) of `_block_plan`."""
    C, q = b.C, b.q
    qw = pos[:, None] + b.win_offs                             # [q, W] window positions
    window_ids = qw % C
    window_ids += slot * C
    np.copyto(window_ids, b.stage_win, where=qw >= s)          # this forward's staged rows
    if pos.min() < b.W - 1:                                    # the window reaches before 0
        window_ids[qw < 0] = -1
    pos_c = pos % C
    split = np.empty((4, q), np.int64)     # ring_dst // C is the slot, ring_dst % C pos % C
    split[0], split[1], split[2], split[3] = b.stage_page, b.stage_row, slot, pos_c
    return window_ids, window_ids.astype(np.int32), pos_c + slot * C, split


def _block_entries(rb: _RatioBucket, q: int, r: int, j0_low: int):
    """(from_ring, fresh_rows, before_zero) of `_block_plan`'s ratio entries for a start s with
    s % m == r and min(s // m, c - 1) == j0_low: the pooled positions are p = s - r + block_rel,
    so p - s depends on r only, and p < 0 (possible only while s // m < c - 1) on both. Built
    once per (r, j0_low) of the bucket (at most c*m of them)."""
    got = rb.block_entries.get((r, j0_low))
    if got is None:
        rel = rb.block_rel - r                                 # p - s, [E, c*m]
        got = rel < 0, np.clip(rel, 0, q - 1), rel + (j0_low * rb.m + r) < 0
        for x in got:
            x.setflags(write=False)
        rb.block_entries[(r, j0_low)] = got
    return got


def _batch_plan(b: _Bucket, pos, st, sl, valid_r, pt, scratch_page) -> dict:
    """The general formulas with fewer numpy ops, for request rows at positions s..s+q-1: the
    window ids gathered from one [B, W + q - 1] table, results written
    in place, the padding masks skipped when every request is real (and the window starts
    past 0), ring_split's slot and row columns taken from their parts, the visible lists of the
    last inputs kept per ratio."""
    C, q, T, req, W = b.C, b.q, b.T, b.req, b.W
    all_valid = bool(valid_r.all())
    slot_t = sl[req]
    run = np.empty((b.B, W + q - 1), np.int64)               # (see _Bucket.run_index)
    before = st[:, None] + b.run_before                       # positions before the start
    ring_part = run[:, :W - 1]
    np.remainder(before, C, out=ring_part)
    ring_part += (sl * C)[:, None]
    if st.min() < W - 1:
        np.copyto(ring_part, -1, where=before < 0)
    run[:, W - 1:] = b.run_staged
    if not all_valid:
        run[~valid_r] = -1
    window_ids = run.ravel().take(b.run_index)
    pos_c = pos % C
    split = np.empty((4, T), np.int64)
    split[0], split[1], split[2], split[3] = b.stage_page, b.stage_row, slot_t, pos_c
    out = dict(req_index=req, req_index_i32=b.req_i32, page_table_i32=pt.astype(np.int32),
               window_ids=window_ids, window_ids_i32=window_ids.astype(np.int32),
               stage_ids=b.stage, ring_dst=pos_c + slot_t * C, ring_split=split)
    # the candidate entries of every ratio side by side ([E_all]: one op each for all ratios),
    # the per-token fields as [ratios, T]; each ratio's fields are views of them
    a = b.across
    st_e, sl_e = st[a.i], sl[a.i]
    j = st_e // a.m
    j += a.k
    ok = j < (st_e + q) // a.m
    if not all_valid:
        ok &= valid_r[a.i]
    page_of, row_of = np.divmod(j, a.N)
    np.minimum(page_of, b.P - 1, out=page_of)
    dst = pt[a.i, page_of]
    dst *= a.N
    dst += row_of
    dst = np.where(ok, dst, a.N * scratch_page)
    jm = j * a.m
    emit_pos = np.where(ok, jm, 0)
    slot_r = sl_e * a.R
    n_vis = (pos + 1) // a.m_col                                          # [ratios, T]
    if not all_valid:
        n_vis *= valid_r[req]                                 # (a bool mask: 0 for padding)
    n_vis32 = n_vis.astype(np.int32)
    persist = pos % a.R_col
    persist += slot_t * a.R_col
    for r, (rb, e) in enumerate(zip(b.ratios, a.slices)):
        s_i = st_e[e, None]
        p = jm[e, None] + rb.offs                                         # [E, c*m]
        fresh = p - s_i
        fresh += rb.fresh_base
        np.minimum(np.maximum(fresh, 0, out=fresh), T - 1, out=fresh)
        ring = p % rb.R
        ring += slot_r[e, None]
        nv, nv32, ev, ed, ep, fr, rr, fs, bz, pd, av, av32 = rb.names
        out[nv], out[nv32], out[ev], out[ed], out[ep] = (n_vis[r], n_vis32[r], ok[e], dst[e],
                                                         emit_pos[e])
        out[fr], out[rr], out[fs], out[bz], out[pd] = p < s_i, ring, fresh, p < 0, persist[r]
        if rb.hca:
            N = rb.N
            out[av], out[av32] = _visible(
                rb, (n_vis[r].tobytes(), pt.tobytes()),
                lambda: pt[req[:, None], rb.local_page] * N + rb.local_row, n_vis[r])
    return out
