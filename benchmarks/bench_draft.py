"""Time the DSpark draft pass (and, on CUDA, one DSpark round) with the shipped default model.

Per batch size R and draft temperature T: ms per `ModelRunner.draft` call (CPU: this thread's CPU
time, CUDA: wall time) with context committed at varied positions (inside the first window, past
the ring capacity); the top-level aten ops one draft call and one round of context commits
dispatch (torch.profiler; nested aten calls counted once), also without pure view ops and no-op
casts (roughly the kernels a GPU would launch). On CUDA also: CUDA-graph replay vs eager
(outputs compared: tokens, q, confidences) and ms per `Engine.step()` at batch 1 (greedy, a
held-out prompt) with speculation on (graphs on / off) and off.

    python benchmarks/bench_draft.py                    # R = 1, 8
    python benchmarks/bench_draft.py --batch 1 8 32 --json out/bench_draft.json
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dspark import Engine, SamplingParams  # noqa: E402

POSITIONS = [200, 5, 127, 128, 300, 64, 129, 700]     # committed context length per request


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_requests(engine, R, temperature=1.0, seed=0):
    """R synthetic running requests with random draft context committed at 0..P-1."""
    runner, cfg = engine.runner, engine.cfg
    gen = torch.Generator().manual_seed(seed)
    width = len(cfg.dspark_target_layer_ids) * cfg.hidden_size
    reqs = []
    for r in range(R):
        P = POSITIONS[r % len(POSITIONS)] + r // len(POSITIONS)
        _, ds = runner.new_states()
        taps = torch.randn(P, width, generator=gen).to(engine.device, engine.dtype)
        runner.commit_context(ds, taps[: P // 2], 0)            # two commits, like prefill + verify
        runner.commit_context(ds, taps[P // 2:], P // 2)
        reqs.append(SimpleNamespace(anchor=(7 * r + 3) % cfg.vocab_size, num_committed=P,
                                    draft_state=ds, seed=1000 + r,
                                    params=SamplingParams(temperature=temperature)))
    return reqs


def clock(device):
    """Wall time on CUDA; on CPU this thread's CPU time (robust on a shared, busy machine)."""
    return time.perf_counter() if device.type == "cuda" else time.thread_time()


def time_draft(runner, reqs, device, iters):
    for _ in range(3):
        runner.draft(reqs)
    times = []
    for _ in range(iters):
        sync(device)
        t0 = clock(device)
        runner.draft(reqs)
        sync(device)
        times.append(1e3 * (clock(device) - t0))
    return statistics.median(times)


def commit_round(runner, reqs, rows=3):
    """A round's context commits: each request commits `rows` verified positions (rewriting its
    last ones, so the state stays put), written to the drafter's context (batched where the
    runner queues commits)."""
    width = runner.drafter.main_proj.weight.shape[1]
    taps = torch.randn(len(reqs) * rows, width, device=reqs[0].draft_state.pool.device
                       if getattr(reqs[0].draft_state, "pool", None) is not None else "cpu")

    def once():
        for i, r in enumerate(reqs):
            runner.commit_context(r.draft_state, taps[i * rows:(i + 1) * rows],
                                  r.num_committed - rows)
        if hasattr(runner, "flush_context"):
            runner.flush_context()
    return once


def time_commit_and_draft(runner, reqs, device, iters):
    commit = commit_round(runner, reqs)

    def once():
        commit()
        runner.draft(reqs)
    for _ in range(3):
        once()
    times = []
    for _ in range(iters):
        sync(device)
        t0 = clock(device)
        once()
        sync(device)
        times.append(1e3 * (clock(device) - t0))
    return statistics.median(times)


# aten ops that only make a new view of their input (no kernel), and ops that copy only when
# they have to (a copy_ below them tells)
VIEW_OPS = {"view", "slice", "select", "unsqueeze", "squeeze", "flatten", "unflatten", "t",
            "expand", "as_strided", "view_as_complex", "view_as_real", "permute", "transpose",
            "split", "chunk", "detach", "alias", "unbind", "narrow", "_unsafe_view", "lift_fresh",
            "split_with_sizes", "numpy_T", "expand_as", "unfold", "diagonal", "_reshape_alias"}
MAYBE_COPY_OPS = {"to", "contiguous", "reshape", "type_as", "float", "_to_copy", "clone"}


def count_aten_ops(fn):
    """(top-level aten ops of one fn() call, those of them that do work: not views, and casts /
    reshapes only when they copy). An aten op called from inside another is not counted."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()

    def copies(e):
        return any(c.name == "aten::copy_" or copies(c) for c in e.cpu_children)
    total = working = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        parent = e.cpu_parent
        while parent is not None and not parent.name.startswith("aten::"):
            parent = parent.cpu_parent
        if parent is not None:
            continue
        total += 1
        op = e.name[len("aten::"):]
        working += op not in VIEW_OPS and (op not in MAYBE_COPY_OPS or copies(e))
    return total, working


def compare(a, b):
    """max |difference| of (tokens equal?, q, confidences) between two lists of DraftBlocks."""
    same = all(torch.equal(x.tokens, y.tokens) for x, y in zip(a, b))
    dq = max(((x.probs - y.probs).abs().max().item() for x, y in zip(a, b)
              if x.probs is not None), default=0.0)
    dc = max((x.conf_logits - y.conf_logits).abs().max().item() for x, y in zip(a, b))
    return same, dq, dc


def time_rounds(engine, steps, num_prompts=4):
    """(ms per Engine.step(), tokens / s) at batch 1 in steady decode: greedy, EOS ignored,
    `steps` rounds spread over the first held-out prompts (token ids when there are none)."""
    path = os.path.join(engine.path, "heldout_prompts.jsonl")
    prompts = [list(range(3 + i, 67 + i)) for i in range(num_prompts)]
    if engine.tokenizer is not None and os.path.exists(path):
        with open(path) as f:
            prompts = [json.loads(line)["prompt"] for line, _ in zip(f, range(num_prompts))]
    total_s, n_tokens, n_steps = 0.0, 0, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps * 8 + 64,
                                                  ignore_eos=True))
        for _ in range(3):                # prefill + warm-up (graph capture happens here)
            engine.step()
        todo = steps // len(prompts) + (i < steps % len(prompts))
        sync(engine.device)
        t0 = time.perf_counter()
        for _ in range(todo):
            n_tokens += sum(len(o.new_token_ids) for o in engine.step())
        sync(engine.device)
        total_s += time.perf_counter() - t0
        n_steps += todo
        for rid in list(engine.requests):
            engine.abort(rid)
    return 1e3 * total_s / n_steps, n_tokens / total_s


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--temperature", type=float, nargs="+", default=[1.0, 0.0],
                    help="draft requests' temperature (0: greedy, the argmax-only pass)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--steps", type=int, default=100, help="Engine.step() calls timed (CUDA)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the shipped model)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    has_flag = "cuda_graphs" in inspect.signature(Engine.__init__).parameters
    kw = {"cuda_graphs": False} if has_flag else {}
    eager = Engine(args.model, device=device, max_num_seqs=max(args.batch), **kw)
    out = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "draft": []}
    graphs = Engine(args.model, device=device, max_num_seqs=max(args.batch), cuda_graphs=True) \
        if has_flag and device == "cuda" else None
    for R in args.batch:
        for T in args.temperature:
            row = {"R": R, "T": T}
            reqs = make_requests(eager, R, temperature=T)
            row["eager_ms"] = time_draft(eager.runner, reqs, eager.device, args.iters)
            row["aten_ops"], row["aten_ops_doing_work"] = count_aten_ops(
                lambda: eager.runner.draft(reqs))
            row["commit_aten_ops"], row["commit_aten_ops_doing_work"] = count_aten_ops(
                commit_round(eager.runner, reqs))
            row["commit_and_draft_ms"] = time_commit_and_draft(eager.runner, reqs, eager.device,
                                                               args.iters)
            if graphs is not None:
                greqs = make_requests(graphs, R, temperature=T)
                row["graph_ms"] = time_draft(graphs.runner, greqs, graphs.device, args.iters)
                row["graph_commit_and_draft_ms"] = time_commit_and_draft(
                    graphs.runner, greqs, graphs.device, args.iters)
                same, dq, dc = compare(eager.runner.draft(reqs), graphs.runner.draft(greqs))
                row.update(graph_tokens_equal=same, graph_max_dq=dq, graph_max_dconf=dc,
                           graphs_on=graphs.runner.draft_pass.cuda_graphs)
            print(json.dumps(row), flush=True)
            out["draft"].append(row)
    if device == "cuda":
        rounds = {}
        for name, eng in (("dspark_graphs", graphs), ("dspark_eager", eager),
                          ("none", Engine(args.model, device=device, speculative="none"))):
            if eng is not None:
                ms, tps = time_rounds(eng, args.steps)
                rounds[name] = {"ms_per_step": ms, "tokens_per_s": tps,
                                "tokens_per_step": tps * ms / 1e3}
                print(name, json.dumps(rounds[name]), flush=True)
        base = rounds["none"]["tokens_per_s"]
        for name, r in rounds.items():
            r["speedup_vs_none"] = r["tokens_per_s"] / base
        out["rounds_batch1"] = rounds
        print(json.dumps(rounds))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
