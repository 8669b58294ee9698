"""Round split per batch size (`python -m dspark.bench --split`, on by default with --model).

For each concurrency level c, an untimed closed-loop run of each engine with every phase of the
round timed by `PhaseTimer` (profile.py: the device is synchronised around each phase, so the
split is the non-overlapped cost of each part): draft, verify (the target forward), accept
(sampling + acceptance), commit (draft context), other (policy, scheduler, Python). Only steps
that carry no prompt chunk and run all c requests count. The speculation-off engine's step at
the same batch is its plain decode step, timed the same way.

Projected speed-up at a given per-position acceptance (random-weight checkpoints accept almost
nothing, so their measured τ says nothing about the round's worth): with a_k the fraction of
rounds that accept draft position k (cumulative: a_1 >= a_2 >= ...), a round emits
E = 1 + Σ_{k<=γ} a_k tokens per request, so the speed-up over plain decoding at batch c is
E · (decode step ms) / (round ms).
"""
from __future__ import annotations

from collections import defaultdict

from .profile import PHASES, PhaseTimer, instrument_engine

# dspark.md §9 "Other paper anchors": V4-Flash-DSpark, GSM8K, temperature 0, γ = 5, per-position
# acceptance 0.896 / 0.776 / 0.656 / 0.552 / 0.450 (mean acceptance length 4.33; vllm-ascend
# #15269 — third-party data on the paper's released drafter: the paper itself gives τ per
# dataset (Table 1) and conditional acceptance curves (Fig. 2), not V4-Flash per-position rates)
PAPER_ACCEPTANCE = (0.896, 0.776, 0.656, 0.552, 0.450)
PAPER_ACCEPTANCE_SOURCE = ("dspark.md §9: V4-Flash-DSpark GSM8K T=0 γ=5 per-position acceptance "
                           "(vllm-ascend #15269)")


def tokens_per_round(acceptance, gamma: int) -> float:
    """E = 1 + Σ_{k<=γ} a_k for cumulative per-position acceptance a (positions past the list
    count 0: a conservative projection for γ > len(a))."""
    a = list(acceptance)[:gamma]
    if any(not 0 <= x <= 1 for x in a) or any(x < y for x, y in zip(a, a[1:])):
        raise ValueError(f"per-position acceptance must be in [0, 1] and non-increasing "
                         f"(fraction of rounds accepting position k), got {a}")
    return 1.0 + sum(a)


def split_rounds(engine, prompts, sp, concurrency: int, run_once) -> dict:
    """Mean exclusive ms per phase over the full-batch decode steps of one closed-loop run."""
    timer = PhaseTimer(engine.device)
    phases = instrument_engine(engine, timer)
    steps, current = [], defaultdict(float)
    last = [engine.landed_telemetry]

    def listen(phase, excl, incl):
        current[phase] += excl
        if phase == "other":                 # Engine.step returned: one step is complete
            tel = engine.landed_telemetry    # the round it committed (not the one it launched)
            if tel is not None and tel is not last[0]:
                steps.append((dict(current), tel["num_verify"], bool(tel["prefill_tokens"])))
                last[0] = tel
            current.clear()

    timer.listeners.append(listen)
    try:
        run_once(engine, prompts, sp, concurrency, f"split c={concurrency}")
    finally:
        timer.unwrap()
    decode = [(s, n) for s, n, pf in steps if not pf]
    batch = max((n for _, n in decode), default=0)
    full = [s for s, n in decode if n == batch]
    ms = {k: 1e3 * sum(s.get(k, 0.0) for s in full) / max(len(full), 1) for k in PHASES}
    return {"batch": batch, "steps": len(full), "ms": ms, "round_ms": sum(ms.values()),
            "phases_wrapped": phases}


def print_split(rows, gamma: int, acceptance, source: str) -> None:
    """rows: [{"concurrency", "policy", "split", "off_split", "tau"}]."""
    e = tokens_per_round(acceptance, gamma)
    print("\nround split per batch (ms, device synced around each phase; full-batch decode steps)")
    print(f"projection at {source}: {' / '.join(f'{x:.3f}' for x in acceptance[:gamma])} "
          f"-> {e:.2f} tokens per request-round")
    head = (f"{'batch':>5} {'policy':<16} {'draft':>7} {'verify':>7} {'accept':>7} {'commit':>7} "
            f"{'other':>7} {'round':>7} {'decode':>7} {'rnd/dec':>7} {'tau':>5} {'measured':>8} "
            f"{'projected':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        s, o = r["split"], r["off_split"]
        m, dec = s["ms"], o["round_ms"]
        ratio = s["round_ms"] / dec if dec else float("nan")
        meas = r["tau"] * dec / s["round_ms"] if s["round_ms"] else float("nan")
        proj = e * dec / s["round_ms"] if s["round_ms"] else float("nan")
        r.update(round_over_decode=ratio, projected_speedup=proj, measured_split_speedup=meas)
        print(f"{s['batch']:>5} {r['policy']:<16} {m['draft']:>7.2f} {m['verify']:>7.2f} "
              f"{m['sampling+accept']:>7.2f} {m['commit']:>7.2f} {m['other']:>7.2f} "
              f"{s['round_ms']:>7.2f} {dec:>7.2f} {ratio:>6.2f}x {r['tau']:>5.2f} {meas:>7.2f}x "
              f"{proj:>8.2f}x")
