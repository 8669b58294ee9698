"""Batch-1 decode of a V4-Flash-width checkpoint: (a) step time vs the HBM roofline, (b) end-to-end
tokens/s vs HF transformers' DeepseekV4ForCausalLM on the same weights.

Checkpoint: `--model DIR`, or a random one in the official layout written by this script (the
tensors of `python -m dspark.tools.make_checkpoint --preset flash --layers 4 --dtype fp8
--fp4-experts`, byte for byte; written shard-parallel with --workers processes into --workdir and
reused when it is already there). The engine loads it with `weight_format="quantized"`: FP8
projections and packed-FP4 routed experts stay quantized on the device and run through the
Triton `fp8_linear` / `fp4_moe` kernels on CUDA (torch de-quantize-then-linear on CPU); KV cache
`fp8_ds_mla` pages with the Triton attention backend; speculation off.

(a) Decode step vs roofline. Per context length L: one request with an L-token random prompt,
prefilled in one chunk; then --warmup + --iters `Engine.step()` calls, each one decode step (target
forward of 1 token, greedy accept, commit), timed with a device sync before and after; the
median of the last --iters is the step time (the target forward alone is timed too, by a
synchronising wrapper; the first context's prefill time includes Triton compilation).
Bytes one step must read:
  weights  every target tensor once, except: routed experts only the top-k (k = num_experts_per_tok
           distinct experts per layer at batch 1: k/E of each layer's expert bytes), the
           embedding and the hash-routing table one row each. Sizes as held in memory (FP8 codes
           + e8m0 scales, packed FP4 + scales, bf16 / fp32 as loaded).
  KV       per layer: the SWA window (min(L+1, window) records), CSA (ratio 4): every indexer key
           (132 B) + the top-k (index_topk) selected compressed records, HCA: every compressed
           record; records are 584 B (fp8_ds_mla). The small fp32 compressor rings are left out.
Roofline time = bytes / copy bandwidth, the bandwidth measured here with a large device-to-device
copy (2 x bytes / time; the H200 anchor is ~4.3 TB/s). % of roofline = roofline time / step time
(issue target: >= 60%).

(b) End to end. One --prompt-len-token random prompt, --new-tokens greedy tokens (EOS ignored),
batch 1, each side warmed up first; tok/s = new tokens / wall time of the whole generate call
(prefill included), and decode-only tok/s = (N - 1) / (time(N tokens) - time(1 token)).
HF: `DeepseekV4ForCausalLM` built from config.json (quantization_config dropped) in --hf-dtype
(bf16 on CUDA) and filled from the same checkpoint, every FP8 / FP4 tensor de-quantized on the
device with dspark.formats.quant (bit-identical to the NumPy formulas of tests/hf_oracle.py, see
tests/test_quant.py), routed experts merged into HF's gate_up_proj / down_proj exactly like
transformers' own conversion mapping (checked against from_pretrained in
tests/test_bench_decode_v4.py). The fill is strict: every HF parameter / persistent buffer must be
written exactly once. Also reported: whether the greedy tokens agree (leading run of equal tokens;
ours uses the fp8 KV cache, HF an unquantized one, so a late divergence on random weights is
expected numerics, an early one is worth a look).

    python benchmarks/bench_decode_v4.py --json benchmarks/results/bench_decode_v4_h200.json
    python benchmarks/bench_decode_v4.py --preset tiny          # CPU smoke run (seconds)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import multiprocessing as mp
import os
import re
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

from dspark.models.deepseek_v4.weights import (scale_name, stored_tensors,  # noqa: E402
                                               tensor_inventory)
from dspark.bench.roofline import kv_bytes, target_bytes  # noqa: E402
from dspark.tools import make_checkpoint as mc  # noqa: E402

H200_COPY_TBPS = 4.3
TARGET_ROOFLINE_PCT = 60.0
TARGET_HF_RATIO = 5.0
PRESET_DEFAULTS = {   # contexts, new tokens, prompt length
    "flash": ("128,1024,4096", 64, 128),
    "pro": ("128,1024,4096", 64, 128),
    "tiny": ("16,64", 16, 16),
}


# ---- checkpoint ---------------------------------------------------------------------------------

def _write_shard(job) -> dict:
    """Worker: generate and save one shard exactly as make_checkpoint does; {key: file name}."""
    out, fname, names, cfg, seed = job
    torch.set_num_threads(1)
    from safetensors.torch import save_file
    inv = tensor_inventory(cfg)
    tensors = {}
    for name in names:
        tensors.update(mc.generate_tensor(name, inv[name], cfg, seed))
    save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
    return {k: fname for k in tensors}


def prepare_checkpoint(model: str | None, preset: str, layers: int, workdir: str | None,
                       workers: int, dspark: bool = False):
    """(path, cfg, info): the user's checkpoint, or a generated FP8 + FP4 one under /tmp (reused
    when its config matches; dspark: with the DSpark draft stages). Call before anything
    touches CUDA: the writers are forked."""
    if model:
        from dspark.config import ModelConfig
        return model, ModelConfig.from_path(model), {"path": model, "generated": False}
    path = workdir or os.path.join("/tmp", "dspark_bench",
                                   f"{preset}-{layers}L-fp8-fp4" + ("-dspark" if dspark else ""))
    cfg, secs, reused = write_checkpoint(path, preset, layers, workers=workers, dspark=dspark)
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"checkpoint {path}: {_gb(size):.2f} GB, "
          + ("reused" if reused else f"written in {secs:.1f} s by {workers} workers"), flush=True)
    return path, cfg, {"path": path, "generated": not reused, "write_s": secs, "bytes": size}


def write_checkpoint(out: str, preset: str, layers: int | None, seed: int = 0,
                     workers: int = 8, shard_bytes: int | None = None,
                     dspark: bool = False) -> tuple:
    """The FP8 + FP4-expert random checkpoint of make_checkpoint (same tensors, same bytes), shards
    generated by `workers` processes at once. Reuses `out` when its config.json already matches.
    Returns (ModelConfig, seconds spent writing, reused?)."""
    cfg = mc.preset_config(preset, layers, "fp8", True, dspark)
    config_json = mc.hf_config(cfg)
    cfg_fn = os.path.join(out, "config.json")
    if os.path.exists(cfg_fn):
        with open(cfg_fn) as f:
            if json.load(f) == config_json:
                return cfg, 0.0, True
    t0 = time.perf_counter()
    inv = tensor_inventory(cfg)
    total = sum(st.nbytes for n, s in inv.items() for st in stored_tensors(n, s))
    if shard_bytes is None:   # ~2 shards per worker, 64 MiB .. 2 GiB (tiny: a quarter of the total)
        shard_bytes = min(2 << 30, max(min(64 << 20, math.ceil(total / 4)),
                                       math.ceil(total / (2 * max(workers, 1)))))
    shards = mc._plan_shards(inv, shard_bytes)
    os.makedirs(out, exist_ok=True)
    if os.path.exists(cfg_fn):
        os.remove(cfg_fn)           # written last: its presence marks a complete checkpoint
    jobs = [(out, f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors", names, cfg, seed)
            for k, names in enumerate(shards)]
    weight_map = {}
    if workers > 1 and len(jobs) > 1:
        # fork: no CUDA context exists yet in this process (the checkpoint comes first)
        ctx = mp.get_context("fork" if sys.platform.startswith("linux") else "spawn")
        with ctx.Pool(min(workers, len(jobs))) as pool:
            for m in pool.imap_unordered(_write_shard, jobs):
                weight_map.update(m)
    else:
        for job in jobs:
            weight_map.update(_write_shard(job))
    weight_map = dict(sorted(weight_map.items()))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(cfg_fn, "w") as f:
        json.dump(config_json, f, indent=2)
    return cfg, time.perf_counter() - t0, False


# ---- bytes a decode step reads ----------------------------------------------------------------------

def hf_model_bytes(cfg, dtype: torch.dtype) -> int:
    """Bytes of the HF model's weights: every non-mtp tensor at its logical shape, de-quantized
    FP8 / FP4 / bf16 tensors in `dtype`, fp32 parameters fp32, the hash table int64."""
    elt = torch.empty((), dtype=dtype).element_size()
    size = {"fp32": 4, "int64": 8}
    return sum(math.prod(s.shape) * size.get(s.kind, elt)
               for n, s in tensor_inventory(cfg).items() if not n.startswith("mtp."))


# ---- timing --------------------------------------------------------------------------------------

def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, nbytes: int | None = None, iters: int = 20) -> dict:
    """Device-to-device copy bandwidth: 2 * nbytes (read + write) / median copy time."""
    dev = torch.device(device)
    nbytes = nbytes or ((2 << 30) if dev.type == "cuda" else (256 << 20))
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    del src, dst
    return {"bytes": nbytes, "median_s": t, "tbps": 2 * nbytes / t / 1e12}


def _random_prompt(n: int, vocab: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()   # no BOS (0) / EOS (1)


def _warm_decode_graph(graphs):
    """The captured batch-1 decode graph (last bucket), replayed 3 times; None without one."""
    keys = [k for k in getattr(graphs, "graphs", {}) if k[0] == 1 and k[1] == 1]
    if not keys:
        return None
    g = graphs.graphs[keys[-1]]
    for _ in range(3):
        g.replay()
    return g


def _replay_device_ms(graphs, n: int):
    """Device time of one batch-1 decode forward: its captured graph replayed n times back to
    back between two events (the host enqueues faster than the device runs them, so no host
    time is in it). Each replay redoes the last step (same token, same position: the same cache
    rows rewritten with the same values). None without captured graphs."""
    g = _warm_decode_graph(graphs)
    if g is None:
        return None
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        g.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


def replay_timeline(graphs, n: int = 5, top: int = 12) -> dict | None:
    """Where the batch-1 decode graph's device time goes, kernel by kernel: the graph replayed
    n times back to back under the profiler, each replay's kernels (start, duration, stream) in
    start order. Per replay: its span, the time some kernel runs (busy), the time none does
    (idle: launch gaps and dependency waits the side streams do not fill), the kernel time per
    stream, and the longest idle gaps with the kernels around them, to show which links of the
    chain cost more than their kernels. None without captured graphs."""
    from torch.profiler import ProfilerActivity, profile
    g = _warm_decode_graph(graphs)
    if g is None:
        return None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            g.replay()
        torch.cuda.synchronize()
    ev = [e for e in prof.profiler.kineto_results.events()
          if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0
          and "memcpy" not in e.name().lower() and "memset" not in e.name().lower()]
    ev.sort(key=lambda e: e.start_ns())
    if not ev or len(ev) % n:
        return {"error": f"{len(ev)} kernels in {n} replays: not a whole number per replay"}
    per = len(ev) // n
    replays = []
    for r in range(n):
        ks = ev[r * per:(r + 1) * per]
        t0 = ks[0].start_ns()
        busy, idle, gaps, end = 0, 0, [], t0
        for i, e in enumerate(ks):
            s, f = e.start_ns(), e.start_ns() + e.duration_ns()
            if s > end:
                idle += s - end
                gaps.append((s - end, i))
            busy += max(0, f - max(s, end))
            end = max(end, f)
        streams: dict = {}
        for e in ks:
            streams[e.device_resource_id()] = streams.get(e.device_resource_id(), 0) + e.duration_ns()
        replays.append({"span_us": (end - t0) / 1e3, "busy_us": busy / 1e3, "idle_us": idle / 1e3,
                        "kernel_sum_us": sum(e.duration_ns() for e in ks) / 1e3,
                        "stream_us": {str(k): v / 1e3 for k, v in sorted(streams.items())},
                        "gaps": sorted(gaps, reverse=True), "kernels": ks, "t0": t0})
    best = min(replays, key=lambda r: r["span_us"])
    ks, t0 = best.pop("kernels"), best.pop("t0")
    short = lambda s: s if len(s) <= 40 else s[:37] + "..."            # noqa: E731
    best["top_gaps"] = [{"gap_us": gap / 1e3, "after": short(ks[i - 1].name()) if i else "",
                         "before": short(ks[i].name()), "index": i}
                        for gap, i in best.pop("gaps")[:top]]
    for r in replays:
        r.pop("kernels", None), r.pop("gaps", None), r.pop("t0", None)
    return {"replays": n, "kernels_per_replay": per,
            "median_span_us": statistics.median(r["span_us"] for r in replays),
            "best": best,
            "sequence": [{"name": short(e.name()), "stream": e.device_resource_id(),
                          "start_us": round((e.start_ns() - t0) / 1e3, 2),
                          "dur_us": round(e.duration_ns() / 1e3, 2)} for e in ks]}


def print_timeline(tl: dict) -> None:
    if "error" in tl:
        print(f"timeline: {tl['error']}")
        return
    b = tl["best"]
    print(f"\n(d) decode graph timeline: {tl['kernels_per_replay']} kernels per replay, span "
          f"{b['span_us']:.1f} us (median of {tl['replays']}: {tl['median_span_us']:.1f}), busy "
          f"{b['busy_us']:.1f} us, idle {b['idle_us']:.1f} us, kernel sum {b['kernel_sum_us']:.1f} us")
    print("    kernel us per stream: " + ", ".join(f"{k}: {v:.1f}" for k, v in b["stream_us"].items()))
    print(f"    {'idle gap us':>11}  between")
    for gp in b["top_gaps"]:
        print(f"    {gp['gap_us']:11.2f}  #{gp['index']} {gp['after']} -> {gp['before']}")


def decode_steps(eng, context: int, warmup: int, iters: int, timeline: int = 0) -> dict:
    """Prefill a `context`-token prompt, then time warmup + iters single decode steps (wall time
    of each `Engine.step()` call, no extra device sync: with overlapped decode a call launches
    the next round and commits the one before, so back-to-back calls measure the steady state),
    then iters more steps with the target forward timed alone (synchronised, which stalls the
    overlap, so separately)."""
    from dspark.bench.profile import PhaseTimer
    from dspark.sampling import SamplingParams

    dev = eng.device
    prompt = _random_prompt(context, eng.cfg.vocab_size, seed=context)
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=warmup + 2 * iters + 8,
                                                 ignore_eos=True))
    req = eng.requests[rid]
    fwd = []
    overlap = getattr(eng, "overlap", None)
    try:
        _sync(dev)
        t0 = time.perf_counter()
        while not req.output_ids:
            eng.step()
        _sync(dev)
        prefill_s = time.perf_counter() - t0
        graphs = getattr(eng.runner, "target_graphs", None)
        ahead0 = getattr(graphs, "plans_ahead_used", 0)
        rounds0 = getattr(overlap, "rounds", 0)
        steps, waits = [], []
        for _ in range(warmup + iters):
            n0 = len(req.output_ids)
            w0 = getattr(overlap, "wait_s", 0.0)
            t0 = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t0)
            waits.append(getattr(overlap, "wait_s", 0.0) - w0)
            assert len(req.output_ids) == n0 + 1, "a decode step must emit exactly one token"
        _sync(dev)
        ahead = getattr(graphs, "plans_ahead_used", 0) - ahead0
        rounds = getattr(overlap, "rounds", 0) - rounds0
        timer = PhaseTimer(dev)
        timer.wrap(eng.runner, "target_forward", "forward")
        timer.listeners.append(lambda ph, excl, incl: fwd.append(incl))
        try:
            for _ in range(iters):
                eng.step()
        finally:
            timer.unwrap()
        _sync(dev)
        replay_ms = _replay_device_ms(graphs, iters)
        tl = replay_timeline(graphs, timeline) if timeline and dev.type == "cuda" else None
    finally:
        eng.abort(rid)
    st = steps[warmup:]
    busy = [a - b for a, b in zip(steps[warmup:], waits[warmup:])]
    return {"context": context, "prefill_s": prefill_s, "step_ms": 1e3 * statistics.median(st),
            # overlapped decode: the host's own work per step (wall minus the read-back wait);
            # close to step_ms means the host, not the device, sets the pace
            "host_busy_ms": 1e3 * statistics.median(busy) if rounds else None,
            "step_min_ms": 1e3 * min(st), "forward_ms": 1e3 * statistics.median(fwd),
            # the batch-1 decode graph replayed back to back: device time per forward, no host
            "replay_ms": replay_ms,
            "steps": len(st),
            # steps whose host plan was computed during the step before (V4 target graphs)
            "plans_ahead_used": ahead,
            # steps launched before the previous one was read back (overlapped decode)
            "overlapped_rounds": rounds,
            **({"timeline": tl} if tl else {})}


# what a kernel (CUDA) or a leaf op (CPU) belongs to, first match wins
KERNEL_CATEGORIES = [
    ("attention", re.compile(r"sparse_mqa|flash|mla|attend|combine|paged_gqa", re.I)),
    ("indexer / top-k", re.compile(r"indexer|topk|sort", re.I)),
    ("fp4 MoE", re.compile(r"fp4|moe|expert", re.I)),
    ("fp8 GEMM", re.compile(r"fp8|e4m3|scaled_mm", re.I)),
    ("mHC", re.compile(r"mhc|hc_|sinkhorn", re.I)),
    ("cache write", re.compile(r"cache_write|quantize|write", re.I)),
    ("GEMM / GEMV (bf16)", re.compile(r"gemm|gemv|cutlass|xmma|cublas|aten::mm|aten::addmm|"
                                      r"aten::linear|aten::bmm|matmul", re.I)),
    ("copies", re.compile(r"copy|memcpy|memset|fill|aten::to|_to_copy|cat|index", re.I)),
]


def kernel_category(name: str) -> str:
    for cat, pat in KERNEL_CATEGORIES:
        if pat.search(name):
            return cat
    return "other elementwise / reductions"


def _profiled_decode(eng, steps: int, context: int, seed: int, warm_steps: int, profiler=None,
                     **profile_kw):
    """`profiler` (a context manager; default torch.profiler.profile(**profile_kw)) around
    `steps` batch-1 decode steps of one request with a `context`-token random prompt, after its
    prefill and `warm_steps` unprofiled steps (graph captures, kernel compiles); the request is
    aborted afterwards. Returns (the profiler, wall seconds of the profiled steps)."""
    from torch.profiler import profile

    from dspark.sampling import SamplingParams
    rid = eng.add_request(_random_prompt(context, eng.cfg.vocab_size, seed=seed),
                          SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
    req = eng.requests[rid]
    try:
        while not req.output_ids:
            eng.step()
        for _ in range(warm_steps):
            eng.step()
        _sync(eng.device)
        t0 = time.perf_counter()
        with (profiler if profiler is not None else profile(**profile_kw)) as prof:
            for _ in range(steps):
                eng.step()
            _sync(eng.device)
        wall = time.perf_counter() - t0
    finally:
        eng.abort(rid)
    return prof, wall


def kernel_profile(eng, steps: int, context: int = 128, top: int = 15) -> dict:
    """torch.profiler over `steps` batch-1 decode steps after a `context`-token prefill: device
    time per step by kernel and by category (CUDA; on CPU the leaf ops' self CPU time), so the
    gap to the roofline can be pinned on kernels."""
    from torch.profiler import ProfilerActivity
    cuda = eng.device.type == "cuda"
    prof, _ = _profiled_decode(eng, steps, context, seed=7, warm_steps=3,
                               activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU])
    per = {}
    for e in prof.key_averages():
        if cuda:
            us = getattr(e, "self_device_time_total", None)
            if us is None:
                us = getattr(e, "self_cuda_time_total", 0.0)
            if not us or e.key.startswith("aten::"):
                continue
        else:
            us = e.self_cpu_time_total
            if not us or not e.key.startswith("aten::"):
                continue
        per[e.key] = (us / steps, e.count / steps)
    rows = sorted(({"name": k, "category": kernel_category(k), "us_per_step": v[0],
                    "calls_per_step": v[1]} for k, v in per.items()),
                  key=lambda r: -r["us_per_step"])
    cats: dict = {}
    for r in rows:
        cats[r["category"]] = cats.get(r["category"], 0.0) + r["us_per_step"]
    return {"device": "cuda kernels" if cuda else "cpu ops (self time)", "steps": steps,
            "context": context, "total_us_per_step": sum(r["us_per_step"] for r in rows),
            "categories": dict(sorted(cats.items(), key=lambda kv: -kv[1])), "top": rows[:top],
            "ops": op_profile(eng, steps, context, top)}


def _source_frame(event) -> str:
    """The innermost dspark/ (or benchmarks/) Python frame above a profiled op: from its own
    stack when the profiler attached one, else from its ancestors (newer torch records Python
    frames as parent events named "path(line): function")."""
    ours = lambda f: "dspark/" in f or "benchmarks/" in f      # noqa: E731
    e = event
    while e is not None:
        hit = next((f for f in (e.stack or []) if ours(f)), None)
        if hit is None and ours(e.name):
            hit = e.name
        if hit is not None:
            return hit
        e = e.cpu_parent
    return "?"


def op_profile(eng, steps: int, context: int = 128, top: int = 15) -> list:
    """Which source lines launch the costly work: the same decode steps run eagerly (the V4
    target graphs, if any, switched off for the pass: a replay hides the launching ops), aten
    ops grouped by input shapes and by the innermost dspark/ frame of their Python stack, sorted
    by device time (CPU: self CPU time)."""
    from torch.profiler import ProfilerActivity
    cuda = eng.device.type == "cuda"
    graphs, eng.runner.target_graphs = getattr(eng.runner, "target_graphs", None), None
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        prof, _ = _profiled_decode(eng, steps, context, seed=8, warm_steps=1, activities=acts,
                                   record_shapes=True, with_stack=True)
    finally:
        if graphs is not None:
            eng.runner.target_graphs = graphs
    per: dict = {}
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        us = (getattr(e, "self_device_time_total", None) or 0.0) if cuda else e.self_cpu_time_total
        if not us:
            continue
        frame = _source_frame(e)
        key = (e.name, str(e.input_shapes)[:80], frame.split("site-packages/")[-1][-70:])
        n, t = per.get(key, (0, 0.0))
        per[key] = (n + 1, t + us)
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])[:top]
    return [{"op": k[0], "shapes": k[1], "source": k[2], "calls_per_step": n / steps,
             "us_per_step": us / steps} for k, (n, us) in rows]


def host_profile(eng, steps: int, context: int = 128, top: int = 25) -> dict:
    """cProfile over `steps` batch-1 decode steps (after a prefill and warm steps): where the
    host's time per step goes (Python, launches, graph replays, and the waits on the device,
    which show up in the synchronising calls). The gap between a step and its kernels' device
    time is host work the GPU waits for."""
    import cProfile
    import pstats

    pr, wall = _profiled_decode(eng, steps, context, seed=9, warm_steps=3,
                                profiler=cProfile.Profile())
    st = pstats.Stats(pr)
    rows = []
    for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
        where = f"{fn.split('site-packages/')[-1].split('/work/')[-1][-48:]}:{line}({name})"
        rows.append({"function": where, "calls_per_step": nc / steps,
                     "self_us_per_step": 1e6 * tt / steps, "cum_us_per_step": 1e6 * ct / steps})
    by_self = sorted(rows, key=lambda r: -r["self_us_per_step"])[:top]
    by_cum = sorted(rows, key=lambda r: -r["cum_us_per_step"])[:top]
    return {"steps": steps, "context": context, "wall_us_per_step": 1e6 * wall / steps,
            "by_self": by_self, "by_cumulative": by_cum}


def print_host_profile(hp: dict) -> None:
    print(f"\n(d) host time of a decode step (cProfile, {hp['steps']} steps): "
          f"{hp['wall_us_per_step']:.0f} us per step under the profiler")
    for key, title in (("by_self", "self"), ("by_cumulative", "cumulative")):
        print(f"  by {title} time:")
        for r in hp[key]:
            print(f"  {r['self_us_per_step']:>8.1f} self {r['cum_us_per_step']:>8.1f} cum "
                  f"x{r['calls_per_step']:<6.1f} {r['function']}")


def print_kernel_profile(kp: dict) -> None:
    tot = max(kp["total_us_per_step"], 1e-9)
    print(f"\n(c) where a decode step's time goes — {kp['device']}, {kp['steps']} steps after a "
          f"{kp['context']}-token prefill: {tot / 1e3:.3f} ms of kernel time per step (durations "
          f"summed: kernels of side-stream branches overlap, so this can exceed `dev ms`)")
    for cat, us in kp["categories"].items():
        print(f"  {cat:<32} {us:>9.1f} us  {100 * us / tot:5.1f}%")
    hdr = f"  {'kernel':<70} {'category':<22} {'us/step':>8} {'calls':>6}"
    print(hdr)
    for r in kp["top"]:
        print(f"  {r['name'][:70]:<70} {r['category'][:22]:<22} {r['us_per_step']:>8.1f} "
              f"{r['calls_per_step']:>6.1f}")
    if kp.get("ops"):
        print("  ops by device time (eager pass), with shapes and the dspark source line:")
        for r in kp["ops"]:
            print(f"  {r['us_per_step']:>8.1f} us x{r['calls_per_step']:<5.1f} {r['op'][:22]:<22} "
                  f"{r['shapes'][:50]:<50} {r['source']}")


# ---- HF model ------------------------------------------------------------------------------------

# transformers' conversion mapping for model_type "deepseek_v4" (official name -> HF name), in
# its order; the merged routed experts are handled in hf_target()
_HF_RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."),
    (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"),
    (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"),
    (r"\.hc_attn_scale", ".attn_hc.scale"), (r"\.hc_ffn_fn", ".ffn_hc.fn"),
    (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"),
    (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
    (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
    (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
)]
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.weight$")


def hf_target(name: str, inter: int) -> tuple:
    """(HF state-dict key, index into it or None) of an official tensor name. Routed experts are
    merged like transformers does: gate_up_proj [E, 2I, D] = experts' w1 rows then w3 rows,
    down_proj [E, D, I] = w2."""
    m = _EXPERT.match(name)
    if m:
        layer, e, w = int(m.group(1)), int(m.group(2)), m.group(3)
        base = f"model.layers.{layer}.mlp.experts."
        if w == "w2":
            return base + "down_proj", (e,)
        rows = slice(0, inter) if w == "w1" else slice(inter, 2 * inter)
        return base + "gate_up_proj", (e, rows)
    for pat, rep in _HF_RENAMES:
        name = pat.sub(rep, name)
    return (name if name.startswith("lm_head.") else "model." + name), None


def _dequant(kind, w, s, dtype):
    from dspark.formats.quant import dequant_fp4_experts, dequant_fp8_blocks
    return dequant_fp8_blocks(w, s, dtype) if kind == "fp8" else dequant_fp4_experts(w, s, dtype)


def build_hf_model(ckpt: str, device, dtype: torch.dtype):
    """transformers' DeepseekV4ForCausalLM holding the checkpoint's weights de-quantized to
    `dtype` (fp32 parameters stay fp32, as from_pretrained keeps them), built directly on
    `device` and filled tensor by tensor (no de-quantized copy of the checkpoint is ever held)."""
    from safetensors import safe_open
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from dspark.config import ModelConfig

    with open(os.path.join(ckpt, "config.json")) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_dict(raw)            # storage kinds come from quantization_config
    raw.pop("quantization_config", None)        # ... which HF must not see: weights arrive de-quantized
    with torch.device(device):
        model = DeepseekV4ForCausalLM._from_config(DeepseekV4Config(**raw), dtype=dtype)
    model.eval()
    dest = model.state_dict(keep_vars=True)     # params + persistent buffers, the live tensors
    written = {k: 0 for k in dest}
    inv = {n: s for n, s in tensor_inventory(cfg).items() if not n.startswith("mtp.")}
    owner = {st.name: n for n, s in inv.items() for st in stored_tensors(n, s)}
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        wmap = json.load(f)["weight_map"]
    by_file: dict = {}
    for key, fn in wmap.items():
        if key.removeprefix("model.") in owner:
            by_file.setdefault(fn, []).append(key)
    dev = torch.device(device)
    open_dev = f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}" \
        if dev.type == "cuda" else "cpu"
    pending, unknown = {}, []
    with torch.no_grad():
        for fn in sorted(by_file):
            with safe_open(os.path.join(ckpt, fn), framework="pt", device=open_dev) as f:
                for key in by_file[fn]:
                    stored = key.removeprefix("model.")
                    name = owner[stored]
                    kind = inv[name].kind
                    t = f.get_tensor(key)
                    if kind in ("fp8", "fp4"):
                        pending[stored] = t
                        if name not in pending or scale_name(name) not in pending:
                            continue
                        t = _dequant(kind, pending.pop(name), pending.pop(scale_name(name)), dtype)
                    target, index = hf_target(name, cfg.moe_intermediate_size)
                    if target not in dest:
                        unknown.append(f"{name} -> {target}")
                        continue
                    view = dest[target] if index is None else dest[target][index]
                    if tuple(view.shape) != tuple(t.shape):
                        raise RuntimeError(f"HF {target}{'' if index is None else list(index)}: "
                                           f"shape {list(view.shape)}, checkpoint {name}: "
                                           f"{list(t.shape)}")
                    view.copy_(t)
                    written[target] += t.numel()
                    del t
    bad = [k for k, n in written.items() if n != dest[k].numel()]
    if unknown or bad or pending:
        raise RuntimeError(
            "could not map the checkpoint onto this transformers version's DeepseekV4ForCausalLM "
            f"(the name mapping in benchmarks/bench_decode_v4.py follows transformers 5.24): "
            f"{len(unknown)} checkpoint tensors without an HF target {unknown[:5]}, "
            f"{len(bad)} HF tensors not filled exactly once {bad[:5]}, "
            f"{len(pending)} quantized tensors without their partner {list(pending)[:5]}")
    return model


def hf_generate(model, prompt: list, n: int, device) -> tuple:
    """(new token ids, seconds) of HF greedy generation of exactly n tokens (EOS ignored)."""
    from transformers import GenerationConfig
    gc_ = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           eos_token_id=None, pad_token_id=0)
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, generation_config=gc_, attention_mask=torch.ones_like(ids))
        _sync(device)
    return out[0, len(prompt):].tolist(), time.perf_counter() - t0


def ours_generate(eng, prompt: list, n: int) -> tuple:
    from dspark.sampling import SamplingParams
    _sync(eng.device)
    t0 = time.perf_counter()
    out = eng.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    _sync(eng.device)
    return list(out.token_ids), time.perf_counter() - t0


def _leading_agreement(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- main ----------------------------------------------------------------------------------------

def _device_info(device) -> dict:
    dev = torch.device(device)
    info = {"type": dev.type, "torch": torch.__version__}
    if dev.type == "cuda":
        info["name"] = torch.cuda.get_device_name()
        info["memory_gb"] = torch.cuda.get_device_properties(dev).total_memory / 1e9
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        info["name"] = "cpu"
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def _kernel_report(eng, device) -> dict:
    """Which implementations the engine runs (kept in a function: no module references survive)."""
    from dspark.models.qlinear import QuantLinear, QuantMoE
    mods = list(eng.model.modules())
    return {
        "attention_backend": eng.runner.backend_name,
        "quant_linear": {k: sum(1 for m in mods if isinstance(m, QuantLinear) and m.kind == k)
                         for k in ("fp8", "fp4")},
        "quant_moe_layers": sum(1 for m in mods if isinstance(m, QuantMoE)),
        "grouped_fp4_moe": bool(QuantMoE.grouped_max_pairs),
        "target_cuda_graphs": getattr(eng.runner, "target_graphs", None) is not None,
        "gemm_backend": "triton" if torch.device(device).type == "cuda"
        else "torch (de-quantize + F.linear)",
    }


def _gb(b):
    return b / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(mc.PRESETS), default="flash",
                    help="checkpoint widths when generating one (tiny = CPU smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="backbone layers (flash: 4)")
    ap.add_argument("--model", default=None, help="use this checkpoint instead of generating one")
    ap.add_argument("--workdir", default=None,
                    help="where to write / reuse the generated checkpoint "
                         "(default /tmp/dspark_bench/<preset>-<layers>L-fp8-fp4)")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes writing checkpoint shards")
    ap.add_argument("--context", default=None,
                    help="comma list of context lengths for (a) (flash: 128,1024,4096)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=None, help="(b): tokens to generate")
    ap.add_argument("--prompt-len", type=int, default=None, help="(b): prompt tokens")
    ap.add_argument("--skip-hf", action="store_true", help="leave out the HF transformers side")
    ap.add_argument("--skip-decode", action="store_true", help="leave out (a)")
    ap.add_argument("--hf-dtype", choices=("bf16", "fp32"), default=None,
                    help="HF weights / compute dtype (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=("fp8", "bf16", "fp32"))
    ap.add_argument("--grouped-moe", action=argparse.BooleanOptionalAction, default=True,
                    help="routed FP4 experts through the grouped small-batch kernels (the "
                         "default); --no-grouped-moe: the per-expert loop")
    ap.add_argument("--target-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="decode steps replayed as CUDA graphs (the Engine default on CUDA; "
                         "with FP4 experts only together with the grouped MoE)")
    ap.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                    help="overlapped decode: each step launches the next round before reading "
                         "this one back (the Engine default on CUDA); --no-overlap: one round "
                         "at a time")
    ap.add_argument("--autotune", action="store_true",
                    help="the grouped FP4 MoE kernels time their block configs "
                         "on first use and keep the fastest (the picks are reported)")
    ap.add_argument("--kernel-profile", type=int, default=0, metavar="STEPS",
                    help="(c): profile this many decode steps, time per kernel and per category")
    ap.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                    help="also cProfile this many decode steps: the host's share of a step")
    ap.add_argument("--timeline", type=int, default=0, metavar="REPLAYS",
                    help="CUDA: profile this many back-to-back replays of the decode graph and "
                         "print where its device time goes (idle gaps, time per stream)")
    ap.add_argument("--loop-timeline", type=int, default=0, metavar="STEPS",
                    help="CUDA: profile this many steps of the real decode loop (context 128) and "
                         "split each step's device time into the graph replay and the gap to the "
                         "next one (with the operations queued in it)")
    ap.add_argument("--deterministic", action="store_true",
                    help="Engine(deterministic=True): one-token eager forwards (no target graphs, "
                         "no overlapped decode), the cost of the batch-invariant mode")
    ap.add_argument("--device", default=None)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)

    ctx_default, new_default, prompt_default = PRESET_DEFAULTS[args.preset]
    contexts = [int(c) for c in (args.context or ctx_default).split(",") if c]
    new_tokens = args.new_tokens or new_default
    prompt_len = args.prompt_len or prompt_default
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = {"args": vars(args), "device": None}
    timings = result["timings"] = {}

    if args.autotune:
        from dspark.kernels import fp4_moe
        fp4_moe.AUTOTUNE = True

    def save():
        if args.autotune:
            from dspark.kernels.fp4_moe import autotune_report
            result["autotune_picks"] = autotune_report()
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, default=str)

    # -- checkpoint (before anything touches CUDA: the writers are forked) --
    t_all = time.perf_counter()
    path, cfg, result["checkpoint"] = prepare_checkpoint(
        args.model, args.preset, args.layers or mc._DEFAULT_LAYERS[args.preset], args.workdir,
        args.workers)
    result["device"] = _device_info(device)
    result["config"] = {k: getattr(cfg, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "vocab_size",
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "sliding_window",
        "index_topk", "weight_dtype", "expert_format")}
    result["config"]["compress_ratios"] = list(cfg.compress_ratios)

    from dspark.engine import Engine
    from dspark.models.qlinear import format_memory_report

    eng_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[
        args.hf_dtype or ("bf16" if device.type == "cuda" else "fp32")]
    hf_need = hf_model_bytes(cfg, hf_dtype)
    print(f"HF {str(hf_dtype).replace('torch.', '')} model of this checkpoint: "
          f"{_gb(hf_need):.2f} GB of weights"
          + (f"; device memory {_gb(torch.cuda.get_device_properties(device).total_memory):.1f}"
             f" GB" if device.type == "cuda" else ""))
    result["hf_model_bytes"] = hf_need

    bw = copy_bandwidth(device)
    result["copy_bandwidth"] = bw
    print(f"copy bandwidth: {bw['tbps']:.2f} TB/s ({_gb(bw['bytes']):.1f} GB device-to-device"
          + (f"; H200 anchor {H200_COPY_TBPS} TB/s)" if device.type == "cuda" else ")"))

    max_len = max(max(contexts) + args.warmup + 2 * args.iters + 16, prompt_len + new_tokens + 8)
    t0 = time.perf_counter()
    if not args.grouped_moe:   # the per-expert loop instead of the grouped small-batch kernels
        from dspark.models.qlinear import QuantMoE
        QuantMoE.grouped_max_pairs = 0
    modes = (dict(deterministic=True) if args.deterministic else
             dict(target_cuda_graphs=args.target_graphs, overlap_decode=args.overlap))
    eng = Engine(path, device=str(device), dtype=eng_dtype, weight_format="quantized", **modes,
                 speculative="none", kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=1,
                 max_num_batched_tokens=max(max(contexts), prompt_len) + 8,
                 max_model_len=-(-max_len // 256) * 256)
    _sync(device)
    load_s = time.perf_counter() - t0
    mem = eng.memory_report()
    kernels = _kernel_report(eng, device)
    timings["engine_load_s"] = load_s
    result["engine"] = {"load_s": load_s, "memory": mem, "kernels": kernels,
                        "dtype": str(eng_dtype).replace("torch.", "")}
    print(f"engine loaded in {load_s:.1f} s — {format_memory_report(mem)}; attention "
          f"{kernels['attention_backend']}, {kernels['quant_linear']['fp8']} FP8 / "
          f"{kernels['quant_linear']['fp4']} FP4 linears ({kernels['gemm_backend']}), "
          f"{kernels['quant_moe_layers']} FP4 MoE layers"
          f"{' (grouped kernels)' if kernels['grouped_fp4_moe'] else ''}; target CUDA graphs "
          f"{'on' if kernels['target_cuda_graphs'] else 'off'}")
    save()

    # -- (a) decode step vs roofline --
    t_phase = time.perf_counter()
    wbytes = target_bytes(cfg, eng_dtype)
    result["weight_bytes_per_step"] = wbytes
    rows = []
    if not args.skip_decode:
        for L in contexts:
            try:
                r = decode_steps(eng, L, args.warmup, args.iters, args.timeline)
                if r.get("timeline"):
                    print_timeline(r["timeline"])
            except Exception as exc:     # keep the other contexts and (b)
                msg = f"{type(exc).__name__}: {str(exc)[:500]}"
                print(f"decode at context {L} failed: {msg}")
                result.setdefault("decode_errors", {})[L] = msg
                continue
            kv = kv_bytes(cfg, L, args.kv_cache_dtype)
            total = wbytes["total"] + kv["total"]
            roof_ms = 1e3 * total / (bw["tbps"] * 1e12)
            r.update(weight_bytes=wbytes["total"], kv_bytes=kv, bytes=total,
                     roofline_ms=roof_ms, roofline_pct=100 * roof_ms / r["step_ms"],
                     forward_roofline_pct=100 * roof_ms / r["forward_ms"],
                     device_roofline_pct=(100 * roof_ms / r["replay_ms"] if r.get("replay_ms")
                                          else None),
                     achieved_tbps=total / (r["step_ms"] * 1e-3) / 1e12)
            rows.append(r)
            result["decode"] = rows
            save()
        print(f"\n(a) batch-1 decode step vs HBM roofline — {cfg.num_hidden_layers} layers "
              f"{cfg.compress_ratios}, {torch.device(device).type}, weights "
              f"{cfg.weight_dtype}/{cfg.expert_format}, KV {args.kv_cache_dtype}; "
              f"median of {args.iters} steps")
        print("weights read per step: " + ", ".join(
            f"{k} {wbytes[k] / 1e6:.1f}" for k in wbytes if k != "total")
            + f" MB (total {wbytes['total'] / 1e6:.1f} MB)")
        hdr = (f"{'context':>8} {'prefill s':>9} {'step ms':>8} {'min ms':>7} {'fwd ms':>7} "
               f"{'weights MB':>10} {'KV MB':>7} {'roof ms':>8} {'% roof':>7} {'% roof fwd':>10} "
               f"{'TB/s':>6} {'dev ms':>7} {'% roof dev':>10}")
        print(hdr)
        print("-" * len(hdr))
        for r in rows:
            print(f"{r['context']:>8} {r['prefill_s']:>9.2f} {r['step_ms']:>8.3f} "
                  f"{r['step_min_ms']:>7.3f} {r['forward_ms']:>7.3f} {r['weight_bytes'] / 1e6:>10.1f} "
                  f"{r['kv_bytes']['total'] / 1e6:>7.2f} {r['roofline_ms']:>8.3f} "
                  f"{r['roofline_pct']:>6.1f}% {r['forward_roofline_pct']:>9.1f}% "
                  f"{r['achieved_tbps']:>6.2f} "
                  + (f"{r['replay_ms']:>7.3f} {r['device_roofline_pct']:>9.1f}%"
                     if r.get("replay_ms") else f"{'-':>7} {'-':>10}"))
        print(f"target: >= {TARGET_ROOFLINE_PCT:.0f}% of roofline; steps launched before the "
              f"previous one was read back (overlapped decode): "
              + ", ".join(f"{r['overlapped_rounds']}/{r['steps'] + args.warmup}" for r in rows)
              + "; host busy per step (wall minus read-back wait): "
              + ", ".join("-" if r.get("host_busy_ms") is None else f"{r['host_busy_ms']:.3f} ms"
                          for r in rows)
              + "\ndev ms: the decode graph replayed back to back (device time per forward, no "
              "host work); step ms >> dev ms means the host sets the pace")

    timings["decode_s"] = time.perf_counter() - t_phase
    if args.kernel_profile:
        # -- (c) kernel split of a decode step --
        try:
            result["kernel_profile"] = kernel_profile(eng, args.kernel_profile)
            print_kernel_profile(result["kernel_profile"])
        except Exception as exc:         # keep (a) and (b)
            result["kernel_profile_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"kernel profile failed: {result['kernel_profile_error']}")
        save()
    if args.loop_timeline and device.type == "cuda":
        from loop_timeline import loop_timeline, print_loop_timeline
        try:
            result["loop_timeline"] = loop_timeline(eng, args.loop_timeline, 128, _profiled_decode)
            print_loop_timeline(result["loop_timeline"])
        except Exception as exc:
            result["loop_timeline_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"loop timeline failed: {result['loop_timeline_error']}")
        save()
    if args.host_profile:
        try:
            result["host_profile"] = host_profile(eng, args.host_profile)
            print_host_profile(result["host_profile"])
        except Exception as exc:
            result["host_profile_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"host profile failed: {result['host_profile_error']}")
        save()
    # -- (b) end to end vs HF --
    t_phase = time.perf_counter()
    prompt = _random_prompt(prompt_len, cfg.vocab_size, seed=12345)
    e2e = {"prompt_len": prompt_len, "new_tokens": new_tokens}
    ours_generate(eng, prompt, min(4, new_tokens))                    # warm-up
    ours_tok, ours_s = ours_generate(eng, prompt, new_tokens)
    _, ours_1 = ours_generate(eng, prompt, 1)
    e2e["ours"] = {"tok_s": new_tokens / ours_s, "wall_s": ours_s, "first_token_s": ours_1,
                   "decode_tok_s": (new_tokens - 1) / max(ours_s - ours_1, 1e-9),
                   "tokens": ours_tok}
    result["e2e"] = e2e
    timings["ours_e2e_s"] = time.perf_counter() - t_phase
    save()
    del eng
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_hf:
        try:
            if device.type == "cuda":
                free = torch.cuda.mem_get_info(device)[0]
                print(f"HF: needs {_gb(hf_need):.1f} GB of weights, {_gb(free):.1f} GB free")
                if hf_need > 0.92 * free:
                    raise RuntimeError(f"HF model ({_gb(hf_need):.1f} GB) does not fit in the "
                                       f"{_gb(free):.1f} GB free; use fewer --layers")
            t0 = time.perf_counter()
            hf = build_hf_model(path, device, hf_dtype)
            _sync(device)
            e2e["hf_load_s"] = timings["hf_load_s"] = time.perf_counter() - t0
            t_phase = time.perf_counter()
            hf_generate(hf, prompt, min(2, new_tokens), device)            # warm-up
            hf_tok, hf_s = hf_generate(hf, prompt, new_tokens, device)
            _, hf_1 = hf_generate(hf, prompt, 1, device)
            e2e["hf"] = {"tok_s": new_tokens / hf_s, "wall_s": hf_s, "first_token_s": hf_1,
                         "decode_tok_s": (new_tokens - 1) / max(hf_s - hf_1, 1e-9),
                         "tokens": hf_tok, "dtype": str(hf_dtype).replace("torch.", ""),
                         "attn_implementation": getattr(hf.config, "_attn_implementation", None),
                         "experts_implementation": getattr(hf.config, "_experts_implementation",
                                                           None)}
            timings["hf_generate_s"] = time.perf_counter() - t_phase
            e2e["speedup"] = e2e["ours"]["tok_s"] / e2e["hf"]["tok_s"]
            e2e["decode_speedup"] = e2e["ours"]["decode_tok_s"] / e2e["hf"]["decode_tok_s"]
            e2e["agree_leading"] = _leading_agreement(ours_tok, hf_tok)
            e2e["first_token_agrees"] = bool(ours_tok[:1] == hf_tok[:1])
            del hf
            gc.collect()
        except Exception as exc:     # (a) and our side of (b) are kept either way
            e2e["hf_error"] = f"{type(exc).__name__}: {exc}"
            print(f"HF side failed: {e2e['hf_error']}")
    save()
    print(f"\n(b) end to end, batch 1, {prompt_len}-token prompt, {new_tokens} greedy tokens")
    hdr = f"{'engine':<34} {'tok/s':>8} {'decode tok/s':>13} {'wall s':>8} {'1st tok s':>10}"
    print(hdr)
    print("-" * len(hdr))
    sides = [("dspark (quantized, speculation off)", e2e["ours"])]
    if "hf" in e2e:
        sides.append((f"HF DeepseekV4ForCausalLM {e2e['hf']['dtype']}", e2e["hf"]))
    for label, s in sides:
        print(f"{label:<34} {s['tok_s']:>8.1f} {s['decode_tok_s']:>13.1f} {s['wall_s']:>8.3f} "
              f"{s['first_token_s']:>10.3f}")
    if "hf" in e2e:
        print(f"speed-up {e2e['speedup']:.2f}x end to end, {e2e['decode_speedup']:.2f}x decode "
              f"(target >= {TARGET_HF_RATIO:.0f}x); greedy tokens agree for the first "
              f"{e2e['agree_leading']}/{new_tokens} (first token "
              f"{'agrees' if e2e['first_token_agrees'] else 'DIFFERS'})")
        print(f"  ours {e2e['ours']['tokens'][:12]}\n  HF   {e2e['hf']['tokens'][:12]}")

    parts = []
    if rows:
        parts.append(", ".join(f"decode@{r['context']} {r['step_ms']:.2f} ms = "
                               f"{r['roofline_pct']:.0f}% roofline"
                               + (f" (device {r['replay_ms']:.3f} ms = "
                                  f"{r['device_roofline_pct']:.0f}%)" if r.get("replay_ms") else "")
                               for r in rows))
    parts.append(f"e2e {e2e['ours']['tok_s']:.1f} tok/s")
    if "hf" in e2e:
        parts[-1] += (f" vs HF {e2e['hf']['tok_s']:.1f} = {e2e['speedup']:.1f}x, greedy agree "
                      f"{e2e['agree_leading']}/{new_tokens}")
    result["summary"] = (f"{args.preset if not args.model else os.path.basename(path)} "
                         f"{cfg.num_hidden_layers}L: " + "; ".join(parts))
    result["total_s"] = time.perf_counter() - t_all
    save()
    timings["checkpoint_s"] = result["checkpoint"].get("write_s", 0.0)
    print(f"\n{result['summary']}\ntotal {result['total_s']:.0f} s ("
          + ", ".join(f"{k} {v:.1f}" for k, v in timings.items()) + ")"
          + (f"; wrote {args.json}" if args.json else ""))
    return result


if __name__ == "__main__":
    main()
