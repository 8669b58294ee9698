"""Host cost of one fixed-shape V4 step's plan per call: `host_plan` by its general formulas
(fast=False), by its fast paths, and the fast paths with `pack` into the host buffer's views,
for the buckets of batch-1 decode (1, 1) and DSpark verify rounds (B, 6), on the shipped pair's
cache geometry (window 128, ratios 4 / 128, 256-token pages) over the tiny
preset's layers (the plan depends on the cache geometry only).

    python benchmarks/bench_host_plan.py --buckets 1x1,1x6,4x6,16x6 --repeats 40

Each request is mid-sequence (a start that is not a page, ratio or window boundary) on its own slot
and pages; padding requests fill the bucket up to B where --requests is below it. Prints, per
bucket, the best and median of --repeats timings of --calls calls each, the three timed in turn
within each repeat (the CPUs are shared: read the best).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from dspark.kvcache.paged import PagedKVCache
from dspark.models.deepseek_v4 import host_plan as hp
from dspark.models.deepseek_v4.graph import reserve_scratch
from dspark.tools.make_checkpoint import preset_config


def shipped_geometry_cache(max_num_seqs: int, lookahead: int = 5):
    cfg = preset_config("tiny", overrides={"compress_ratios": (0, 4, 128, 4, 128, 0),
                                           "sliding_window": 128})
    cache = PagedKVCache(cfg, kv_cache_dtype="fp32", block_size=256,
                         num_blocks=4 * max_num_seqs + 2, max_num_seqs=max_num_seqs + 1,
                         lookahead=lookahead,
                         max_batch_tokens=max_num_seqs * (lookahead + 1))
    return cache, *reserve_scratch(cache)


def step_inputs(cache, scratch_slot, scratch_page, B, q, P, R, start):
    """Host int64 inputs of bucket (B, q, P) with R real requests at `start` (+7 per request)."""
    pos, st = np.zeros(B * q, np.int64), np.zeros(B, np.int64)
    sl, va = np.full(B, scratch_slot, np.int64), np.zeros(B, np.int64)
    pt = np.full((B, P), scratch_page, np.int64)
    for i in range(R):
        s = start + 7 * i
        pos[i * q:(i + 1) * q] = np.arange(s, s + q)
        st[i], sl[i], va[i] = s, i, 1
        need = -(-(s + q) // cache.block_size)
        pt[i, :need] = np.arange(need) + (P * i) % (cache.num_blocks - P - 1)
    pos[R * q:] = np.tile(np.arange(q), B - R)
    return pos, st, sl, va, pt


def time_calls(fns, calls: int, repeats: int) -> list:
    """[[us per call of fn, per repeat] per fn], the fns timed in turn within each repeat."""
    out = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, out):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls * 1e6)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buckets", default="1x1,1x6,4x6,16x6", help="BxQ,... (batch bucket x q)")
    p.add_argument("--pages", type=int, default=4, help="page bucket P (256-token pages)")
    p.add_argument("--start", type=int, default=613, help="first request's start position")
    p.add_argument("--requests", type=int, default=0, help="real requests (0: B, no padding)")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--repeats", type=int, default=40)
    a = p.parse_args(argv)
    buckets = [tuple(int(x) for x in b.split("x")) for b in a.buckets.split(",")]
    cache, scratch_slot, scratch_page = shipped_geometry_cache(max(B for B, _ in buckets))
    heads = ("general us", "fast us", "fast + pack us")
    print(f"{'B':>3} {'q':>2} {'P':>2}  " + "  ".join(f"{h:>22}" for h in heads))
    for B, q in buckets:
        P, R = a.pages, min(a.requests or B, B)
        fields = step_inputs(cache, scratch_slot, scratch_page, B, q, P, R, a.start)
        layout = hp.plan_layout(cache, B, q, P, base=0)
        dst = hp.host_views(layout, np.zeros(layout.end, np.int64))
        args = (cache, B, q, P, *fields, scratch_page)
        fns = [lambda: hp.host_plan(*args, fast=False), lambda: hp.host_plan(*args),
               lambda: hp.pack(dst, hp.host_plan(*args))]
        time_calls(fns, 4 * a.calls, 1)             # warm: the first timings run slow
        times = time_calls(fns, a.calls, a.repeats)
        fmt = lambda t: f"best {min(t):7.1f} med {statistics.median(t):7.1f}"   # noqa: E731
        print(f"{B:>3} {q:>2} {P:>2}  " + "  ".join(fmt(t) for t in times))


if __name__ == "__main__":
    main()
