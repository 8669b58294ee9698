"""python -m dspark.bench — acceptance and throughput of DSpark vs speculation off
(`--profile`: the batch-1 round latency split instead, see profile.py).

Default model: the shipped small trained pair (dspark/assets/default), prompts from its held-out
split. Prints a table per concurrency level, saves JSON / PNG on request, and ends with a
one-line summary: `tau=... accept_rate=... speedup=...x tok/s=...`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tqdm import tqdm

from ..engine import Engine, default_model_path
from ..metrics import aggregate
from ..sampling import SamplingParams
from .datasets import load_prompts


def run_once(engine: Engine, prompts, sp: SamplingParams, concurrency: int, desc: str) -> dict:
    """Closed loop: `concurrency` requests in flight, the next prompt submitted when one finishes
    (so TTFT is a request's own prefill and first round, not time spent queued behind the
    others); tok/s = output tokens / wall time of the whole run."""
    engine.scheduler.max_num_seqs = concurrency
    params = [SamplingParams(**{**sp.__dict__, "seed": i}) for i in range(len(prompts))]
    pending = list(zip(prompts, params))[::-1]
    ids, outs = [], {}
    bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False, file=sys.stderr)
    t0 = time.perf_counter()

    def submit():
        p, s = pending.pop()
        ids.append(engine.add_request(p, s))

    while pending and len(ids) < concurrency:
        submit()
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
                bar.update(1)
                if pending:
                    submit()
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    bar.close()
    outs = [outs[i] for i in ids]
    m = aggregate(o.metrics for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"concurrency": concurrency, "requests": len(outs), "output_tokens": tokens,
            "wall_s": wall, "tok_s": tokens / wall, "tau": m.mean_accepted_length,
            "accept_rate": m.acceptance_rate, "cond_accept": m.conditional_acceptance,
            "ttft_ms": 1e3 * m.ttft, "tpot_ms": 1e3 * m.tpot, "rounds": m.rounds,
            "sample": outs[0].text if outs[0].text is not None else outs[0].token_ids[:32]}


def warm_up(engine: Engine, prompts, sp: SamplingParams, concurrency: int, name: str) -> None:
    """Untimed: every prompt's prefill once (Triton specialises some kernels on shapes, so a new
    prompt length can compile; a server pays that once per shape, not per request) and the first
    `concurrency` prompts at full length (kernel compiles and CUDA-graph captures of every batch
    bucket up to `concurrency`)."""
    short = SamplingParams(**{**sp.__dict__, "max_tokens": min(sp.max_tokens, 4)})
    run_once(engine, prompts, short, concurrency, f"warm-up {name} prefills")
    run_once(engine, prompts[:concurrency], sp, concurrency, f"warm-up {name} c={concurrency}")


def print_table(rows):
    head = f"{'conc':>5} {'tau':>6} {'acc%':>6} {'spec tok/s':>11} {'off tok/s':>10} {'speedup':>8} " \
           f"{'TTFT ms':>8} {'TPOT ms':>8}  conditional acceptance per position"
    print(head)
    print("-" * len(head))
    for r in rows:
        s, o = r["dspark"], r["off"]
        cond = " ".join(f"{c:.2f}" for c in s["cond_accept"])
        print(f"{r['concurrency']:>5} {s['tau']:>6.2f} {100 * s['accept_rate']:>6.1f} {s['tok_s']:>11.1f} "
              f"{o['tok_s']:>10.1f} {r['speedup']:>7.2f}x {s['ttft_ms']:>8.1f} {s['tpot_ms']:>8.2f}  {cond}")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    conc = [r["concurrency"] for r in rows]
    ax[0].plot(conc, [r["dspark"]["tok_s"] for r in rows], "o-", label="DSpark")
    ax[0].plot(conc, [r["off"]["tok_s"] for r in rows], "s--", label="speculation off")
    ax[0].set_xscale("log", base=2), ax[0].set_xlabel("concurrency"), ax[0].set_ylabel("output tok/s")
    ax[0].legend(), ax[0].set_title("throughput")
    for r in rows:
        ax[1].plot(range(1, len(r["dspark"]["cond_accept"]) + 1), r["dspark"]["cond_accept"], "o-",
                   label=f"conc {r['concurrency']}")
    ax[1].set_xlabel("draft position k"), ax[1].set_ylabel("P(accept k | accepted < k)")
    ax[1].set_ylim(0, 1), ax[1].legend(), ax[1].set_title("conditional acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: shipped pair)")
    p.add_argument("--dataset", default=None, help="JSONL prompts (default: held-out split)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="default 32 (8 with --profile)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="1.0 = paper protocol; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--concurrency", default="1", help="comma list, e.g. 1,4,16")
    p.add_argument("--verify-policy", default="fixed")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--target-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="both engines replay the DeepSeek-V4 target's decode / verify steps as "
                        "CUDA graphs (the Engine default on CUDA); --no-target-cuda-graphs runs the "
                        "target eagerly (Python launch overhead included)")
    p.add_argument("--quick", action="store_true", help="few short prompts: a CPU smoke run")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG here")
    p.add_argument("--profile", action="store_true",
                   help="instead: batch-1 DSpark round latency split (draft / verify / "
                        "sampling+accept / commit) and the saved benchmark results "
                        "(dspark/bench/profile.py)")
    p.add_argument("--trace", action="store_true",
                   help="with --profile on CUDA: the GPU kernels of each phase (kernels and "
                        "device-busy ms per round, costliest kernels; dspark/bench/trace.py)")
    p.add_argument("--results-dir", default=None,
                   help="--profile: where the benchmark JSONs are (default benchmarks/results)")
    a = p.parse_args(argv)
    if a.num_prompts is None:
        a.num_prompts = 8 if a.profile else 32
    if a.profile:
        from .profile import main_profile
        if a.quick:
            a.num_prompts, a.max_tokens = min(a.num_prompts, 3), min(a.max_tokens, 32)
        main_profile(a)
        return
    if a.quick:
        a.num_prompts, a.max_tokens = min(a.num_prompts, 6), min(a.max_tokens, 32)
    model = a.model or default_model_path()
    dataset = a.dataset or os.path.join(model, "heldout_prompts.jsonl")
    prompts = load_prompts(dataset, a.num_prompts)
    sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                        max_tokens=a.max_tokens, ignore_eos=False)
    conc = [int(c) for c in a.concurrency.split(",")]
    tg = dict(target_cuda_graphs=a.target_cuda_graphs)
    spec = Engine(model, device=a.device, dtype=a.dtype, verify_policy=a.verify_policy, **tg)
    off = Engine(model, device=a.device, dtype=a.dtype, speculative="none", **tg)
    print(f"model {model}  device {spec.device}  dtype {str(spec.dtype).replace('torch.', '')}  "
          f"γ={spec.cfg.dspark_block_size}  policy {a.verify_policy}  temperature {a.temperature}  "
          f"{len(prompts)} prompts × {a.max_tokens} tokens", file=sys.stderr)
    for eng, name in ((spec, "dspark"), (off, "off")):
        # every graph a round replays captured, and the eager shapes compiled, before any timing
        info = eng.warmup(batch_sizes=[b for b in (1, 2, 4, 8, 16, 32, 64) if b <= max(conc)])
        print(f"warm-up {name}: {info['requests']} requests, graphs {info['graphs']}, "
              f"{info['seconds']:.1f} s", file=sys.stderr)
    rows = []
    for c in conc:
        # untimed warm-up of BOTH engines at this concurrency: kernel compiles and CUDA-graph
        # captures happen here, not inside either timed run
        for eng, name in ((spec, "dspark"), (off, "off")):
            warm_up(eng, prompts, sp, c, name)
        s = run_once(spec, prompts, sp, c, f"dspark c={c}")
        o = run_once(off, prompts, sp, c, f"off c={c}")
        rows.append({"concurrency": c, "dspark": s, "off": o, "speedup": s["tok_s"] / o["tok_s"]})
    print_table(rows)
    print(f"sample: {rows[0]['dspark']['sample']!r}"[:300])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": rows}, f, indent=2, default=str)
    if a.plot:
        plot(rows, a.plot)
    r = rows[-1]
    print(f"tau={r['dspark']['tau']:.2f} accept_rate={r['dspark']['accept_rate']:.2f} "
          f"speedup={r['speedup']:.2f}x tok/s={r['dspark']['tok_s']:.1f}")


if __name__ == "__main__":
    main()
