"""Where a decode step's wall time goes on the device between two graph replays.

`bench_decode_v4.py --timeline` shows the decode graph replayed back to back (its device time per
forward). A real decode step adds what the engine queues around the replay: the plan's upload,
the anchor copy of the overlapped decode, the read back of the result. This profiles `steps`
steps of the real loop (overlapped decode as the engine runs it) and splits each step's device
time into the graph replay's span and the time from one replay's last kernel to the next one's
first, listing the operations queued in between. A graph's kernels share the correlation id of
their cudaGraphLaunch; every other device operation has its own.
"""
from __future__ import annotations

import statistics

import torch


def _device_events(prof):
    return [e for e in prof.profiler.kineto_results.events()
            if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0]


def split_steps(events, min_graph_kernels: int = 8) -> dict:
    """events: device events (name(), start_ns(), duration_ns(), correlation_id()). Groups of at
    least `min_graph_kernels` events under one correlation id are graph replays; returns per
    replay its span and, for each pair of consecutive replays, the gap between them with the
    other operations that ran in it."""
    groups: dict = {}
    for e in events:
        groups.setdefault(e.correlation_id(), []).append(e)
    replays = sorted(([min(x.start_ns() for x in g), max(x.start_ns() + x.duration_ns() for x in g),
                       len(g)] for g in groups.values() if len(g) >= min_graph_kernels))
    in_graph = {c for c, g in groups.items() if len(g) >= min_graph_kernels}
    others = sorted((e for e in events if e.correlation_id() not in in_graph),
                    key=lambda e: e.start_ns())
    gaps = []
    for (s0, f0, _), (s1, _, _) in zip(replays, replays[1:]):
        between = [{"name": e.name()[:40], "start_us": round((e.start_ns() - f0) / 1e3, 2),
                    "dur_us": round(e.duration_ns() / 1e3, 2)}
                   for e in others if f0 <= e.start_ns() < s1]
        gaps.append({"gap_us": (s1 - f0) / 1e3, "ops": between})
    spans = [(f - s) / 1e3 for s, f, _ in replays]
    periods = [(b[0] - a[0]) / 1e3 for a, b in zip(replays, replays[1:])]
    return {"replays": len(replays),
            "kernels_per_replay": replays[0][2] if replays else 0,
            "median_span_us": statistics.median(spans) if spans else None,
            "median_period_us": statistics.median(periods) if periods else None,
            "median_gap_us": statistics.median(g["gap_us"] for g in gaps) if gaps else None,
            "gaps": gaps}


def loop_timeline(eng, steps: int, context: int, profiled_decode) -> dict:
    """`steps` decode steps of the engine's own loop under the CUDA profiler (after warm steps),
    split by `split_steps`. profiled_decode: bench_decode_v4._profiled_decode."""
    from torch.profiler import ProfilerActivity
    prof, wall = profiled_decode(eng, steps, context, seed=context + 7, warm_steps=8,
                                 activities=[ProfilerActivity.CUDA])
    out = split_steps(_device_events(prof))
    out["wall_us_per_step"] = 1e6 * wall / steps
    return out


def print_loop_timeline(lt: dict) -> None:
    if not lt.get("replays"):
        print("\n(e) loop timeline: no graph replays found")
        return
    print(f"\n(e) the decode loop on the device: {lt['replays']} graph replays of "
          f"{lt['kernels_per_replay']} kernels; median replay span {lt['median_span_us']:.1f} us, "
          f"period (replay start to next replay start) {lt['median_period_us']:.1f} us, gap "
          f"(last kernel to next first kernel) {lt['median_gap_us']:.1f} us; wall "
          f"{lt['wall_us_per_step']:.1f} us per step (profiled)")
    ordered = sorted(lt["gaps"], key=lambda g: g["gap_us"])
    if ordered:
        g = ordered[len(ordered) // 2]
        print(f"    a median gap ({g['gap_us']:.1f} us), operations in it (start after the "
              "replay's last kernel, duration):")
        for op in g["ops"]:
            print(f"      {op['start_us']:7.2f} us  {op['dur_us']:6.2f} us  {op['name']}")
