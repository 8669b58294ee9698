"""Throughput profile SPS(B): measured engine step time at B verify tokens (spec §6.4).

A step is timed as the engine serves it: one target verify forward of R requests that each feed
the same q tokens (q = γ+1 from B >= γ+1 on, so the step is uniform and replays the target's
CUDA graph where the runner has one), plus the draft pass for those R requests, at a warm
context. Median of a few repeats per bucket; on CUDA the first run of a bucket is a warm-up
(Triton compiles, graph captures) and is not timed.

Where the runner pads every round to one width (`runner.uniform_verify`: the graph path), the
profile is a grid instead (`SpsGrid`): every request bucket R at every width q = 1..γ+1, so a
round of many requests at a narrow width is priced by its own shape, not by its token count.

The profile is sized to the cache it runs on: its R requests never exceed max_num_seqs, the free
state slots and pages, and one forward never exceeds the cache's staging area; the warm-state
prefill is chunked by the scheduler's token budget. When the cache cannot hold every request at
the profile context, fewer (or shorter) requests are measured, the table extrapolates past the
largest bucket (SpsTable), and `ProfilePlan.note` says so (printed, and warned once).

Cached on disk per (device, torch, model, backend, dtype, KV dtype, runner graph settings, plan);
a fresh measurement is taken when any of those change. XDG_CACHE_HOME moves the cache.
"""
from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
import warnings
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .policy import SpsTable
from .sps_grid import SpsGrid

# warm context of every profiled request (tokens); on CPU the warm-up prefill of up to
# max_num_seqs requests would dominate the profile's cost, and a CPU step's time hardly depends
# on a short context
PROFILE_CONTEXT = {"cuda": 64, "cpu": 16}


def default_buckets(max_tokens: int, midpoints: bool = True) -> list:
    """Powers of two (and their midpoints) up to max_tokens, and max_tokens itself."""
    out, b = [], 1
    while b < max_tokens:
        out += [b] + ([b + b // 2] if b >= 4 and midpoints else [])
        b *= 2
    return sorted({x for x in out if x < max_tokens} | {max_tokens})


@dataclass
class ProfilePlan:
    """What the profile measures: steps[i] = (B, R, q) with B = R * q verify tokens."""
    steps: list
    context: int
    requests: int             # warm requests held during the profile (the largest R)
    note: str = ""            # why the plan is smaller than asked, or ""
    grid: bool = False        # every request bucket at every width (SpsGrid)

    @property
    def buckets(self) -> list:
        return [b for b, _, _ in self.steps]


def _gamma(engine) -> int:
    d = getattr(engine, "drafter", None)
    return int(getattr(d, "gamma", 0) or engine.cfg.dspark_block_size or 1)


def plan_profile(engine, max_tokens: int, context: int | None = None,
                 midpoints: bool | None = None, grid: bool = False) -> ProfilePlan:
    """The (B, R, q) steps that fit `engine`'s cache and scheduler, up to max_tokens verify
    tokens (R <= ceil(max_tokens / (γ+1)) requests). Bucket midpoints by default on CUDA only
    (on CPU a step costs about its token count: fewer buckets keep the profile cheap).
    grid: every request bucket at every q = 1..γ+1 (SpsGrid's points)."""
    if midpoints is None:
        midpoints = engine.device.type == "cuda"
    if context is None:
        context = PROFILE_CONTEXT.get(engine.device.type, PROFILE_CONTEXT["cuda"])
    g = max(_gamma(engine), 1)
    q_full = g + 1
    cache = getattr(engine, "cache", None)
    max_seqs = engine.scheduler.max_num_seqs
    want = max(1, -(-max_tokens // q_full))          # requests the largest bucket asks for
    limit_model = engine.cfg.max_position_embeddings
    notes = []

    def fits(ctx: int) -> int:
        r = min(max_seqs, want)
        if cache is not None:
            pages = -(-(ctx + q_full) // cache.block_size)
            r = min(r, cache.num_free_slots, cache.num_free_pages // pages,
                    _staging(cache) // q_full)
        return r

    context = max(1, min(context, limit_model - q_full - 1))
    if cache is not None:
        context = max(1, min(context, cache.num_blocks * cache.block_size - q_full))
    best_ctx, best_r = context, fits(context)
    ctx = context
    while best_r < want and ctx > 8:                 # a shorter context may fit more requests
        ctx //= 2
        if fits(ctx) > best_r:
            best_ctx, best_r = ctx, fits(ctx)
    if best_r < 1:
        raise ValueError(f"the KV cache cannot hold even one {best_ctx + q_full}-token request "
                         f"for the SPS profile; raise num_kv_blocks / kv_cache_memory, or pass "
                         f"sps_table=[[B, ms], ...]")
    if best_ctx < context:
        notes.append(f"context {best_ctx} instead of {context} tokens (pages)")
    if best_r < want:
        notes.append(f"{best_r} requests instead of {want} (cache slots / pages / staging "
                     f"area); SPS past B={best_r * q_full} is extrapolated")
    # below one full block: one request feeding b tokens; from there on R requests feeding
    # γ+1 each, R over the powers of two (the graphs' batch buckets), their midpoints, and R max
    if grid:
        steps = [(r * q, r, q) for r in default_buckets(best_r, midpoints)
                 for q in range(1, q_full + 1)]
        return ProfilePlan(steps, best_ctx, best_r, "; ".join(notes), grid=True)
    steps = {b: (b, 1, b) for b in default_buckets(q_full, midpoints) if b < q_full}
    for r in default_buckets(best_r, midpoints):
        steps[r * q_full] = (r * q_full, r, q_full)
    return ProfilePlan(sorted(steps.values()), best_ctx, best_r, "; ".join(notes))


def _staging(cache) -> int:
    """Most tokens one forward may carry on this cache (unbounded where it has no limit)."""
    return int(getattr(cache, "max_batch_tokens", 1 << 30))


def _graph_settings(runner) -> str:
    """What of the runner's CUDA-graph setup changes a step's time."""
    parts = []
    tg = getattr(runner, "target_graphs", None)
    if tg is not None:
        parts.append(f"target:{type(tg).__name__}:{tuple(getattr(tg, 'q_lens', ()))}:"
                     f"{getattr(tg, 'batch_buckets', [None])[-1]}")
    dp = getattr(runner, "draft_pass", None)
    parts.append(f"draft:{bool(getattr(dp, 'cuda_graphs', False))}")
    if getattr(runner, "deterministic", False):     # one-token forwards: another cost curve
        parts.append("deterministic")
    return ",".join(parts)


def cache_key(engine, plan: ProfilePlan | None = None) -> str:
    with open(os.path.join(engine.path, "config.json"), "rb") as f:
        cfg_hash = hashlib.sha1(f.read()).hexdigest()[:12]
    dev = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    parts = [dev, torch.__version__, os.path.abspath(engine.path), cfg_hash,
             engine.runner.backend_name, str(engine.dtype), engine.kv_cache_dtype,
             str(getattr(engine, "weight_format", "")), _graph_settings(engine.runner),
             f"seqs={engine.scheduler.max_num_seqs}"]
    if plan is not None:
        parts.append(f"ctx={plan.context}:{plan.steps}:{'grid' if plan.grid else 'tokens'}")
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    return os.path.join(base, "dspark", "sps")


def _sync(engine):
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _warm_prefill(engine, handles, ctx, chunk: int):
    """Prefill every request's context in forwards of at most `chunk` tokens."""
    pending = [[h, 0, c] for h, c in zip(handles, ctx)]
    while pending:
        items, room = [], chunk
        for p in pending:
            if room <= 0:
                break
            h, start, c = p
            n = min(len(c) - start, room)
            items.append((h, start, c[start:start + n]))
            p[1] += n
            room -= n
        engine.runner.target_forward(items)
        pending = [p for p in pending if p[1] < len(p[2])]


def measure(engine, plan: ProfilePlan, repeats: int | None = None, progress: bool = True) -> list:
    """[[B, R, q, median ms], ...] for each step (B, R, q) of `plan`."""
    runner, cache = engine.runner, getattr(engine, "cache", None)
    on_gpu = engine.device.type == "cuda"
    repeats = repeats or (5 if on_gpu else 1)
    warm = 1 if on_gpu else 0            # CPU steps have no compile / capture to pay first
    C, R = plan.context, plan.requests
    states = [runner.new_states() for _ in range(R)]
    handles = [s[0] for s in states]
    q_max = max(q for _, _, q in plan.steps)
    vocab = engine.cfg.vocab_size
    if cache is not None:                                # paged: requests are cache handles
        handles = [("sps-profile", r) for r in range(R)]
        for h in handles:
            cache.add_request(h)
            cache.reserve(h, C + q_max)
    rows = []
    try:
        ctx = [[(7 * i + 3 * r) % vocab for i in range(C)] for r in range(R)]
        chunk = engine.scheduler.max_tokens
        if cache is not None:
            chunk = min(chunk, _staging(cache))
        _warm_prefill(engine, handles, ctx, chunk)
        for B, r, q in tqdm(plan.steps, desc="profiling SPS", unit="step shape",
                            disable=not progress):
            items = [(h, C, [(5 * j + i) % vocab for j in range(q)])
                     for i, h in enumerate(handles[:r])]
            times = []
            for _ in range(warm + repeats):
                if cache is not None:
                    for h in handles[:r]:
                        cache.truncate(h, C)             # each repeat re-verifies the same block
                        cache.reserve(h, C + q)
                _sync(engine)
                t0 = time.perf_counter()
                runner.target_forward(items)
                if engine.drafter is not None:
                    runner.draft_blocks_for_profile(states[:r], C)
                _sync(engine)
                times.append(1e3 * (time.perf_counter() - t0))
            rows.append([B, r, q, statistics.median(times[warm:])])
    finally:
        if cache is not None:
            for h in handles:
                cache.free(h)
    return rows


def sps_table(engine, override, max_num_seqs: int, progress: bool) -> SpsTable:
    """SPS(B) from the user's [[B, ms], ...] override, the on-disk cache, or a fresh profile of
    up to max_num_seqs requests' verify blocks."""
    if isinstance(override, SpsTable):
        return override
    if override is not None:
        rows = [list(r) for r in override]
        if rows and all(len(r) == 3 for r in rows):        # [[R, q, ms], ...]: round shapes
            return SpsGrid(rows)
        if not all(len(r) == 2 for r in rows):
            raise ValueError("sps_table must be [[B, ms], ...] (step time by verify tokens) or "
                             "[[R, q, ms], ...] (round time by requests and tokens each, as "
                             f"`python -m dspark.bench --json` saves it), got {rows[:3]}...")
        return SpsTable.from_ms(rows)
    return load_or_profile(engine, max_num_seqs * (engine.cfg.dspark_block_size + 1), progress,
                           grid=bool(getattr(engine.runner, "uniform_verify", False)))


def _table(data: dict) -> SpsTable:
    if "grid" in data:
        return SpsGrid(data["grid"])
    return SpsTable.from_ms(data["points"])


def load_or_profile(engine, max_tokens: int, progress: bool = True,
                    grid: bool = False) -> SpsTable:
    """SPS up to max_tokens verify tokens (grid: an SpsGrid of the round shapes): from the
    on-disk cache, else measured (and saved)."""
    plan = plan_profile(engine, max_tokens, grid=grid)
    if plan.note:
        msg = f"SPS profile sized to the KV cache: {plan.note}"
        warnings.warn(msg)
        if progress:
            print(msg)
    path = os.path.join(cache_dir(), cache_key(engine, plan) + ".json")
    try:
        with open(path) as f:
            return _table(json.load(f))
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError) as e:     # not a profile we wrote: measure again
        warnings.warn(f"ignoring the unreadable SPS profile {path} ({e}); measuring a new one")
    rows = measure(engine, plan, progress=progress)
    data = ({"grid": [[r, q, ms] for _, r, q, ms in rows]} if plan.grid
            else {"points": [[b, ms] for b, _, _, ms in rows]})
    table = _table(data)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    # written whole under a temporary name, then renamed: another process starting at the same
    # time reads either no file or a complete one
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({**data, "model": engine.path, "device": str(engine.device),
                   "context": plan.context, "steps": plan.steps, "note": plan.note}, f)
    os.replace(tmp, path)
    return table
