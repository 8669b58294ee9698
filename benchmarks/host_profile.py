"""Where the host time of a DSpark round goes: cProfile over the timed closed-loop run of
`python -m dspark.bench` (shipped pair by default), per concurrency level, after the same warm-up.

    python benchmarks/host_profile.py --concurrency 1,4 --temperature 0 --top 30

Prints, per level, tok/s and rounds/s without and with the profiler (its overhead inflates every
Python call about alike, so read the shares, not the absolute times), then the functions with the
most own time and the engine's round phases by cumulative time, both in microseconds per round.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats

from dspark.bench.__main__ import run_once, warm_up
from dspark.bench.datasets import load_prompts
from dspark.engine import Engine, default_model_path
from dspark.sampling import SamplingParams

PHASES = ("_round", "_verify_lengths", "schedule", "_forward_items", "target_forward", "run",
          "_producers", "_accept", "decide", "_commit", "_draft_running", "draft", "flush_context",
          "_output", "step", "draft_ahead")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("--verify-policy", default="fixed")
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args(argv)
    model = a.model or default_model_path()
    import os
    prompts = load_prompts(os.path.join(model, "heldout_prompts.jsonl"), a.num_prompts)
    sp = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, ignore_eos=True)
    eng = Engine(model, verify_policy=a.verify_policy)
    eng.warmup(prompt_lengths=[], batch_sizes=[])
    for c in (int(x) for x in a.concurrency.split(",")):
        warm_up(eng, prompts, sp, c, "dspark")
        plain = run_once(eng, prompts, sp, c, f"plain c={c}")
        prof = cProfile.Profile()
        prof.enable()
        res = run_once(eng, prompts, sp, c, f"profiled c={c}")
        prof.disable()
        rounds = max(res["rounds"] / max(c, 1), 1)  # metrics count request-rounds
        print(f"\n=== c={c} T={a.temperature} {a.verify_policy}: {plain['tok_s']:.0f} tok/s "
              f"(profiled {res['tok_s']:.0f}), {plain['rounds'] / c / plain['wall_s']:.0f} "
              f"rounds/s, round {1e3 * plain['wall_s'] * c / plain['rounds']:.2f} ms, "
              f"tau {plain['tau']:.2f}, c/g/e {plain['compile_stats']}")
        st = pstats.Stats(prof)
        rows = []
        for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
            rows.append((tt, ct, nc, f"{os.path.basename(file)}:{line}({fn})"))
        print(f"{'own us/round':>13} {'cum us/round':>13} {'calls/round':>12}  function")
        for tt, ct, nc, name in sorted(rows, reverse=True)[:a.top]:
            print(f"{1e6 * tt / rounds:>13.1f} {1e6 * ct / rounds:>13.1f} {nc / rounds:>12.1f}  {name}")
        print("engine phases (cumulative):")
        for tt, ct, nc, name in sorted(rows, key=lambda r: -r[1]):
            fn = name.rsplit("(", 1)[1][:-1]
            if fn in PHASES and ("engine.py" in name or "runner.py" in name or "scheduler.py" in name
                                 or "accept.py" in name or "graph.py" in name
                                 or "draft_pass.py" in name):
                print(f"{'':>13} {1e6 * ct / rounds:>13.1f} {nc / rounds:>12.1f}  {name}")
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
        print(s.getvalue()[-9000:])


if __name__ == "__main__":
    main()
