"""The fixed-shape V4 step's plan computed on the host (numpy), packed into the static int buffer
and uploaded with the step's inputs in the same single host->device copy.

`derive_plan` (static_forward.py) builds the same lists from the static inputs with ~100 tiny device
integer ops; inside a CUDA graph each one is a kernel launch per step (~2-3 us each), although
every value is a function of integers the engine knows on the host before the step (positions,
request starts, slots, page tables). `host_plan` is its numpy twin (same formulas, same order,
same dtypes: tests/test_v4_host_plan.py compares every field on random schedules); the graph then
only takes views of the uploaded buffer.

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


def pack(dst: dict, values: dict) -> None:
    """Write a host plan into its fields (`host_views`) of the host buffer."""
    for name, view in dst.items():
        view[...] = values[name]


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
    """Numpy twin of static_forward.derive_plan: {field: array} for int64 host inputs pos [B*q], req_start
    / req_slot / req_valid [B], page_table [B, P] (also the int64 window_ids and
    all_visible_ids, for tests). Same formulas in the same order; numpy's // and % floor like
    torch's. fast: one request decoding one token takes `_decode_plan` (same result; False:
    the general formulas, for tests)."""
    T = B * q
    pos, pt = np.asarray(pos, np.int64), np.asarray(page_table, np.int64)
    st, sl = np.asarray(req_start, np.int64), np.asarray(req_slot, np.int64)
    if fast and B == 1 and req_valid[0] and pos[0] == st[0] and pos[-1] == st[0] + q - 1:
        return _block_plan(cache, q, P, pos, int(st[0]), int(sl[0]), pt, scratch_page)
    C = cache.capacity
    req, req_i32, stage_win, offs, stage, stage_page, stage_row = _window_static(cache, B, q)
    valid_r = np.asarray(req_valid) != 0
    valid_t, s_t, slot_t = valid_r[req], st[req], sl[req]
    qw = pos[:, None] + offs
    win = np.where(qw >= s_t[:, None], stage_win, slot_t[:, None] * C + qw % C)
    window_ids = np.where((qw >= 0) & valid_t[:, None], win, -1)
    ring_dst = slot_t * C + pos % C
    split = np.empty((4, T), np.int64)       # (rows assigned: np.stack costs ~5 us here)
    split[0], split[1], split[2], split[3] = stage_page, stage_row, ring_dst // C, ring_dst % C
    out = dict(req_index=req, req_index_i32=req_i32,
               page_table_i32=pt.astype(np.int32), window_ids=window_ids,
               window_ids_i32=window_ids.astype(np.int32), stage_ids=stage, ring_dst=ring_dst,
               ring_split=split)
    for m in _ratios(cache):
        out.update(_ratio_plan(cache, m, B, q, P, pos, st, sl, valid_r, valid_t, slot_t, req, pt,
                               scratch_page))
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


def _ratio_plan(cache, m, B, q, P, pos, st, sl, valid_r, valid_t, slot_t, req, pt,
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


def _block_plan(cache, q: int, P: int, pos, s: int, slot: int, pt, scratch_page) -> dict:
    """host_plan of one request feeding q tokens at positions s..s+q-1 (batch bucket 1: the
    batch-1 decode step, q = 1, and the DSpark verify block, q = γ + 1): the same fields, values
    and dtypes as the general formulas (tests/test_v4_host_plan.py compares them), with Python
    integers where those build one-element arrays and, per ratio, the pooling-row fields looked
    up by the start's residue (every numpy op on a tiny array costs ~1 us: this plan costs about
    half the general one's host time)."""
    C, W = cache.capacity, cache.window
    req, req_i32, stage_win, offs, stage, stage_page, stage_row = _window_static(cache, 1, q)
    qw = pos[:, None] + offs                                   # [q, W] window positions
    window_ids = qw % C
    window_ids += slot * C
    np.copyto(window_ids, stage_win, where=qw >= s)            # this forward's staged rows
    if s < W - 1:                                              # the window reaches before 0
        window_ids[qw < 0] = -1
    pos_c = pos % C
    split = np.empty((4, q), np.int64)
    split[0], split[1], split[2], split[3] = stage_page, stage_row, slot, pos_c
    out = dict(req_index=req, req_index_i32=req_i32, page_table_i32=pt.astype(np.int32),
               window_ids=window_ids, window_ids_i32=window_ids.astype(np.int32),
               stage_ids=stage, ring_dst=pos_c + slot * C, ring_split=split)
    pos1 = pos + 1
    for m in _ratios(cache):
        out.update(_block_ratio_plan(cache, m, q, P, pos, pos1, s, slot, pt, scratch_page))
    return out


def _block_entries_static(cache, m, q, P, r: int, j0_low: int):
    """(from_ring, fresh_rows, before_zero) of `_block_plan`'s ratio-m entries for a start s with
    s % m == r and min(s // m, c - 1) == j0_low: pooled position p = s - r + k*m + offs, so
    p - s and (for s // m >= c - 1, when p >= 0 throughout) p < 0 depend on these two only."""
    _, _, offs, _, _, _, _ = _ratio_static(cache, m, 1, q, P)
    E, cm, _ = _shapes(cache, m, 1, q, P)
    c = cm // m

    def make():
        rel = (np.arange(E) * m)[:, None] + offs - r                # p - s, [E, c*m]
        return rel < 0, np.clip(rel, 0, q - 1), rel + (j0_low * m + r) < 0
    return _static(("block entries", m, q, E, cm, r, j0_low), make)


def _block_ratio_plan(cache, m, q, P, pos, pos1, s, slot, pt, scratch_page) -> dict:
    """_ratio_plan for `_block_plan`'s step: candidate entries j = s // m + k, k < K."""
    R, N = cache.comp_ring(m), cache.entries_per_page(m)
    _, _, offs, _, local, local_page, local_row = _ratio_static(cache, m, 1, q, P)
    E, cm, _ = _shapes(cache, m, 1, q, P)
    j0 = s // m
    done = (s + q) // m - j0                                   # entries completing: k < done
    from_ring, fresh, before_zero = _block_entries_static(cache, m, q, P, s % m,
                                                          min(j0, cm // m - 1))
    row = pt[0]
    dst = [int(row[min((j0 + k) // N, P - 1)]) * N + (j0 + k) % N if k < done
           else scratch_page * N for k in range(E)]
    ring = (np.arange(E) * m)[:, None] + offs if E > 1 else offs[None]
    ring = ring + j0 * m
    ring %= R
    ring += slot * R
    n_vis = pos1 // m
    persist = pos % R
    persist += slot * R
    f = f"{m}."
    out = {f + "n_visible": n_vis, f + "n_visible_i32": n_vis.astype(np.int32),
           f + "emit_valid": np.array([k < done for k in range(E)]),
           f + "emit_dst": np.array(dst),
           f + "emit_pos": np.array([(j0 + k) * m if k < done else 0 for k in range(E)]),
           f + "from_ring": from_ring, f + "ring_rows": ring, f + "fresh_rows": fresh,
           f + "before_zero": before_zero, f + "persist_dst": persist}
    if m != 4:
        # the visible entries change once per m positions: the last answer per ratio is kept
        # (read-only, as the _static arrays)
        key = (q, P, N, n_vis.tobytes(), row.tobytes())
        last = _LAST_VISIBLE.get(m)
        if last is None or last[0] != key:
            ids = row[local_page] * N + local_row
            vis = np.where(local < n_vis[:, None], ids, -1)
            vis32 = vis.astype(np.int32)
            vis.setflags(write=False)
            vis32.setflags(write=False)
            last = _LAST_VISIBLE[m] = (key, vis, vis32)
        out[f + "all_visible_ids"], out[f + "all_visible_ids_i32"] = last[1], last[2]
    return out


_LAST_VISIBLE: dict = {}      # ratio -> (inputs, all_visible_ids, its int32 twin)
