"""Host cost of each kind of CUDA call a DSpark round makes, on this machine (CUDA only).

    python benchmarks/launch_costs.py [--variants]   # --variants: also DSPARK_NO_PDL=1 and
                                                     # DSPARK_NO_SIDE_STREAMS=1, each in its process

A batch-1 round of the shipped pair is host-bound on the H200, and the CPU harness
(benchmarks/host_round_cpu.py) times its Python with stand-ins for every CUDA call. This prices
those calls on the GPU host, so the harness's counts can be read as microseconds:

* the captured graphs a round replays (target verify step, draft context write, draft pass):
  host microseconds of one `replay()` call on an idle device, and its device time;
* one eager elementwise op on a small CUDA tensor, a pinned host->device upload (`to_device`,
  `StagedUpload`), a device->host read with its event (`PinnedReader`), an event, a Triton
  launch (`sampling.argmax_rows`, the engine's row argmax).

Medians of --iters calls, each timed with perf_counter around the call alone after a device
synchronize (so no call waits for earlier work).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def _host_us(fn, iters: int) -> float:
    """Median host microseconds of fn() on an idle device."""
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(ts)


def _device_us(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end))
    return 1e3 * statistics.median(ts)


def measure(iters: int) -> dict:
    from dspark import Engine, SamplingParams
    from dspark.cuda.transfer import PinnedReader, StagedUpload, to_device
    from dspark.sampling import argmax_rows

    eng = Engine()
    eng.warmup()
    # one batch-1 generation: every graph a batch-1 round replays exists afterwards
    eng.generate(["def fibonacci(n):"], SamplingParams(temperature=0, max_tokens=64,
                                                       ignore_eos=True))
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "env": {k: v for k, v in os.environ.items() if k.startswith("DSPARK_")}, "graphs": {}}
    tg = eng.runner.target_graphs
    for key, g in sorted(tg.graphs.items()):
        if key[0] == 1:                                   # batch bucket 1: the c=1 round's
            out["graphs"][f"target {key}"] = {"replay_host_us": _host_us(g.replay, iters),
                                              "device_us": _device_us(g.replay, iters)}
    for key, cap in eng.runner.draft_pass._graphs.items():
        if key[1] in (1, 8):                              # batch 1 pass, 8-row context write
            out["graphs"][f"{key[0]} {key[1:]}"] = {
                "replay_host_us": _host_us(cap.graph.replay, iters),
                "device_us": _device_us(cap.graph.replay, iters)}
    dev = torch.device("cuda")
    x = torch.zeros(8, device=dev)
    rows = list(range(40))
    staged, reader = StagedUpload(), PinnedReader()
    dst = torch.zeros(40, dtype=torch.long, device=dev)
    logits = torch.randn(6, eng.cfg.vocab_size, device=dev)
    out["calls_host_us"] = {
        "eager elementwise op (x.add_(1))": _host_us(lambda: x.add_(1), iters),
        "eager view op (x[:4])": _host_us(lambda: x[:4], iters),
        "to_device(40 ints)": _host_us(lambda: to_device(rows, torch.long, dev), iters),
        "StagedUpload(40 ints)": _host_us(lambda: staged(dst, rows, torch.long), iters),
        "PinnedReader.read(40 ints) + event": _host_us(lambda: reader.read(dst), iters),
        "torch.cuda.Event() + record": _host_us(lambda: torch.cuda.Event().record(), iters),
        "2 Triton launches (argmax_rows, 6 rows)": _host_us(lambda: argmax_rows(logits), iters),
    }
    eng.close()
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--variants", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("launch_costs.py prices CUDA calls: it needs a CUDA device")
    if a.child:
        print(json.dumps(measure(a.iters)))
        return
    runs = []
    for env in ([{}] + ([{"DSPARK_NO_PDL": "1"}, {"DSPARK_NO_SIDE_STREAMS": "1"}]
                        if a.variants else [])):
        res = subprocess.run([sys.executable, __file__, "--child", "--iters", str(a.iters)],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True)
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    for r in runs:
        print(f"== {r['device']}, torch {r['torch']}, {r['env'] or 'defaults'}")
        print(f"  {'graph':<58} {'replay host us':>14} {'device us':>10}")
        for name, v in r["graphs"].items():
            print(f"  {name:<58} {v['replay_host_us']:>14.1f} {v['device_us']:>10.1f}")
        for name, us in r["calls_host_us"].items():
            print(f"  {name:<58} {us:>14.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=2)


if __name__ == "__main__":
    main()
