"""python -m dspark.bench --profile [--concurrency B] — where the time of one DSpark round goes, at
batch 1 (default) or with B requests in every round.

Every phase is timed by a synchronising wrapper around the engine's own methods (on CUDA a
`torch.cuda.synchronize()` before and after each call, so a phase is charged for the GPU work it
launched, not just for its Python):

  draft             ModelRunner.draft           parallel block + Markov head of the next block
  verify            ModelRunner.target_forward  the target forward over anchor + drafted tokens
  sampling+accept   Engine._accept, _land,      rejection sampling / greedy compare, the read
                    _outputs                     back, stops, bookkeeping, outputs (minus the
                                                 commit calls inside them)
  commit            ModelRunner.commit_context  draft-context rows for the accepted tokens
  other             Engine.step, exclusive      verify policy, scheduler, cache rollback, Python

Times are exclusive (a nested call is charged to its own phase only). Steps that carry a prompt
chunk (prefill) are reported apart and left out of the round split, and so are rounds of fewer
than B requests (the ragged ends of a batch). The table is followed by
the benchmark scripts' saved results (benchmarks/results/*.json), one line each.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import time
from collections import defaultdict

import torch

PHASES = ("draft", "verify", "sampling+accept", "commit", "other")
PHASE_RANGE = "phase:"          # profiler range name prefix with PhaseTimer(annotate=True)


class PhaseTimer:
    """Exclusive wall time per phase of wrapped methods; syncs the device around every call.
    annotate=True also puts every call in a torch.profiler range named "phase:<phase>" that
    ends after the closing sync (trace.py charges kernels to phases by these ranges).

        t = PhaseTimer(device)
        t.wrap(engine.runner, "draft", "draft")      # instance attribute shadows the method
        ...; t.totals -> {phase: seconds}, t.calls -> {phase: n}
    """

    def __init__(self, device, annotate: bool = False):
        dev = torch.device(device)
        self.annotate = annotate
        self.sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        self.totals: dict = defaultdict(float)
        self.calls: dict = defaultdict(int)
        self._stack: list = []          # [phase, start, child seconds]
        self._wrapped: list = []
        self.listeners: list = []       # called with (phase, exclusive s, inclusive s) per call

    def wrap(self, obj, attr: str, phase: str) -> bool:
        """Time every call of obj.attr as `phase`; False (nothing wrapped) if obj has no attr."""
        orig = getattr(obj, attr, None)
        if orig is None or not callable(orig):
            return False

        def timed(*args, **kwargs):
            self.sync()
            self._stack.append([phase, time.perf_counter(), 0.0])
            rng = torch.profiler.record_function(PHASE_RANGE + phase) if self.annotate \
                else contextlib.nullcontext()
            try:
                with rng:
                    try:
                        return orig(*args, **kwargs)
                    finally:
                        self.sync()
            finally:
                ph, t0, child = self._stack.pop()
                dt = time.perf_counter() - t0
                self.totals[ph] += dt - child
                self.calls[ph] += 1
                if self._stack:
                    self._stack[-1][2] += dt
                for fn in self.listeners:
                    fn(ph, dt - child, dt)

        setattr(obj, attr, timed)
        self._wrapped.append((obj, attr))
        return True

    def unwrap(self) -> None:
        for obj, attr in reversed(self._wrapped):
            try:
                delattr(obj, attr)          # the class method shows through again
            except AttributeError:
                pass
        self._wrapped.clear()

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


def instrument_engine(engine, timer: PhaseTimer) -> list:
    """Wrap the DSpark round's methods of `engine`; returns the phases that could be wrapped."""
    done = []
    for obj, attr, phase in ((engine.runner, "draft", "draft"),
                             (engine.runner, "draft_ahead", "draft"),
                             (engine.runner, "target_forward", "verify"),
                             (engine, "_accept", "sampling+accept"),
                             (engine, "_land", "sampling+accept"),
                             (engine, "_outputs", "sampling+accept"),
                             (engine.runner, "commit_context", "commit"),
                             (engine, "step", "other")):
        if timer.wrap(obj, attr, phase):
            done.append(phase)
    return done


def profile_rounds(engine, prompts, sp, warmup_prompts=(), batch: int = 1) -> dict:
    """Run `prompts` in groups of `batch` (each group generated together) and split every decode
    round of `batch` requests by phase. `warmup_prompts` run first, untimed (first-call
    overheads, kernel compiles, graph captures)."""
    from ..sampling import SamplingParams

    engine.scheduler.max_num_seqs = batch
    timer = PhaseTimer(engine.device)
    phases = instrument_engine(engine, timer)
    steps: list = []                       # (exclusive s by phase, prefill step?)
    current = defaultdict(float)
    last = [engine.landed_telemetry]
    partial = [0]

    def listen(phase, excl, incl):
        current[phase] += excl
        if phase == "other":               # Engine.step returned: one step is complete
            # the round it committed (step() launches the next one before it returns)
            tel = engine.landed_telemetry
            if tel is not None and tel is not last[0]:        # the step ran a forward
                last[0] = tel
                if tel["prefill_tokens"] or tel["num_verify"] == batch:
                    steps.append((dict(current), bool(tel["prefill_tokens"])))
                else:
                    partial[0] += 1
            current.clear()

    def params(seed):
        return SamplingParams(**{**sp.__dict__, "seed": seed})

    def groups(ps):
        return [ps[i:i + batch] for i in range(0, len(ps), batch)]

    try:
        for g in groups(list(warmup_prompts)):
            engine.generate(g, [params(10_000 + j) for j in range(len(g))], progress=False)
        last[0] = engine.landed_telemetry
        timer.listeners.append(listen)
        tokens = emitted = n_rounds_metric = 0
        for gi, g in enumerate(groups(list(prompts))):
            outs = engine.generate(g, [params(gi * batch + j) for j in range(len(g))],
                                   progress=False)
            for out in outs:
                tokens += len(out.token_ids)
                emitted += out.metrics.emitted
                n_rounds_metric += out.metrics.rounds
    finally:
        timer.unwrap()
    split, prefill = defaultdict(float), defaultdict(float)
    rounds = sum(1 for _, pf in steps if not pf)
    prefill_steps = len(steps) - rounds
    for s, pf in steps:
        for k, v in s.items():
            (prefill if pf else split)[k] += v
    round_total = sum(split.values())
    return {"phases_wrapped": phases, "batch": batch, "rounds": rounds,
            "prefill_steps": prefill_steps, "partial_rounds": partial[0],
            "output_tokens": tokens,
            "tau": emitted / n_rounds_metric if n_rounds_metric else 0.0,
            "ms_per_round": {k: 1e3 * split.get(k, 0.0) / max(rounds, 1) for k in PHASES},
            "round_ms": 1e3 * round_total / max(rounds, 1),
            "prefill_ms_per_step": {k: 1e3 * prefill.get(k, 0.0) / max(prefill_steps, 1)
                                    for k in PHASES}}


def profile_batch(concurrency) -> int:
    """The one batch size --profile runs at, from the bench's --concurrency value."""
    levels = [x.strip() for x in str(concurrency).split(",") if x.strip()]
    if len(levels) != 1 or not levels[0].isdigit() or int(levels[0]) < 1:
        sys.exit(f"--profile --concurrency {concurrency!r}: the profile runs one batch size; give "
                 "one positive integer (e.g. --concurrency 16)")
    return int(levels[0])


def print_profile(res: dict, header: str) -> None:
    print(header)
    r = res["round_ms"]
    print(f"{'phase':<18} {'ms/round':>9} {'% round':>8}")
    print("-" * 37)
    for k in PHASES:
        v = res["ms_per_round"][k]
        print(f"{k:<18} {v:>9.3f} {100 * v / r if r else 0:>7.1f}%")
    print("-" * 37)
    print(f"{'round':<18} {r:>9.3f} {100.0:>7.1f}%")
    tau = res["tau"] * res.get("batch", 1)          # tokens per round over the batch
    per_tok = r / tau if tau else float("nan")
    print(f"{res['rounds']} decode rounds of {res.get('batch', 1)}, τ = {res['tau']:.2f} tokens/round "
          f"per request -> {per_tok:.3f} ms/token "
          f"({1e3 / per_tok if per_tok == per_tok and per_tok else 0:.1f} tok/s); "
          f"{res['prefill_steps']} prefill steps left out "
          f"({sum(res['prefill_ms_per_step'].values()):.2f} ms each)"
          + (f", {res['partial_rounds']} rounds of fewer requests left out"
             if res.get("partial_rounds") else ""))
    missing = [p for p in PHASES if p not in res["phases_wrapped"]]
    if missing:
        print(f"(not timed: {', '.join(missing)} — the engine has no such method)")


def default_results_dir() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "benchmarks", "results"))


def summarize_result_file(path: str) -> str:
    """One line about a saved benchmark result (dspark/bench/results.py)."""
    from .results import summarize_file
    return summarize_file(path)


def print_results_index(results_dir: str) -> None:
    files = sorted(glob.glob(os.path.join(results_dir, "*.json")))
    print(f"\nbenchmark results in {results_dir}:")
    if not files:
        print("  none yet (run benchmarks/bench_decode_v4.py, bench_attention.py, bench_gemm.py "
              "with --json benchmarks/results/NAME.json)")
        return
    for fn in files:
        print(f"  {os.path.basename(fn)}: {summarize_result_file(fn)}")


def main_profile(a) -> dict:
    """Entry point of `python -m dspark.bench --profile` (argparse namespace of the bench)."""
    from ..engine import Engine, default_model_path
    from ..sampling import SamplingParams
    from .datasets import load_prompts

    model = a.model or default_model_path()
    dataset = a.dataset or os.path.join(model, "heldout_prompts.jsonl")
    batch = profile_batch(getattr(a, "concurrency", "1"))
    n_measured = -(-max(a.num_prompts, batch) // batch) * batch     # whole groups of B
    prompts = load_prompts(dataset, n_measured + batch)
    if len(prompts) < 2 * batch:
        sys.exit(f"--profile --concurrency {batch}: {dataset} has {len(prompts)} prompts; a "
                 f"warm-up group and a measured group of {batch} need {2 * batch}")
    sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                        max_tokens=a.max_tokens, ignore_eos=bool(getattr(a, "ignore_eos", False)))
    from ..model_dir import weight_format_for
    from .datasets import token_prompts
    eng = Engine(model, device=a.device, dtype=a.dtype, verify_policy=a.verify_policy,
                 max_num_seqs=batch, target_cuda_graphs=getattr(a, "target_cuda_graphs", None),
                 weight_format=weight_format_for(model, getattr(a, "weight_format", "auto")),
                 deterministic=getattr(a, "deterministic", False))
    if eng.drafter is None:
        sys.exit(f"{model}: no DSpark drafter, so there are no draft / verify rounds to profile")
    if eng.tokenizer is None:                    # random-weight checkpoints have no tokenizer
        prompts = token_prompts(prompts, eng.cfg.vocab_size)
    measured = prompts[batch:]
    from ..heap import frozen_heap
    with frozen_heap():         # no full collection over the engine's objects (dspark/heap.py)
        res = profile_rounds(eng, measured, sp, warmup_prompts=prompts[:batch], batch=batch)
    res.update(model=model, device=str(eng.device), dtype=str(eng.dtype).replace("torch.", ""),
               gamma=eng.cfg.dspark_block_size, policy=a.verify_policy,
               temperature=a.temperature, prompts=len(measured),
               max_tokens=a.max_tokens)
    if not res["rounds"]:
        print(f"warning: no decode round of {batch} requests was timed (requests finished "
              f"before their group decoded together: raise --max-tokens or pass --ignore-eos)",
              file=sys.stderr)
    print_profile(res, f"DSpark round latency, batch {batch} — model {model}  device {eng.device}  "
                       f"dtype {res['dtype']}  γ={res['gamma']}  policy {a.verify_policy}  "
                       f"temperature {a.temperature}  {res['prompts']} prompts × "
                       f"{a.max_tokens} tokens" + ("  deterministic" if eng.config.deterministic
                                                   else ""))
    if getattr(a, "trace", False):
        from .trace import print_trace, trace_rounds
        if eng.device.type == "cuda":
            res["trace"] = trace_rounds(eng, measured[:2 * batch], sp, batch=batch)
            print_trace(res["trace"])
        else:
            print("\n--trace: skipped, it attributes CUDA kernels to the phases (run it on a GPU)")
    print_results_index(getattr(a, "results_dir", None) or default_results_dir())
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "profile": res}, f, indent=2, default=str)
    return res
