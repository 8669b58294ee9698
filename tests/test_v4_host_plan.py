"""The host (numpy) plan of the fixed-shape V4 step (dspark/models/deepseek_v4/host_plan.py)
against the device-op plan `derive_plan` (graph.py) it replaces inside the graph: every field,
dtype and shape on random schedules — several requests with their own slots and scattered page
tables, padding requests (scratch slot / page) up to the batch bucket, starts on and around
entry boundaries and far enough that the SWA window and the compressor rings wrap, q = 1
(decode) and verify blocks, compression ratios 4 / 16 (tiny preset) and 4 / 128. Then the same
plan packed into the static buffer and read back as views (what the graph reads).
"""
import random

import numpy as np
import pytest
import torch

from dspark.kvcache.paged import PagedKVCache
from dspark.models.deepseek_v4 import host_plan as hp
from dspark.models.deepseek_v4.graph import reserve_scratch
from dspark.models.deepseek_v4.static_forward import StaticInputs, derive_plan, plan_from_views
from dspark.tools.make_checkpoint import preset_config

LOOKAHEAD = 5
SCHEDULES = {"tiny 4/16": ((0, 4, 16, 4, 16, 0), 16),
             "4/128": ((0, 4, 128, 4, 128, 0), 128)}


def make_cache(ratios, block_size, window=None):
    over = {"compress_ratios": ratios} | ({"sliding_window": window} if window else {})
    cfg = preset_config("tiny", overrides=over)
    cache = PagedKVCache(cfg, kv_cache_dtype="fp32", block_size=block_size, num_blocks=24,
                         max_num_seqs=9, lookahead=LOOKAHEAD, max_batch_tokens=64)
    return cache, *reserve_scratch(cache)


def random_step(rng, cache, scratch_slot, scratch_page):
    """Host int64 inputs of one bucket (B, q, P), filled as V4DecodeGraphs.run fills them."""
    bs, m_max = cache.block_size, max(cache.ratios)
    B = rng.choice([1, 2, 4, 8])
    R, q, P = rng.randint(1, B), rng.choice([1, 2, LOOKAHEAD + 1]), rng.choice([1, 2, 4, 8])
    pos, st = np.zeros(B * q, np.int64), np.zeros(B, np.int64)
    sl, va = np.full(B, scratch_slot, np.int64), np.zeros(B, np.int64)
    pt = np.full((B, P), scratch_page, np.int64)
    slots = rng.sample([s for s in range(cache.num_slots) if s != scratch_slot], R)
    pages = [p for p in range(cache.num_blocks) if p != scratch_page]
    for i in range(R):
        # near an entry boundary of the largest ratio (or anywhere), the window often wrapped
        top = P * bs - q
        start = rng.choice([rng.randint(0, top),
                            min(top, max(0, rng.randint(0, top // m_max) * m_max
                                         + rng.randint(-q, 1)))])
        pos[i * q:(i + 1) * q] = np.arange(start, start + q)
        st[i], sl[i], va[i] = start, slots[i], 1
        need = -(-(start + q) // bs)
        pt[i, :need] = rng.sample(pages, need)
    pos[R * q:] = np.tile(np.arange(q), B - R)      # padding: positions 0..q-1 of the scratch
    return B, q, P, pos, st, sl, va, pt


def _tensors(plan):
    """{name: tensor} of a StaticPlan's int / bool fields, ratio fields as 'm.field'."""
    out = {k: v for k, v in vars(plan).items() if isinstance(v, torch.Tensor)}
    for m, rp in plan.ratios.items():
        out.update({f"{m}.{k}": v for k, v in vars(rp).items() if isinstance(v, torch.Tensor)})
    return out


def assert_same(name, got, want):
    if isinstance(got, np.ndarray):
        got = np.array(got)                  # a copy: cached plan arrays are read-only
    got = torch.as_tensor(got)
    assert got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape), (
        name, got.dtype, want.dtype, tuple(got.shape), tuple(want.shape))
    assert torch.equal(got, want), (name, got, want)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_host_plan_equals_derive_plan(schedule):
    cache, scratch_slot, scratch_page = make_cache(*SCHEDULES[schedule])
    rng = random.Random(schedule)
    seen = set()
    for _ in range(60):
        B, q, P, pos, st, sl, va, pt = random_step(rng, cache, scratch_slot, scratch_page)
        T = lambda a: torch.from_numpy(a.copy())      # noqa: E731
        inp = StaticInputs(B, q, P, torch.zeros(B * q, dtype=torch.long), T(pos), T(st), T(sl),
                           T(va), T(pt))
        ref = _tensors(derive_plan(cache, inp, 1000, scratch_slot, scratch_page))
        host = hp.host_plan(cache, B, q, P, pos, st, sl, va, pt, scratch_page)
        want = {k for k in ref if k != "positions" and k != "page_table" and k != "ring_src"}
        assert set(host) == want, set(host) ^ want
        for name, value in host.items():
            assert_same(name, value, ref[name])
        # packed behind 5 words of "inputs" and read back as views: what the graph reads
        layout = hp.plan_layout(cache, B, q, P, base=5)
        words = np.full(layout.end, -7, np.int64)       # garbage in unused word halves
        hp.pack(hp.host_views(layout, words), host)
        viewed = _tensors(plan_from_views(cache, hp.views(layout, torch.from_numpy(words)), inp,
                                          1000))
        assert set(ref) - set(viewed) == {"window_ids"} | {
            f"{m}.all_visible_ids" for m in set(cache.ratios) - {0, 4}}
        for name, t in viewed.items():
            assert_same(name, t, ref[name])
        seen.add((B, q, bool(((pos >= cache.capacity) & (np.repeat(va, q) != 0)).any())))
    # every batch bucket, decode and verify, and windows wrapping the ring were drawn
    assert {b for b, _, _ in seen} == {1, 2, 4, 8} and {q for _, q, _ in seen} >= {1, 6}
    assert any(w for _, _, w in seen)


def test_layout_fits_the_largest_bucket():
    """Every bucket's plan lies inside the largest bucket's (the buffer V4DecodeGraphs sizes)."""
    cache, _, _ = make_cache(*SCHEDULES["4/128"])
    top = hp.plan_layout(cache, 8, 6, 16, base=100).end
    for B in (1, 2, 4, 8):
        for q in (1, 6):
            for P in (1, 2, 4, 8, 16):
                lay = hp.plan_layout(cache, B, q, P, base=100)
                firsts = sorted(f for f, _, _ in lay.fields.values())
                assert firsts[0] == 100 and lay.end <= top


def boundary_step(rng, cache, scratch_slot, scratch_page, B, q, P):
    """Inputs of bucket (B, q, P) whose real requests start at 0, just before or on a page, a
    ratio-4 or a largest-ratio entry boundary (so the block crosses it), past the window and the
    rings (mid-ring), or anywhere; some buckets padded (req_valid 0 rows), some all padding (as
    a graph capture's step)."""
    bs, m_max = cache.block_size, max(cache.ratios)
    R = rng.choice([0, rng.randint(1, B), rng.randint(1, B)]) if rng.random() < 0.4 else B
    pos, st = np.zeros(B * q, np.int64), np.zeros(B, np.int64)
    sl, va = np.full(B, scratch_slot, np.int64), np.zeros(B, np.int64)
    pt = np.full((B, P), scratch_page, np.int64)
    slots = rng.sample([s for s in range(cache.num_slots) if s != scratch_slot], R)
    pages = [p for p in range(cache.num_blocks) if p != scratch_page]
    top = P * bs - q
    for i in range(R):
        unit = rng.choice([bs, 4, m_max, cache.capacity])
        near = rng.randint(0, top // unit) * unit + rng.randint(-q, 1)
        start = min(top, max(0, rng.choice([0, near, near, rng.randint(0, top)])))
        pos[i * q:(i + 1) * q] = np.arange(start, start + q)
        st[i], sl[i], va[i] = start, slots[i], 1
        need = -(-(start + q) // bs)
        pt[i, :need] = rng.sample(pages, need)
    pos[R * q:] = np.tile(np.arange(q), B - R)
    return pos, st, sl, va, pt


def assert_plans_equal(fast, general, where):
    assert fast.keys() == general.keys(), (where, fast.keys() ^ general.keys())
    for k, want in general.items():
        got = fast[k]
        assert isinstance(got, np.ndarray), (where, k, type(got))
        assert got.dtype == want.dtype and got.shape == want.shape, (
            where, k, got.dtype, want.dtype, got.shape, want.shape)
        assert np.array_equal(got, want), (where, k, got, want)


# the shipped pair's geometry too: window 128, 256-token pages
FAST_SCHEDULES = {**SCHEDULES, "shipped 4/128 w128": ((0, 4, 128, 4, 128, 0), 256, 128)}


@pytest.mark.parametrize("name", list(FAST_SCHEDULES))
def test_fast_paths_equal_general_formulas(name):
    """host_plan's fast paths (one request's q-token block, the batched formulas) against its
    general formulas (fast=False): every field, dtype and shape, on buckets B 1..8, q 1..8,
    blocks crossing page, ratio-4 and largest-ratio entry boundaries, starting at 0 and mid-ring,
    padded, all padding (a graph capture's step) or not, with the same requests stepping on
    (cached visible lists reused) and a page table changing under them (not reused); and with
    rows out of position order."""
    cache, scratch_slot, scratch_page = make_cache(*FAST_SCHEDULES[name])
    rng = random.Random(name)
    seen = set()
    for n in range(400):
        B = 1 if n % 2 else rng.randint(1, 8)
        q, P = rng.randint(1, 8), rng.choice([1, 2, 4, 8])
        fields = boundary_step(rng, cache, scratch_slot, scratch_page, B, q, P)
        for step in range(2):                 # the next block of the same requests
            args = (cache, B, q, P, *fields, scratch_page)
            assert_plans_equal(hp.host_plan(*args), hp.host_plan(*args, fast=False),
                               (n, step, B, q, P, fields))
            pos, st, sl, va, pt = (a.copy() for a in fields)
            adv = rng.randint(1, q)
            if (st + adv + q > P * cache.block_size).any() or rng.random() < 0.2:
                pt[0, 0] = scratch_page if pt[0, 0] != scratch_page else pt[0, -1]
            else:
                pos[:va.sum() * q] += adv
                st[va != 0] += adv
            fields = pos, st, sl, va, pt
        seen.add((B, q, bool(va.all()), bool(va.any())))
        # rows out of order (no engine step has them): the fast paths must see it too
        pos = fields[0].copy()
        rng.shuffle(pos)
        args = (cache, B, q, P, pos, *fields[1:], scratch_page)
        assert_plans_equal(hp.host_plan(*args), hp.host_plan(*args, fast=False), (n, "shuffled"))
    assert {b for b, _, _, _ in seen} == set(range(1, 9))
    assert {q for _, q, _, _ in seen} == set(range(1, 9))
    assert {(full, some) for _, _, full, some in seen} == {(True, True), (False, True),
                                                           (False, False)}


def test_block_plan_stepping_round_the_rings():
    """One request's blocks stepping on past every ring's length (the fields looked up by a
    residue of the start and the slot are reused), moving to another slot on the way, against
    the general formulas."""
    cache, scratch_slot, scratch_page = make_cache(*FAST_SCHEDULES["shipped 4/128 w128"])
    rng = random.Random(7)
    q, P = 6, 8
    slots = [s for s in range(cache.num_slots) if s != scratch_slot][:2]
    pages = rng.sample([p for p in range(cache.num_blocks) if p != scratch_page], P)
    start, top = 0, P * cache.block_size - q
    while start <= top:
        slot = slots[0] if start < top // 2 else slots[1]
        pt = np.array([pages], np.int64)
        args = (cache, 1, q, P, np.arange(start, start + q), np.array([start]),
                np.array([slot]), np.array([1]), pt, scratch_page)
        assert_plans_equal(hp.host_plan(*args), hp.host_plan(*args, fast=False), start)
        start += rng.randint(1, q)
