"""When the device waits in a batch-1 DSpark round, and for what host work.

    python benchmarks/round_timeline.py --temperature 1 --json out.json --trace-out trace.json.gz

Three runs of the same closed loop (`python -m dspark.bench`'s run_once, shipped pair, c=1):
  plain    as the bench runs it;
  synced   torch.cuda.synchronize() after every Engine.step (no work of two steps overlaps);
  traced   under torch.profiler with every engine phase as a profiler range (no syncs added).
From the trace: per round the device's busy time (kernels and copies), its span, and its idle
time, each idle gap charged to the host phase that was running when the gap began (what the
device waited for), plus the delay from each CUDA-graph launch call to its first kernel.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import tempfile
from collections import defaultdict

import torch

from dspark.bench.__main__ import run_once, warm_up
from dspark.bench.datasets import load_prompts
from dspark.engine import Engine, default_model_path
from dspark.sampling import SamplingParams

# (object attribute path, method, phase name); innermost range wins
PHASES = (("", "step", "step"), ("", "_verify_lengths", "policy"), ("scheduler", "schedule", "schedule"),
          ("runner", "target_forward", "verify launch"), ("", "_accept", "accept"),
          ("", "_commit", "commit (host)"), ("runner", "draft", "draft launch"),
          ("runner", "draft_ahead", "draft launch"),
          ("runner", "flush_context", "context write"), ("", "_output", "outputs"))


def annotate(engine):
    undo = []
    for path, meth, name in PHASES:
        obj = engine if not path else getattr(engine, path)
        orig = getattr(obj, meth)

        def wrapped(*a, _orig=orig, _name=name, **k):
            with torch.profiler.record_function("phase:" + _name):
                return _orig(*a, **k)
        setattr(obj, meth, wrapped)
        undo.append((obj, meth))
    return lambda: [delattr(o, m) for o, m in undo]


def analyse(events, rounds: int) -> dict:
    dev = sorted(((e["ts"], e["ts"] + e.get("dur", 0)) for e in events
                  if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda x: x[0])
    ranges = sorted(((e["ts"], e["ts"] + e.get("dur", 0), e["name"][6:]) for e in events
                     if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("phase:")),
                    key=lambda r: r[0])
    starts = [r[0] for r in ranges]

    def phase_at(t):
        best = None
        i = bisect.bisect_right(starts, t)
        for a, b, name in ranges[max(0, i - 40):i]:
            if a <= t <= b and (best is None or b - a < best[1] - best[0]):
                best = (a, b, name)
        return best[2] if best else "(between steps)"

    busy, idle = 0.0, defaultdict(float)
    end = dev[0][1] if dev else 0
    for a, b in dev:
        if a > end:
            gap = a - end
            if gap > 2.0:
                idle[phase_at(end)] += gap
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    span = (end - dev[0][0]) if dev else 0
    # CUDA-graph launch call -> its first kernel (queueing: the device still busy with earlier work)
    flows = {}
    for e in events:
        if e.get("ph") in ("s", "f") and e.get("cat") == "ac2g":
            flows.setdefault(e["id"], {})[e["ph"]] = e["ts"]
    launches = [e for e in events if e.get("cat") == "cuda_runtime" and "GraphLaunch" in e.get("name", "")]
    n = max(rounds, 1)
    return {"rounds": rounds, "device_busy_ms": busy / 1e3 / n, "device_span_ms": span / 1e3 / n,
            "device_idle_ms_by_host_phase": {k: v / 1e3 / n for k, v in sorted(idle.items(), key=lambda x: -x[1])},
            "graph_launches_per_round": len(launches) / n,
            "graph_launch_call_us": sum(e.get("dur", 0) for e in launches) / max(len(launches), 1),
            "flow_pairs": len(flows)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--json", default=None)
    p.add_argument("--trace-out", default=None, help="gzipped chrome trace of the traced run")
    a = p.parse_args(argv)
    model = default_model_path()
    prompts = load_prompts(os.path.join(model, "heldout_prompts.jsonl"), a.num_prompts)
    sp = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, ignore_eos=True)
    eng = Engine(model)
    eng.warmup(prompt_lengths=[], batch_sizes=[])
    warm_up(eng, prompts, sp, 1, "dspark")
    out = {"temperature": a.temperature}
    plain = run_once(eng, prompts, sp, 1, "plain")
    step = eng.step
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)

    def synced_step():
        r = step()
        sync()
        return r
    eng.step = synced_step
    synced = run_once(eng, prompts, sp, 1, "synced")
    del eng.step
    for name, r in (("plain", plain), ("synced", synced)):
        out[name] = {"tok_s": r["tok_s"], "round_ms": 1e3 * r["wall_s"] / r["rounds"], "tau": r["tau"]}
        print(f"{name:>7}: {r['tok_s']:7.1f} tok/s, {out[name]['round_ms']:.3f} ms/round, tau {r['tau']:.2f}")
    undo = annotate(eng)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = run_once(eng, prompts[:2], sp, 1, "traced")
        sync()
    undo()
    with tempfile.TemporaryDirectory() as d:
        fn = os.path.join(d, "t.json")
        prof.export_chrome_trace(fn)
        with open(fn) as f:
            events = json.load(f)["traceEvents"]
        if a.trace_out:
            with open(fn, "rb") as f, gzip.open(a.trace_out, "wb") as g:
                g.write(f.read())
    res = analyse(events, r["rounds"])
    res["round_ms"] = 1e3 * r["wall_s"] / r["rounds"]
    out["traced"] = res
    print(f" traced: {res['round_ms']:.3f} ms/round; device busy {res['device_busy_ms']:.3f} ms, "
          f"span {res['device_span_ms']:.3f} ms per round; {res['graph_launches_per_round']:.1f} graph "
          f"launches per round ({res['graph_launch_call_us']:.1f} us host each)")
    print("device idle per round, by the host phase running when the gap began:")
    for k, v in res["device_idle_ms_by_host_phase"].items():
        print(f"  {k:<20} {v:.3f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
