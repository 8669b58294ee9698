"""Throughput profile SPS(B): measured engine step time at B verify tokens (spec §6.4).

Measured once per (device, model, backend, dtype) and cached on disk; a fresh measurement is
taken when any of those change. A step is timed as the scheduler will see it: one target verify
forward of B tokens spread over R = ceil(B / (γ+1)) requests at a representative context length,
plus the draft block for those R requests. Median of a few repeats per bucket.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time

import torch
from tqdm import tqdm

from .policy import SpsTable


def default_buckets(max_tokens: int) -> list:
    """Powers of two and their midpoints up to max_tokens (and max_tokens itself)."""
    out, b = [], 1
    while b < max_tokens:
        out += [b] + ([b + b // 2] if b >= 4 else [])
        b *= 2
    return sorted({x for x in out if x < max_tokens} | {max_tokens})


def cache_key(engine) -> str:
    with open(os.path.join(engine.path, "config.json"), "rb") as f:
        cfg_hash = hashlib.sha1(f.read()).hexdigest()[:12]
    dev = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    parts = [dev, torch.__version__, os.path.abspath(engine.path), cfg_hash,
             engine.runner.backend_name, str(engine.dtype), engine.kv_cache_dtype]
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(base, "dspark", "sps")


def _sync(engine):
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def measure(engine, buckets, context: int = 64, repeats: int = 5, progress: bool = True) -> list:
    """[[B, median ms], ...] for each bucket B."""
    runner, g = engine.runner, max(engine.cfg.dspark_block_size, 1)
    cache = getattr(engine, "cache", None)
    rows = []
    for B in tqdm(buckets, desc="profiling SPS(B)", unit="bucket", disable=not progress):
        R = min(-(-B // (g + 1)), engine.scheduler.max_num_seqs)
        states = [runner.new_states() for _ in range(R)]
        handles = [s[0] for s in states]
        if cache is not None:                            # paged: requests are cache handles
            handles = [("sps-profile", B, r) for r in range(R)]
            for h in handles:
                cache.add_request(h)
                cache.reserve(h, context + B)
        ctx = [[(7 * i + 3 * r) % engine.cfg.vocab_size for i in range(context)] for r in range(R)]
        runner.target_forward([(h, 0, c) for h, c in zip(handles, ctx)])   # warm state
        sizes = [B // R + (1 if r < B % R else 0) for r in range(R)]
        items = [(h, context, c[:n]) for h, c, n in zip(handles, ctx, sizes)]
        times = []
        for _ in range(repeats + 1):                     # first run is a warm-up
            if cache is not None:
                for h in handles:
                    cache.truncate(h, context)           # each repeat re-verifies the same block
            _sync(engine)
            t0 = time.perf_counter()
            runner.target_forward(items)
            if engine.drafter is not None:
                runner.draft_blocks_for_profile(states, context)
            _sync(engine)
            times.append(1e3 * (time.perf_counter() - t0))
        if cache is not None:
            for h in handles:
                cache.free(h)
        rows.append([B, statistics.median(times[1:])])
    return rows


def load_or_profile(engine, max_tokens: int, progress: bool = True) -> SpsTable:
    path = os.path.join(cache_dir(), cache_key(engine) + ".json")
    if os.path.exists(path):
        with open(path) as f:
            return SpsTable.from_ms(json.load(f)["points"])
    points = measure(engine, default_buckets(max_tokens), progress=progress)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"points": points, "model": engine.path, "device": str(engine.device)}, f)
    return SpsTable.from_ms(points)
