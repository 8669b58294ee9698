"""Qwen3 target decode speed vs transformers, and the DSpark round latency split.

    python benchmarks/bench_qwen3.py --json out/bench_qwen3.json            # H200: Qwen3-4B widths
    python benchmarks/bench_qwen3.py --preset tiny --max-tokens 32          # CPU smoke run

Without --model it writes random checkpoints with dspark.tools.make_qwen3_checkpoint (preset `4b`:
Qwen3-4B widths, all 36 layers unless --layers; bf16; draws on the GPU when there is one, so the
8 GB target takes seconds) into --workdir and reuses them on later runs. Then, on the same
checkpoint and the same random prompts (--prompt-len tokens, batch sizes --batch):

* target-only decode tokens/s: ours with CUDA graphs (speculative off), ours eager (graphs off,
  for reference), and transformers' `Qwen3ForCausalLM.generate(do_sample=False,
  min_new_tokens=N)`. Decode time is t(N new tokens) - t(1 new token), so prefill and the first
  token are excluded the same way for both;
* greedy agreement: common prefix of our tokens and HF's over the first --check-tokens tokens
  (bf16 kernels differ, so a random model may diverge late; the first tokens should agree);
* the DSpark round split with a random DeepSpec drafter (--draft or made here, no embedding
  copies): per decode round, synchronised wall time of the target verify forward, the draft
  pass, sampling + acceptance (incl. committing draft context) and the rest of `Engine.step`.
  A random drafter is almost never accepted, so this measures costs, not speed-up.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dspark import Engine, SamplingParams  # noqa: E402
from dspark.tools.make_qwen3_checkpoint import make_qwen3_checkpoint  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def checkpoints(a, dev: str) -> tuple[str, str | None, float]:
    """(target dir, drafter dir or None, seconds spent writing random ones). A random drafter is
    made for the target's depth from --preset, so only for targets of the preset's widths."""
    from dspark.tools.make_qwen3_checkpoint import PRESETS
    t0 = time.perf_counter()
    target = a.model or os.path.join(a.workdir, f"{a.preset}_L{a.layers or 'all'}", "target")
    if not os.path.exists(os.path.join(target, "config.json")):
        print(f"writing a random {a.preset} target checkpoint to {target} ...", flush=True)
        make_qwen3_checkpoint(target, a.preset, "target", a.layers, seed=0, dtype="bf16", device=dev)
    draft = a.draft
    if draft is None and not a.no_dspark:
        cfg, want = json.load(open(os.path.join(target, "config.json"))), PRESETS[a.preset]["target"]
        if any(cfg[k] != want[k] for k in ("hidden_size", "vocab_size", "num_attention_heads")):
            print(f"{target} does not have the {a.preset} widths: pass --draft for the round split")
        else:
            layers = cfg["num_hidden_layers"]
            draft = os.path.join(a.workdir, f"{a.preset}_L{layers}", "dspark")
            if not os.path.exists(os.path.join(draft, "config.json")):
                print(f"writing a random {a.preset} drafter checkpoint to {draft} ...", flush=True)
                make_qwen3_checkpoint(draft, a.preset, "dspark", layers, seed=0, dtype="bf16",
                                      embed_copies=False, device=dev)
    return target, draft, time.perf_counter() - t0


def decode_rate(run, batch: int, n: int, repeats: int) -> dict:
    """run(k) -> (seconds, tokens) generating k new tokens per prompt; decode tokens/s from
    t(n) - t(1), best of `repeats` each."""
    t1 = min(run(1)[0] for _ in range(repeats))
    best, toks = float("inf"), None
    for _ in range(repeats):
        t, toks = run(n)
        best = min(best, t)
    dt = max(best - t1, 1e-9)
    return {"tokens_per_s": batch * (n - 1) / dt, "ms_per_step": 1e3 * dt / (n - 1),
            "t_first_s": t1, "t_total_s": best, "tokens": toks}


def ours_runner(eng, prompts):
    def run(k):
        sp = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
        sync()
        t = time.perf_counter()
        outs = eng.generate(prompts, sp)
        sync()
        return time.perf_counter() - t, [o.token_ids for o in outs]
    return run


def hf_runner(model, prompts, dev):
    ids = torch.tensor(prompts, device=dev)
    mask = torch.ones_like(ids)
    pad = model.config.eos_token_id if model.config.eos_token_id is not None else 0
    pad = pad[0] if isinstance(pad, (list, tuple)) else pad

    @torch.inference_mode()
    def run(k):
        sync()
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k,
                             do_sample=False, pad_token_id=pad)
        sync()
        return time.perf_counter() - t, out[:, ids.shape[1]:].tolist()
    return run


def prefix_agreement(a: list, b: list, k: int) -> dict:
    """Common-prefix length of each pair of token lists within the first k tokens."""
    pre = []
    for x, y in zip(a, b):
        n = 0
        while n < min(k, len(x), len(y)) and x[n] == y[n]:
            n += 1
        pre.append(n)
    return {"check_tokens": k, "min_prefix": min(pre), "mean_prefix": statistics.mean(pre),
            "all_agree": all(p == min(k, len(x), len(y)) for p, x, y in zip(pre, a, b))}


def round_split(eng, prompts, n: int) -> dict:
    """Mean synchronised ms per decode round of each part of Engine.step (prefill steps dropped)."""
    parts, cur = [], {}

    def timed(fn, name):
        def wrapper(*args, **kw):
            sync()
            t = time.perf_counter()
            out = fn(*args, **kw)
            sync()
            cur[name] = cur.get(name, 0.0) + time.perf_counter() - t
            return out
        return wrapper

    step = eng.step
    eng.runner.target_forward = timed(eng.runner.target_forward, "verify")
    eng.runner.draft = timed(eng.runner.draft, "draft")
    eng._accept = timed(eng._accept, "accept")

    def timed_step():
        cur.clear()
        sync()
        t = time.perf_counter()
        out = step()
        sync()
        total = time.perf_counter() - t
        if eng.telemetry and eng.telemetry[-1]["prefill_tokens"] == 0:
            parts.append(dict(cur, total=total))
        return out
    eng.step = timed_step
    try:
        outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    finally:
        for name in ("step", "_accept"):
            eng.__dict__.pop(name, None)
        for name in ("target_forward", "draft"):
            eng.runner.__dict__.pop(name, None)
    mean = lambda k: 1e3 * statistics.mean(p.get(k, 0.0) for p in parts)   # noqa: E731
    split = {k: mean(k) for k in ("verify", "draft", "accept", "total")}
    split["other"] = split["total"] - split["verify"] - split["draft"] - split["accept"]
    split["rounds"] = len(parts)
    split["mean_accepted_length"] = statistics.mean(o.metrics.mean_accepted_length for o in outs)
    return split


def measure_ours(target, kw, prompts, batches, a, res) -> dict:
    """Target-only decode, one engine: graphs on, then toggled off for the eager reference."""
    t = time.perf_counter()
    # on CPU cuda_graphs=True runs the same fixed-shape path uncaptured
    eng = Engine(target, speculative="none", cuda_graphs=True, **kw)
    res["load_s"] = time.perf_counter() - t
    graphs = eng.runner.target_graphs
    res["graphs_captured"] = graphs.capture
    ours = {}
    for B in batches:
        run = ours_runner(eng, prompts[:B])
        t = time.perf_counter()
        run(4)                                       # warm-up: Triton JIT, graph capture
        ours[B] = {"warmup_s": time.perf_counter() - t,
                   "graphs": decode_rate(run, B, a.max_tokens, a.repeats)}
        eng.runner.target_graphs = None
        ours[B]["eager"] = decode_rate(run, B, a.max_tokens, a.repeats)
        eng.runner.target_graphs = graphs
    return ours


def measure_hf(target, tdtype, dev, prompts, batches, a, res) -> dict:
    from transformers import Qwen3ForCausalLM
    gc.collect()
    if dev.startswith("cuda"):
        torch.cuda.empty_cache()
    t = time.perf_counter()
    model = Qwen3ForCausalLM.from_pretrained(target, dtype=tdtype).to(dev).eval()
    res["hf_load_s"] = time.perf_counter() - t
    hf = {}
    for B in batches:
        run = hf_runner(model, prompts[:B], dev)
        run(4)                                       # warm-up
        hf[B] = decode_rate(run, B, a.max_tokens, a.repeats)
    return hf


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Qwen3 target checkpoint dir (default: a random one in --workdir)")
    p.add_argument("--draft", help="DeepSpec DSpark drafter dir for the round split (default: random)")
    p.add_argument("--preset", choices=("4b", "tiny"), default="4b")
    p.add_argument("--layers", type=int, help="target depth of the random checkpoint (default: all)")
    p.add_argument("--workdir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_qwen3"))
    p.add_argument("--batch", default="1", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--dspark-tokens", type=int, default=64, help="new tokens in the round split")
    p.add_argument("--check-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--no-hf", action="store_true", help="skip transformers")
    p.add_argument("--no-dspark", action="store_true", help="skip the DSpark round split")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    dev = a.device
    dtype = a.dtype or ("bf16" if dev.startswith("cuda") else "fp32")
    tdtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    batches = [int(b) for b in a.batch.split(",")]
    t_start = time.perf_counter()
    target, draft, t_ckpt = checkpoints(a, "cuda" if dev.startswith("cuda") else "cpu")
    cfg = json.load(open(os.path.join(target, "config.json")))
    rng = random.Random(0)
    prompts = [[rng.randrange(cfg["vocab_size"]) for _ in range(a.prompt_len)] for _ in range(max(batches))]
    pages = -(-(a.prompt_len + max(a.max_tokens, a.dspark_tokens) + 16) // 256)
    kw = dict(device=dev, dtype=dtype, max_num_seqs=max(batches), num_kv_blocks=max(batches) * pages + 1)
    res = {"device": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
           "torch": torch.__version__, "model": target, "dtype": dtype,
           "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"],
           "prompt_len": a.prompt_len, "max_tokens": a.max_tokens, "checkpoint_s": t_ckpt,
           "batches": {}}

    # each phase in its own function: its engine / model is freed before the next one loads
    ours = measure_ours(target, kw, prompts, batches, a, res)
    hf = {} if a.no_hf else measure_hf(target, tdtype, dev, prompts, batches, a, res)
    split = {}
    if draft is not None and not a.no_dspark:
        gc.collect()
        eng = Engine(target, draft=draft, **kw)
        dp = eng.runner.draft_pass
        for B in batches:
            round_split(eng, prompts[:B], 8)         # warm-up (draft-pass graph capture)
            split[B] = round_split(eng, prompts[:B], a.dspark_tokens)
            split[B]["draft_graphs"] = dp.cuda_graphs
            if dp.cuda_graphs:                       # the same rounds with the draft pass eager
                dp.cuda_graphs = False
                split[B]["draft_eager"] = round_split(eng, prompts[:B], a.dspark_tokens)
                dp.cuda_graphs = True
        del eng

    # ---- report -----------------------------------------------------------------------------------
    print(f"\nQwen3 target {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab "
          f"{cfg['vocab_size']}, {dtype}, {res['device']}; prompt {a.prompt_len}, "
          f"{a.max_tokens} new tokens" + ("" if res["graphs_captured"] else
                                          "\n('ours graphs' = the fixed-shape path uncaptured: no CUDA)"))
    hdr = (f"{'batch':>5} | {'ours graphs':>12} | {'ours eager':>11} | {'HF generate':>11} | "
           f"{'graphs/HF':>9} | {'ms/step graphs':>14} | agree(HF) | agree(eager)")
    print(hdr + "\n" + "-" * len(hdr))
    for B in batches:
        g, e = ours[B]["graphs"], ours[B]["eager"]
        row = {"ours_graphs_tokens_per_s": g["tokens_per_s"], "ours_eager_tokens_per_s": e["tokens_per_s"],
               "ours_graphs_ms_per_step": g["ms_per_step"], "ours_eager_ms_per_step": e["ms_per_step"],
               "warmup_s": ours[B]["warmup_s"],
               "agreement_graphs_vs_eager": prefix_agreement(g["tokens"], e["tokens"], a.max_tokens)}
        hf_tps, ratio, agree = float("nan"), float("nan"), None
        if B in hf:
            hf_tps = hf[B]["tokens_per_s"]
            ratio = g["tokens_per_s"] / hf_tps
            agree = prefix_agreement(g["tokens"], hf[B]["tokens"], a.check_tokens)
            row.update(hf_tokens_per_s=hf_tps, hf_ms_per_step=hf[B]["ms_per_step"],
                       speedup_graphs_vs_hf=ratio, agreement_vs_hf=agree)
        ag = row["agreement_graphs_vs_eager"]
        print(f"{B:>5} | {g['tokens_per_s']:>10.1f}/s | {e['tokens_per_s']:>9.1f}/s | {hf_tps:>9.1f}/s | "
              f"{ratio:>8.2f}x | {g['ms_per_step']:>14.2f} | "
              f"{'-' if agree is None else str(agree['min_prefix']) + '/' + str(a.check_tokens):>9} | "
              f"{ag['min_prefix']}/{a.max_tokens}")
        if B in split:
            row["dspark_round_ms"] = split[B]
        res["batches"][B] = row
    if split:
        print("\nDSpark round (random drafter, target + draft graphs on; mean ms per decode round, synchronised)")
        print(f"{'batch':>5} | {'verify':>7} | {'draft':>7} | {'accept':>7} | {'other':>7} | "
              f"{'total':>7} | rounds | tau")
        for B, s in split.items():
            print(f"{B:>5} | {s['verify']:>7.2f} | {s['draft']:>7.2f} | {s['accept']:>7.2f} | "
                  f"{s['other']:>7.2f} | {s['total']:>7.2f} | {s['rounds']:>6} | "
                  f"{s['mean_accepted_length']:.2f}")
            if "draft_eager" in s:
                e = s["draft_eager"]
                print(f"{'':>5} | draft pass eager (no graphs): draft {e['draft']:.2f}, total "
                      f"{e['total']:.2f} ms")
    res["total_s"] = time.perf_counter() - t_start
    print(f"\ncheckpoints {t_ckpt:.1f}s, total {res['total_s']:.1f}s")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
