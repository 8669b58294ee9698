"""python -m dspark.bench — acceptance and throughput of DSpark vs speculation off
(`--profile`: the batch-1 round latency split instead, see profile.py).

Default model: the shipped small trained pair (dspark/assets/default), prompts from its held-out
split. Per concurrency level and verify policy (`--policies fixed,scheduled`: one DSpark engine
each, against the same speculation-off engine, same prompts and settings) it prints τ, the mean
verify length ℓ (drafts verified per request-round), tok/s of both and the speed-up (each engine
timed `--repeats` times in turn, default 3, and reported by its median run), and the
Triton compiles / CUDA-graph captures / eager fallbacks inside each timed run (all 0 once warmed
up; a WARNING line names any that are not). `--split` (default with --model) adds the round split
per batch next to the plain decode step and the speed-up projected at a per-position acceptance
(split.py). Saves JSON / PNG on request and ends with a one-line summary:
`tau=... accept_rate=... speedup=...x tok/s=...`.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from ..compile_stats import combined, delta, total
from ..cuda.graph_capture import PROMPT_STEP
from ..engine import Engine, default_model_path
from ..heap import CollectorPauses, frozen_heap
from ..model_dir import weight_format_for
from ..metrics import aggregate
from ..sampling import SamplingParams
from .datasets import load_prompts, token_prompts
from .split import (PAPER_ACCEPTANCE, PAPER_ACCEPTANCE_SOURCE, print_split, split_rounds,
                    tokens_per_round)


def run_once(engine: Engine, prompts, sp: SamplingParams, concurrency: int, desc: str) -> dict:
    """Closed loop: `concurrency` requests in flight, the next prompt submitted when one finishes
    (so TTFT is a request's own prefill and first round, not time spent queued behind the
    others); tok/s = output tokens / wall time of the whole run."""
    engine.scheduler.max_num_seqs = concurrency
    params = [SamplingParams(**{**sp.__dict__, "seed": i}) for i in range(len(prompts))]
    pending = list(zip(prompts, params))[::-1]
    ids, outs = [], {}
    bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False, file=sys.stderr)
    before = engine.compile_stats()
    gc.collect()                # the last run's garbage is not this run's pause
    with CollectorPauses() as pauses:
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
    once = delta(engine.compile_stats(), before)
    bar.close()
    outs = [outs[i] for i in ids]
    m = aggregate(o.metrics for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"concurrency": concurrency, "requests": len(outs), "output_tokens": tokens,
            "wall_s": wall, "tok_s": tokens / wall, "tau": m.mean_accepted_length,
            "accept_rate": m.acceptance_rate, "cond_accept": m.conditional_acceptance,
            "ttft_ms": 1e3 * m.ttft, "tpot_ms": 1e3 * m.tpot, "rounds": m.rounds,
            "mean_verify_len": m.verified / m.rounds if m.rounds else 0.0,
            "compile_stats": once, "gc": {"collections": pauses.count, "ms": pauses.ms},
            "sample": outs[0].text if outs[0].text is not None else outs[0].token_ids[:32]}


def warm_up(engine: Engine, prompts, sp: SamplingParams, concurrency: int, name: str) -> None:
    """Untimed: every prompt's prefill once (Triton specialises some kernels on shapes, so a new
    prompt length can compile; a server pays that once per shape, not per request) and the first
    `concurrency` prompts at full length (kernel compiles and CUDA-graph captures of every batch
    bucket up to `concurrency`)."""
    short = SamplingParams(**{**sp.__dict__, "max_tokens": min(sp.max_tokens, 4)})
    run_once(engine, prompts, short, concurrency, f"warm-up {name} prefills")
    run_once(engine, prompts[:concurrency], sp, concurrency, f"warm-up {name} c={concurrency}")


def _once(st: dict) -> str:
    tc = st["triton_compiles"]
    return f"{tc if isinstance(tc, int) else '-'}/{st['graph_captures']}/" \
           f"{sum(st['eager_fallbacks'].values())}"


def print_table(rows):
    head = (f"{'conc':>5} {'policy':<16} {'tau':>5} {'ℓ':>5} {'acc%':>6} {'spec tok/s':>11} "
            f"{'off tok/s':>10} {'speedup':>8} {'TTFT ms':>8} {'TPOT ms':>8} "
            f"{'spec c/g/e':>11} {'off c/g/e':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        s, o = r["dspark"], r["off"]
        print(f"{r['concurrency']:>5} {r['policy']:<16} {s['tau']:>5.2f} {s['mean_verify_len']:>5.2f} "
              f"{100 * s['accept_rate']:>6.1f} {s['tok_s']:>11.1f} {o['tok_s']:>10.1f} "
              f"{r['speedup']:>7.2f}x {s['ttft_ms']:>8.1f} {s['tpot_ms']:>8.2f} "
              f"{_once(s['compile_stats']):>11} {_once(o['compile_stats']):>10}")
    print("ℓ = drafts verified per request-round; c/g/e = Triton compiles / CUDA-graph captures / "
          "eager fallbacks inside the timed run (must be 0)")
    for r in rows:
        for name in ("dspark", "off"):
            st = r[name]["compile_stats"]
            if total(st):
                # a prompt wider than every captured step runs eagerly whatever the warm-up did
                reasons = {k.split(": ")[-1] for k in st["eager_fallbacks"]}
                prompts_only = (reasons == {PROMPT_STEP} and not st["triton_compiles"]
                                and not st["graph_captures"])
                why = ("prompt steps wider than the captured widths run eagerly" if prompts_only
                       else "the warm-up missed these shapes")
                print(f"WARNING: c={r['concurrency']} {r['policy'] if name == 'dspark' else 'off'}: "
                      f"{st['triton_compiles']} Triton compiles, {st['graph_captures']} graph "
                      f"captures, eager fallbacks {st['eager_fallbacks'] or 0} inside the timed "
                      f"run ({why})")
    for r in rows:
        cond = " ".join(f"{c:.2f}" for c in r["dspark"]["cond_accept"])
        print(f"conditional acceptance per position, c={r['concurrency']} {r['policy']}: {cond}")


def _range_bars(runs: list) -> list:
    """[[below], [above]] the reported tok/s: the spread of a level's repeated runs."""
    lo = [r["tok_s"] - min(r.get("tok_s_runs", [r["tok_s"]])) for r in runs]
    hi = [max(r.get("tok_s_runs", [r["tok_s"]])) - r["tok_s"] for r in runs]
    return [lo, hi]


def plot(rows, path):
    """Left: tok/s by concurrency, DSpark per policy and off (bars: the range of the repeated
    runs). Right: conditional acceptance by draft position, one curve per policy and
    temperature (the mean over the levels, which share the prompts; band: their range)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    temps = list(dict.fromkeys(r.get("temperature") for r in rows))
    for pol in policies:
        for t in temps:
            at = [r for r in rows if r["policy"] == pol and r.get("temperature") == t]
            runs = [r["dspark"] for r in at]
            ax[0].errorbar([r["concurrency"] for r in at], [x["tok_s"] for x in runs],
                           yerr=_range_bars(runs), fmt="o-", capsize=3,
                           label=f"DSpark ({pol}, T={t})")
            acc = np.array([x["cond_accept"] for x in runs if x["cond_accept"]])
            if len(acc):
                k = np.arange(1, acc.shape[1] + 1)
                line, = ax[1].plot(k, acc.mean(0), "o-", label=f"{pol}, T={t}")
                ax[1].fill_between(k, acc.min(0), acc.max(0), color=line.get_color(), alpha=0.2)
    for t in temps:
        at = [r for r in rows if r["policy"] == policies[0] and r.get("temperature") == t]
        runs = [r["off"] for r in at]
        ax[0].errorbar([r["concurrency"] for r in at], [x["tok_s"] for x in runs],
                       yerr=_range_bars(runs), fmt="s--", capsize=3,
                       label=f"speculation off (T={t})")
    ax[0].set_xscale("log", base=2), ax[0].set_xlabel("concurrency"), ax[0].set_ylabel("output tok/s")
    ax[0].legend(fontsize=8), ax[0].set_title("throughput (bars: range of the repeated runs)")
    ax[1].set_xlabel("draft position k"), ax[1].set_ylabel("P(accept k | accepted < k)")
    ax[1].set_ylim(0, 1), ax[1].legend(fontsize=8)
    ax[1].set_title("conditional acceptance (band: range over levels)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def median_run(runs: list) -> dict:
    """The run of median tok/s among repeats of one engine at one level, with every run's tok/s
    (`tok_s_runs`) and the one-time work and collector time summed over all of them."""
    mid = sorted(runs, key=lambda r: r["tok_s"])[(len(runs) - 1) // 2]
    once = runs[0]["compile_stats"]
    for r in runs[1:]:
        once = combined(once, r["compile_stats"])
    return {**mid, "tok_s_runs": [r["tok_s"] for r in runs], "compile_stats": once,
            "gc": {"collections": sum(r["gc"]["collections"] for r in runs),
                   "ms": sum(r["gc"]["ms"] for r in runs)}}


def _spread(run: dict) -> str:
    xs = run["tok_s_runs"]
    return f" ({min(xs):.0f}-{max(xs):.0f})" if len(xs) > 1 else ""


def run_levels(off: Engine, specs: dict, prompts, sps_by_t, conc, split: bool,
               repeats: int = 1) -> tuple:
    """Per temperature and concurrency: an untimed warm-up of every engine, then speculation
    off and each policy's DSpark engine timed on the same prompts, `repeats` times in turn
    (off, each policy, off, ...: a slow spell of the machine falls on all of them), each
    reported by its median run (and the round split with `split`). Returns (rows, split
    rows)."""
    policies = list(specs)
    engines = [(off, "off")] + [(e, pol) for pol, e in specs.items()]
    rows, split_rows = [], []
    for sp in sps_by_t:
        for c in conc:
            # untimed warm-up of EVERY engine at this concurrency: kernel compiles and CUDA-graph
            # captures should happen here, not inside a timed run (the counts say if they did not)
            for eng, name in engines:
                warm_up(eng, prompts, sp, c, name)
            runs = {name: [] for _, name in engines}
            for k in range(repeats):
                rep = f" ({k + 1}/{repeats})" if repeats > 1 else ""
                for eng, name in engines:
                    what = "off" if name == "off" else f"dspark {name}"
                    runs[name].append(run_once(eng, prompts, sp, c,
                                               f"{what} c={c} T={sp.temperature}{rep}"))
            o = median_run(runs["off"])
            for pol in policies:
                s = median_run(runs[pol])
                rows.append({"temperature": sp.temperature, "concurrency": c, "policy": pol,
                             "dspark": s, "off": o, "speedup": s["tok_s"] / o["tok_s"]})
                # as it comes (a run cut short still leaves what finished)
                print(f"T={sp.temperature} c={c} {pol}: DSpark {s['tok_s']:.1f}{_spread(s)} vs "
                      f"off {o['tok_s']:.1f}{_spread(o)} tok/s ({rows[-1]['speedup']:.2f}x), "
                      f"tau {s['tau']:.2f}, c/g/e {_once(s['compile_stats'])}, collector "
                      f"{s['gc']['collections']} runs {s['gc']['ms']:.1f} ms (off "
                      f"{o['gc']['ms']:.1f} ms)", flush=True)
            if split:
                off_split = split_rounds(off, prompts, sp, c, run_once)
                for pol, eng in specs.items():
                    split_rows.append({"temperature": sp.temperature, "concurrency": c,
                                       "policy": pol, "off_split": off_split,
                                       "split": split_rounds(eng, prompts, sp, c, run_once),
                                       "tau": rows[-len(specs) + policies.index(pol)]["dspark"]["tau"]})
    return rows, split_rows


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m dspark.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: shipped pair)")
    p.add_argument("--dataset", default=None, help="JSONL prompts (default: held-out split)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="default 32 (8 with --profile)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", default="1.0",
                   help="1.0 = paper protocol; 0 = greedy; a comma list (e.g. 1,0) runs each "
                        "with the same engines (one build and capture), a table per temperature")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request generates --max-tokens tokens (fixed work per request)")
    p.add_argument("--concurrency", default="1", help="comma list, e.g. 1,4,16")
    p.add_argument("--verify-policy", default="fixed")
    p.add_argument("--policies", default=None,
                   help="comma list of verify policies, e.g. fixed,scheduled: one DSpark engine "
                        "each against the same speculation-off engine (default: --verify-policy)")
    p.add_argument("--weight-format", default="auto", choices=("auto", "bf16", "quantized"),
                   help="Engine(weight_format=...); auto: 'quantized' for a checkpoint stored "
                        "as FP8 (quantization_config in config.json), else 'bf16'")
    p.add_argument("--split", action=argparse.BooleanOptionalAction, default=None,
                   help="also the round split per batch (draft / verify / accept ms) next to the "
                        "plain decode step, and the projected speed-up (default: on with --model)")
    p.add_argument("--acceptance", default=None,
                   help="--split: per-position acceptance (fraction of rounds accepting position "
                        "k, comma list) for the projection (default: dspark.md §9 V4-Flash "
                        "GSM8K numbers)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--target-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="both engines replay the DeepSeek-V4 target's decode / verify steps as "
                        "CUDA graphs (the Engine default on CUDA); --no-target-cuda-graphs runs the "
                        "target eagerly (Python launch overhead included)")
    p.add_argument("--deterministic", action="store_true",
                   help="both engines with deterministic=True (each request's tokens independent "
                        "of its batch and of speculation; batch-invariant graph steps on CUDA, "
                        "one-token forwards on CPU; Gumbel-max "
                        "sampling): the mode's cost against the same run without it")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs of each engine per level, in turn; each is reported by its "
                        "median run, with the range (default 3; 1 with --quick)")
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
    try:
        temps = [float(x) for x in str(a.temperature).split(",") if x.strip()]
    except ValueError:
        sys.exit(f"--temperature {a.temperature!r}: give a number or a comma list of numbers")
    if not temps:
        sys.exit("--temperature: give at least one temperature")
    a.temperature = temps[0]          # --profile runs the first
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
    if a.repeats is None:
        a.repeats = 1 if a.quick else 3
    if a.repeats < 1:
        sys.exit(f"--repeats {a.repeats}: give at least 1 timed run per engine and level")
    model = a.model or default_model_path()
    dataset = a.dataset or os.path.join(model, "heldout_prompts.jsonl")
    prompts = load_prompts(dataset, a.num_prompts)
    sps_by_t = [SamplingParams(temperature=t, top_p=a.top_p, top_k=a.top_k,
                               max_tokens=a.max_tokens, ignore_eos=a.ignore_eos) for t in temps]
    conc = [int(c) for c in a.concurrency.split(",")]
    policies = list(dict.fromkeys(x.strip() for x in (a.policies or a.verify_policy).split(",")
                                  if x.strip()))
    acc, src = PAPER_ACCEPTANCE, PAPER_ACCEPTANCE_SOURCE
    if a.acceptance is not None:
        acc, src = [float(x) for x in a.acceptance.split(",")], "--acceptance"
        tokens_per_round(acc, len(acc))          # bad numbers fail here, before any run
    kw = dict(device=a.device, dtype=a.dtype, target_cuda_graphs=a.target_cuda_graphs,
              weight_format=weight_format_for(model, a.weight_format))
    if a.deterministic:
        kw["deterministic"] = True
    specs = {pol: Engine(model, verify_policy=pol, progress=True, **kw) for pol in policies}
    off = Engine(model, speculative="none", **kw)
    spec = specs[policies[0]]
    if spec.drafter is None:
        sys.exit(f"{model}: no DSpark drafter (mtp.* stages), nothing to compare with speculation off")
    if spec.tokenizer is None:                   # random-weight checkpoints have no tokenizer
        prompts = token_prompts(prompts, spec.cfg.vocab_size)
    print(f"model {model}  device {spec.device}  dtype {str(spec.dtype).replace('torch.', '')}  "
          f"weights {kw['weight_format']}  γ={spec.cfg.dspark_block_size}  policies "
          f"{','.join(policies)}  temperature {','.join(map(str, temps))}  {len(prompts)} prompts × "
          f"{a.max_tokens} tokens" + ("  deterministic" if a.deterministic else ""),
          file=sys.stderr)
    split = a.split if a.split is not None else a.model is not None
    sps_ms = {}                        # what the scheduled policies weigh
    for pol, e in specs.items():
        sps = getattr(e.policy, "sps", None)
        if hasattr(sps, "to_grid"):    # round shapes: R requests x q tokens each
            sps_ms[pol] = sps.to_grid()
            print(f"SPS profile of {pol} (R requests x q tokens: round ms): "
                  + ", ".join(f"{r}x{q}: {ms:.2f}" for r, q, ms in sps_ms[pol]))
        elif sps is not None:          # step ms at B tokens
            sps_ms[pol] = sps.to_list()
            print(f"SPS profile of {pol} (B verify tokens: step ms): "
                  + ", ".join(f"{b}: {ms:.2f}" for b, ms in sps_ms[pol]))
    for eng, name in [(off, "off")] + [(e, pol) for pol, e in specs.items()]:
        # every CUDA graph a round replays, captured before any timing (no dummy requests: the
        # per-level warm-up below prefills every prompt once, which compiles the eager shapes)
        info = eng.warmup(prompt_lengths=[], batch_sizes=[])
        if any(info["graphs"].values()):
            print(f"warm-up {name}: graphs held {info['graphs']}, {info['seconds']:.1f} s",
                  file=sys.stderr)
    # the engines live as long as this run: their objects out of the collector's reach while
    # it times (no full collection over them inside a timed run; dspark/heap.py)
    with frozen_heap() as frozen:
        print(f"heap: {frozen} objects frozen (gc.freeze) while timing", file=sys.stderr)
        rows, split_rows = run_levels(off, specs, prompts, sps_by_t, conc, split, a.repeats)
    for t in temps:
        if len(temps) > 1:
            print(f"\ntemperature {t}")
        print_table([r for r in rows if r["temperature"] == t])
    if split_rows:
        print_split(split_rows, spec.cfg.dspark_block_size, acc, src)
    print(f"sample: {rows[0]['dspark']['sample']!r}"[:300])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": rows, "split": split_rows,
                       "sps_ms": sps_ms}, f, indent=2, default=str)
    if a.plot:
        plot(rows, a.plot)
    r = rows[-1]
    print(f"tau={r['dspark']['tau']:.2f} accept_rate={r['dspark']['accept_rate']:.2f} "
          f"speedup={r['speedup']:.2f}x tok/s={r['dspark']['tok_s']:.1f}")


if __name__ == "__main__":
    main()
