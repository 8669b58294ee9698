"""python -m dspark.bench --profile --trace [--concurrency B] — which GPU kernels each phase of a
DSpark round runs.

The round split of profile.py says how long each phase takes (host and device together, the
phases are synchronised). This adds why: a torch.profiler trace of a few requests (B at a time) in
which every phase call is a `phase:<name>` range; each device kernel is charged to the innermost
phase range its start falls in (the ranges end after a device sync, so every kernel a phase launched
starts inside it). Per phase: kernels per round, device-busy ms per round (sum of kernel times;
the rest of the phase's wall time is host work and launch gaps) and the costliest kernels.
A round of a tiny model is usually launch-bound: many ~2-4 µs kernels, so `kernels/round`
is the number to cut.
"""
from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict

import torch

from .profile import PHASE_RANGE as PREFIX
from .profile import PHASES, PhaseTimer, instrument_engine


def attribute_kernels(events: list) -> dict:
    """Chrome-trace events -> {phase: {"kernels": n, "busy_us": total, "by_name": {name: [n, us]}}}.
    Phase ranges are `user_annotation` events named "phase:<name>"; kernels are `kernel` events.
    A kernel belongs to the shortest phase range containing its start; kernels outside every
    range are charged to "(outside)"."""
    ranges = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e["name"][len(PREFIX):])
                     for e in events if e.get("cat") == "user_annotation"
                     and str(e.get("name", "")).startswith(PREFIX)), key=lambda r: r[1] - r[0])
    out: dict = defaultdict(lambda: {"kernels": 0, "busy_us": 0.0, "by_name": defaultdict(lambda: [0, 0.0])})
    for e in events:
        if e.get("cat") != "kernel":
            continue
        ts, dur = e["ts"], float(e.get("dur", 0))
        phase = next((p for a, b, p in ranges if a <= ts <= b), "(outside)")
        rec = out[phase]
        rec["kernels"] += 1
        rec["busy_us"] += dur
        rec["by_name"][e["name"]][0] += 1
        rec["by_name"][e["name"]][1] += dur
    return {k: {"kernels": v["kernels"], "busy_us": v["busy_us"], "by_name": dict(v["by_name"])}
            for k, v in out.items()}


def trace_rounds(engine, prompts, sp, top: int = 6, batch: int = 1) -> dict:
    """Profile `prompts` in groups of `batch` (after whatever warm-up the caller did) and
    attribute device kernels to phases. Only the rounds in which all `batch` requests decode are
    traced (prefill steps and the ragged end of a group run unprofiled). Returns per-phase
    kernels / busy ms per decode round."""
    from torch.profiler import ProfilerActivity, profile

    from ..request import Status
    from ..sampling import SamplingParams
    if engine.device.type != "cuda":
        raise RuntimeError("--trace attributes CUDA kernels: run it on a GPU")
    engine.scheduler.max_num_seqs = batch
    timer = PhaseTimer(engine.device, annotate=True)    # a `phase:<name>` range per call
    rounds, per = 0, {}
    try:
        instrument_engine(engine, timer)
        for g0 in range(0, len(prompts) - batch + 1, batch):
            reqs = [engine.requests[engine.add_request(
                p, SamplingParams(**{**sp.__dict__, "seed": 20_000 + g0 + j}))]
                for j, p in enumerate(prompts[g0:g0 + batch])]

            def all_decoding():
                return all(r.output_ids and r.status != Status.FINISHED for r in reqs)

            while not all(r.output_ids for r in reqs) and engine.has_unfinished():
                engine.step()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                while all_decoding():
                    engine.step()
                    tel = engine.landed_telemetry      # the round this step committed
                    # a round of the whole group (a preempted request's recompute is not)
                    rounds += tel["num_verify"] == batch and not tel["prefill_tokens"]
                torch.cuda.synchronize(engine.device)
            while engine.has_unfinished():
                engine.step()
            with tempfile.TemporaryDirectory() as d:
                fn = os.path.join(d, "trace.json")
                prof.export_chrome_trace(fn)
                with open(fn) as f:
                    _merge(per, attribute_kernels(json.load(f)["traceEvents"]))
    finally:
        timer.unwrap()
    n = max(rounds, 1)
    res = {"rounds": rounds, "phases": {}}
    for ph in list(PHASES) + ["(outside)"]:
        if ph not in per:
            continue
        v = per[ph]
        rows = [{"kernel": k, "calls_per_round": c / n, "us_per_round": us / n}
                for k, (c, us) in v["by_name"].items()]
        res["phases"][ph] = {
            "kernels_per_round": v["kernels"] / n, "busy_ms_per_round": v["busy_us"] / 1e3 / n,
            "top": sorted(rows, key=lambda r: -r["us_per_round"])[:top],
            "most_launched": sorted(rows, key=lambda r: -r["calls_per_round"])[:40]}
    return res


def _merge(into: dict, per: dict) -> None:
    for ph, v in per.items():
        acc = into.setdefault(ph, {"kernels": 0, "busy_us": 0.0, "by_name": {}})
        acc["kernels"] += v["kernels"]
        acc["busy_us"] += v["busy_us"]
        for k, (c, us) in v["by_name"].items():
            a = acc["by_name"].setdefault(k, [0, 0.0])
            a[0] += c
            a[1] += us


def print_trace(res: dict) -> None:
    print(f"\nkernels per phase ({res['rounds']} decode rounds, prefill steps not profiled)")
    print(f"{'phase':<18} {'kernels/round':>14} {'GPU busy ms/round':>18}")
    print("-" * 52)
    for ph, v in res["phases"].items():
        print(f"{ph:<18} {v['kernels_per_round']:>14.1f} {v['busy_ms_per_round']:>18.3f}")
    for ph, v in res["phases"].items():
        print(f"  {ph} (costliest, µs/round): " + "; ".join(
            f"{_short(t['kernel'])} {t['us_per_round']:.0f}" for t in v["top"]))
        print(f"  {ph} (most launched): " + "; ".join(
            f"{_short(t['kernel'])} x{t['calls_per_round']:.1f}" for t in v["most_launched"][:10]))


def _short(name: str) -> str:
    """A readable kernel name: the functor inside at::native's templates, else the head."""
    for key in ("Functor", "_kernel_cuda", "_kernel_impl", "Op<"):
        i = name.find(key)
        if i > 0:
            j = max(name.rfind("::", 0, i), name.rfind("<", 0, i), name.rfind(" ", 0, i))
            return name[j + 1:i + len(key)].strip(":<")[:40]
    return name.split("(")[0].split("<")[0][-40:]
