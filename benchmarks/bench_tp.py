"""Decode tokens/s of a V4-Flash-width checkpoint vs tensor-parallel world size (issue 9).

Checkpoint: `--model DIR`, or a random one in the official layout (the tensors of
`python -m dspark.tools.make_checkpoint --preset flash --layers N --dtype fp8 --fp4-experts`, byte
for byte, written shard-parallel by benchmarks/bench_decode_v4.py's writer into --workdir and
reused when its config.json matches). Every world size loads it with
`Engine(path, tensor_parallel_size=W, weight_format="quantized", speculative="none")`: each rank
keeps its FP8 codes + 128x128 scale tiles and its routed experts packed FP4 (world 1 is the
single-device engine; W > 1 spawns W-1 worker processes, NCCL between GPUs, gloo on CPU).

Per world size in --world (sizes above torch.cuda.device_count() are skipped on CUDA):
  load_s      Engine construction (all ranks' shards read and placed), device synchronised
  memory      per rank: weight bytes by format (memory_report) and, on CUDA, allocated / peak /
              reserved device memory after the runs
  decode      per batch size B in --batch (default 1,8): B random --prompt-len-token prompts,
              greedy, EOS ignored. A warm-up generate (--warmup-tokens) first (Triton compiles,
              excluded); then t1 = wall time of generate(max_tokens=1) and tN = generate(
              max_tokens=N), the best of --repeats each; decode tok/s = B * (N - 1) / (tN - t1)
              (prefill cancels), end-to-end tok/s = B * N / tN.
  agreement   greedy tokens of every request against world 1 (leading run of equal tokens; the
              weights are random, so logits are nearly tied and a late flip from another
              reduction order is numerics, an early one is worth a look).
Before loading, the weight bytes each rank will hold (max over ranks) are estimated from the
sharding plan and printed.

    python benchmarks/bench_tp.py --json benchmarks/results/bench_tp_h200x2.json   # 2 H200s
    python benchmarks/bench_tp.py --preset tiny --device cpu                         # CPU smoke (gloo)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # repo root
sys.path.insert(0, _HERE)

from bench_decode_v4 import _leading_agreement as _leading, prepare_checkpoint  # noqa: E402

from dspark.models.deepseek_v4.weights import stored_tensors, tensor_inventory  # noqa: E402
from dspark.tools import make_checkpoint as mc  # noqa: E402

PRESET_DEFAULTS = {   # layers, new tokens, prompt length
    "flash": (8, 32, 64),
    "pro": (4, 32, 64),
    "tiny": (6, 8, 12),
}


def weight_bytes_per_rank(cfg, world: int, dtype: torch.dtype, drafter: bool = False) -> list[int]:
    """Weight bytes each rank holds with weight_format="quantized": FP8 / FP4 tensors as stored
    (codes + e8m0 scales, pro rata to the rank's part), bf16 kinds in `dtype`, fp32 / int64 as
    such; the rank's share under ShardPlan (routed experts e % world == rank)."""
    from dspark.distributed.sharding import SKIP, ShardPlan
    elt = torch.empty((), dtype=dtype).element_size()
    size = {"fp32": 4, "int64": 8, "bf16": elt}
    inv = tensor_inventory(cfg)
    out = []
    for rank in range(world):
        plan = ShardPlan(cfg, rank, world)
        total = 0
        for name, spec in inv.items():
            if name.startswith("mtp.") and not drafter:
                continue
            shape = plan.local_shape(name, spec.shape) if plan.slices(name) is not SKIP else None
            if shape is None:
                continue
            frac = math.prod(shape) / max(math.prod(spec.shape), 1)
            if spec.kind in ("fp8", "fp4"):
                total += frac * sum(st.nbytes for st in stored_tensors(name, spec))
            else:
                total += math.prod(shape) * size.get(spec.kind, elt)
        out.append(int(total))
    return out


def _sync(device):
    """Rank 0's device only (other GPUs get no context in this process): a generate step ends
    after every rank's all-reduces, so rank 0 finishing bounds them all."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(n)]


def _generate(eng, prompts, n: int):
    from dspark.sampling import SamplingParams
    _sync(eng.device)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    _sync(eng.device)
    return [list(o.token_ids) for o in outs], time.perf_counter() - t0


def _rank_memory(eng, world: int) -> list[dict]:
    if world > 1:
        return [{k: v for k, v in s.items() if k in ("rank", "weights", "cuda_allocated",
                                                     "cuda_max_allocated", "cuda_reserved")}
                for s in eng.runner.worker_stats()]
    from dspark.distributed.engine import memory_stats
    return [{"rank": 0, **memory_stats(eng.runner)}]


def run_world(path, world: int, device, dtype, batches, new_tokens: int, prompts, args) -> dict:
    from dspark.engine import Engine
    max_b = max(batches)
    res = {"world": world}
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    eng = Engine(path, device=str(device), dtype=dtype, weight_format="quantized",
                 speculative="none", tensor_parallel_size=world,
                 kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max_b,
                 max_num_batched_tokens=max_b * args.prompt_len + 16,
                 max_model_len=-(-(args.prompt_len + max(new_tokens, args.warmup_tokens) + 16)
                                 // 256) * 256)
    _sync(device)
    res["load_s"] = time.perf_counter() - t0
    print(f"world {world}: loaded in {res['load_s']:.1f} s", flush=True)
    try:
        res["decode"], res["tokens"] = [], {}
        for b in batches:
            ps = prompts[:b]
            t_w = time.perf_counter()
            _generate(eng, ps, args.warmup_tokens)            # compiles, excluded
            t_w = time.perf_counter() - t_w
            t1 = min(_generate(eng, ps, 1)[1] for _ in range(args.repeats))
            runs = [_generate(eng, ps, new_tokens) for _ in range(args.repeats)]
            toks, tn = runs[0][0], min(t for _, t in runs)
            dec = b * (new_tokens - 1) / max(tn - t1, 1e-9)
            row = {"batch": b, "warmup_s": t_w, "t1_s": t1, "tN_s": tn, "new_tokens": new_tokens,
                   "decode_tok_s": dec, "e2e_tok_s": b * new_tokens / tn,
                   "step_ms": 1e3 * (tn - t1) / (new_tokens - 1)}
            res["decode"].append(row)
            res["tokens"][b] = toks
            print(f"world {world} batch {b}: decode {dec:.1f} tok/s ({row['step_ms']:.1f} ms/step), "
                  f"end-to-end {row['e2e_tok_s']:.1f} tok/s (warm-up {t_w:.1f} s)", flush=True)
        res["memory"] = _rank_memory(eng, world)
    finally:
        eng.close()
        del eng
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return res


def _gb(b):
    return b / 1e9


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(mc.PRESETS), default="flash")
    ap.add_argument("--layers", type=int, default=None, help="backbone layers (flash: 8)")
    ap.add_argument("--model", default=None, help="use this checkpoint instead of generating one")
    ap.add_argument("--workdir", default=None, help="where the generated checkpoint goes "
                    "(default /tmp/dspark_bench/<preset>-<layers>L-fp8-fp4, reused)")
    ap.add_argument("--workers", type=int, default=min(32, os.cpu_count() or 1))
    ap.add_argument("--world", default="1,2", help="world sizes, comma separated")
    ap.add_argument("--batch", default="1,8", help="batch sizes, comma separated")
    ap.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per request")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--warmup-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs each; best is kept")
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=("fp8", "bf16", "fp32"))
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    d_layers, d_new, d_prompt = PRESET_DEFAULTS[args.preset]
    new_tokens = args.new_tokens or d_new
    args.prompt_len = args.prompt_len or d_prompt
    if new_tokens < 2:
        raise SystemExit("--new-tokens must be >= 2 (decode tok/s = (N - 1) steps / (tN - t1))")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batches = [int(b) for b in args.batch.split(",") if b]
    worlds = [int(w) for w in args.world.split(",") if w]
    result = {"args": vars(args), "runs": [], "skipped": []}
    t_all = time.perf_counter()

    def save():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, default=str)

    # -- checkpoint first (its writers are forked: no CUDA context yet) --
    path, cfg, result["checkpoint"] = prepare_checkpoint(
        args.model, args.preset, args.layers or d_layers, args.workdir, args.workers)
    result["config"] = {k: getattr(cfg, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "weight_dtype",
        "expert_format")}
    result["config"]["compress_ratios"] = list(cfg.compress_ratios)

    if device.type == "cuda":
        avail = torch.cuda.device_count()
        result["device"] = {"name": torch.cuda.get_device_name(0), "count": avail,
                            "torch": torch.__version__}
        keep = [w for w in worlds if w <= avail]
        result["skipped"] = [w for w in worlds if w > avail]
        for w in result["skipped"]:
            print(f"world {w}: skipped ({avail} GPU(s) visible)")
        worlds = keep
    else:
        result["device"] = {"name": "cpu", "torch": torch.__version__}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from dspark.distributed.sharding import check_world_size
    est = {}
    for w in worlds:
        check_world_size(cfg, w)
        per = weight_bytes_per_rank(cfg, w, dtype)
        est[w] = per
        print(f"world {w}: estimated weight bytes per rank {_gb(max(per)):.2f} GB (max over ranks; "
              f"total {_gb(sum(per)):.2f} GB)", flush=True)
    result["weight_bytes_per_rank_estimate"] = est
    save()

    prompts = _prompts(max(batches), args.prompt_len, cfg.vocab_size)
    for w in worlds:
        try:
            r = run_world(path, w, device, dtype, batches, new_tokens, prompts, args)
        except Exception as exc:          # keep the other world sizes
            msg = f"{type(exc).__name__}: {str(exc)[:2000]}"
            print(f"world {w} failed: {msg}", flush=True)
            r = {"world": w, "error": msg}
        result["runs"].append(r)
        save()

    # -- agreement with the first world size run --
    ok_runs = [r for r in result["runs"] if "tokens" in r]
    if ok_runs:
        base = ok_runs[0]
        for r in ok_runs[1:]:
            agree = {}
            for b, toks in r["tokens"].items():
                ref = base["tokens"].get(b)
                if ref is None:
                    continue
                lead = [_leading(x, y) for x, y in zip(toks, ref)]
                agree[b] = {"all_equal": toks == ref, "min_leading": min(lead),
                            "mean_leading": sum(lead) / len(lead), "of": new_tokens}
            r["agreement_vs_world"] = {"world": base["world"], "by_batch": agree}

    # -- table --
    print(f"\n{cfg.num_hidden_layers} layers {list(cfg.compress_ratios)}, hidden {cfg.hidden_size}, "
          f"{cfg.n_routed_experts} experts, weights {cfg.weight_dtype}/{cfg.expert_format} kept "
          f"quantized, {device.type} {str(dtype).replace('torch.', '')}, KV {args.kv_cache_dtype}, "
          f"prompt {args.prompt_len}, {new_tokens} greedy tokens, speculation off")
    hdr = (f"{'world':>5} {'load s':>7} {'weights GB/rank':>15} {'peak GB/rank':>12} "
           + " ".join(f"{'B=' + str(b) + ' tok/s':>11} {'ms/step':>8}" for b in batches)
           + f" {'greedy = world ' + str(ok_runs[0]['world']) if ok_runs else '':>18}")
    print(hdr)
    for r in result["runs"]:
        if "error" in r:
            print(f"{r['world']:>5} failed: {r['error'][:200]}")
            continue
        mem = r.get("memory", [])
        wgb = max((m["weights"]["total"] for m in mem), default=0)
        peak = max((m.get("cuda_max_allocated", 0) for m in mem), default=0)
        cells = []
        for b in batches:
            row = next((x for x in r["decode"] if x["batch"] == b), None)
            cells.append(f"{row['decode_tok_s']:>11.1f} {row['step_ms']:>8.1f}" if row
                         else f"{'-':>11} {'-':>8}")
        ag = r.get("agreement_vs_world")
        agtxt = "ref" if ag is None else ", ".join(
            f"B{b}:{'yes' if a['all_equal'] else 'lead ' + str(a['min_leading'])}"
            for b, a in ag["by_batch"].items())
        print(f"{r['world']:>5} {r['load_s']:>7.1f} {_gb(wgb):>15.2f} "
              f"{(_gb(peak) if peak else float('nan')):>12.2f} " + " ".join(cells) + f" {agtxt:>18}")
    result["total_s"] = time.perf_counter() - t_all
    print(f"total {result['total_s']:.1f} s")
    save()
    return result


if __name__ == "__main__":
    main()
