"""Tensor parallelism: decode-step and DSpark-round time and tok/s vs world size, with the
communication per step (issue 32).

Checkpoint: `--model DIR`, or a random one in the official layout with DSpark stages (the
tensors of `python -m dspark.tools.make_checkpoint --preset flash --layers N --dtype fp8
--fp4-experts --dspark`, written shard-parallel by benchmarks/bench_decode_v4.py's writer into
--workdir and reused when its config.json matches). Weights stay quantized on every rank
(weight_format="quantized": FP8 codes + scale tiles, packed FP4 experts).

Rows (one runner each, loaded, measured, closed):
  single     the single-device engine's runner (Engine(..., tensor_parallel_size=1)): on CUDA its
             decode / verify steps replay as CUDA graphs, and so does its draft pass
             (--deterministic: the engine in deterministic mode, batch-invariant kernels)
  tp W       DistributedRunner at world W (W in --world, 1 included: the TP runner on one device)
             over a paged cache, every rank on the fixed-shape step (CUDA graphs with the NCCL
             collectives inside, NVLS off; eager with gloo on CPU); drafter replicated on rank 0
             (--drafter sharded: split like the target)
Per batch size B in --batch (default 1,16), B requests with --prompt-len random prompts:
  decode     --steps greedy decode steps (each request one token; the next token is the step's
             argmax, read back like the engine does) after --warmup steps; step_ms = median wall
             time per step (device synchronised), tok/s = B / step
  round      --steps DSpark rounds: a verify step of γ + 1 tokens per request (drafts handed over
             on the device) whose rows are all committed, the draft context written and the next
             block drafted from the verify's last argmax; round_ms = median per round, split
             into verify and draft; tok/s = B (γ + 1) / round (every draft accepted: the bound a
             round's time allows; acceptance is the drafter's, not the parallelism's)
  comm       tensor-parallel rows: the collectives one step issues (comm_profile.step_collectives:
             input broadcast, indexer all-gathers, two fp32 all-reduces per layer), timed on the
             group by themselves (inside a CUDA graph they cannot be timed one by one):
             comm_ms per decode step / per verify step, and their count
  agreement  greedy decode tokens of every request against the first row (leading run of
             equal tokens; random weights give near-tied logits, so a late flip is numerics)
  kernels    --kernel-profile (CUDA): the decode steps and the rounds measured once more under
             torch.profiler, device µs per step of each kernel (summed durations: side-stream
             kernels overlap) and the kernels per step, so two trees' steps compare kernel by
             kernel

    python benchmarks/bench_tp.py --json benchmarks/results/bench_tp_h200x2.json   # 2 H200s
    python benchmarks/bench_tp.py --preset tiny --device cpu                         # CPU (gloo)
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))  # repo root
sys.path.insert(0, _HERE)

from bench_decode_v4 import (_leading_agreement as _leading, copy_bandwidth,  # noqa: E402
                             prepare_checkpoint)

from dspark.models.deepseek_v4.weights import stored_tensors, tensor_inventory  # noqa: E402
from dspark.tools import make_checkpoint as mc  # noqa: E402

PRESET_DEFAULTS = {   # layers, steps, prompt length
    "flash": (4, 24, 64),
    "pro": (4, 24, 64),
    "tiny": (6, 6, 12),
}


def weight_bytes_per_rank(cfg, world: int, dtype: torch.dtype, drafter: str | None = None) -> list:
    """Weight bytes each rank holds with weight_format="quantized": FP8 / FP4 tensors as stored
    (codes + e8m0 scales, pro rata to the rank's part), bf16 kinds in `dtype`, fp32 / int64 as
    such; the rank's share under ShardPlan (routed experts e % world == rank). drafter:
    "sharded" (its stages split the same way), "replicated" (rank 0 holds them whole) or None."""
    from dspark.distributed.sharding import SKIP, ShardPlan
    elt = torch.empty((), dtype=dtype).element_size()
    size = {"fp32": 4, "int64": 8, "bf16": elt}
    inv = tensor_inventory(cfg)
    out = []
    for rank in range(world):
        plan = ShardPlan(cfg, rank, world)
        whole = ShardPlan(cfg, 0, 1)
        total = 0
        for name, spec in inv.items():
            p = plan
            if name.startswith("mtp."):
                if drafter is None or (drafter == "replicated" and rank > 0):
                    continue
                p = whole if drafter == "replicated" else plan
            if p.slices(name) is SKIP:
                continue
            shape = p.local_shape(name, spec.shape)
            frac = math.prod(shape) / max(math.prod(spec.shape), 1)
            if spec.kind in ("fp8", "fp4"):
                total += frac * sum(st.nbytes for st in stored_tensors(name, spec))
            else:
                total += math.prod(shape) * size.get(spec.kind, elt)
        out.append(int(total))
    return out


def _sync(device):
    """Rank 0's device only: a step ends after every rank's collectives, so rank 0 finishing
    bounds them all."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---- runners ------------------------------------------------------------------------------------

def _cache_args(cfg, args, batch: int) -> dict:
    gamma = cfg.dspark_block_size
    total = args.prompt_len + (args.warmup + args.steps) * (gamma + 1) + gamma + 2
    return dict(total=total, blocks=batch * -(-total // 256) + 1,
                batch_tokens=max(batch * (gamma + 1), args.prompt_len) + batch * (gamma + 2))


def single_runner(path, device, dtype, args, batch):
    from dspark.engine import Engine
    ca = _cache_args(args.cfg, args, batch)
    eng = Engine(path, device=str(device), dtype=dtype, weight_format="quantized",
                 kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=batch,
                 max_num_batched_tokens=ca["batch_tokens"], num_kv_blocks=ca["blocks"],
                 deterministic=args.deterministic)
    return eng.runner, eng.cache, eng.close


def tp_runner(path, cfg, world, device, dtype, args, batch):
    from dspark.attention import get_backend, resolve_backend
    from dspark.distributed.comm import rank_device
    from dspark.distributed.engine import DistributedRunner
    from dspark.kvcache.paged import PagedKVCache
    from dspark.runner import QuantSim
    ca = _cache_args(cfg, args, batch)
    runner = DistributedRunner.launch(path, cfg, world, str(device), dtype, drafter=True,
                                      weight_format="quantized", drafter_mode=args.drafter,
                                      max_num_seqs=batch)
    dev = rank_device(device, 0)
    # one slot and one page more than the requests need: the fixed-shape steps' scratch
    cache = PagedKVCache(cfg, device=dev, kv_cache_dtype=args.kv_cache_dtype,
                         num_blocks=ca["blocks"] + 1, max_num_seqs=batch + 1,
                         lookahead=cfg.dspark_block_size + 1, max_batch_tokens=ca["batch_tokens"])
    backend = get_backend(resolve_backend("auto", dev, args.kv_cache_dtype))(cache)
    quant = QuantSim() if args.kv_cache_dtype == "fp8" else None
    runner.configure(quant, backend, target_graphs=True)
    return runner, cache, runner.shutdown


# ---- measurements -------------------------------------------------------------------------------

class Requests:
    """B requests over `runner` / `cache`: prefilled, their draft context committed."""

    def __init__(self, runner, cache, prompts, tag, total_len):
        self.runner, self.cache = runner, cache
        self.rids = [(tag, i) for i in range(len(prompts))]
        self.states = [runner.new_states()[1] for _ in prompts]
        self.pos = [len(p) for p in prompts]
        last = []
        for rid, ds, p in zip(self.rids, self.states, prompts):
            cache.add_request(rid)
            cache.reserve(rid, total_len)
            logits, taps = runner.target_forward([(rid, 0, p)])
            runner.commit_context(ds, taps, 0)
            last.append(logits[-1])
        self.next = torch.stack(last).argmax(-1).tolist()

    def close(self):
        for rid in self.rids:
            self.cache.free(rid)


def _median_ms(ts):
    return 1e3 * statistics.median(ts)


def measure_decode(runner, cache, prompts, args, device):
    reqs = Requests(runner, cache, prompts, "decode", _cache_args(args.cfg, args, len(prompts))["total"])
    tokens, times, key = [[] for _ in prompts], [], None
    for step in range(args.warmup + args.steps):
        items = [(rid, p, [t]) for rid, p, t in zip(reqs.rids, reqs.pos, reqs.next)]
        if key is None and getattr(runner, "target_graphs", None) is not None:
            key = runner.target_graphs.fits(items)
        _sync(device)
        t0 = time.perf_counter()
        logits, _ = runner.target_forward(items)
        reqs.next = logits.argmax(-1).tolist()           # (the engine reads its choices back)
        _sync(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        for i, t in enumerate(reqs.next):
            tokens[i].append(t)
        reqs.pos = [p + 1 for p in reqs.pos]
    reqs.close()
    ms = _median_ms(times)
    return {"step_ms": ms, "tok_s": len(prompts) / ms * 1e3}, tokens, key


def measure_rounds(runner, cache, prompts, args, device):
    from dspark.request import BlockTokens
    from dspark.sampling import SamplingParams
    B, q = len(prompts), args.cfg.dspark_block_size + 1
    reqs = Requests(runner, cache, prompts, "round", _cache_args(args.cfg, args, B)["total"])
    greedy = SamplingParams(temperature=0)

    def draft(anchors):
        return runner.draft([SimpleNamespace(anchor=a, num_committed=p, draft_state=ds,
                                             params=greedy, seed=i)
                             for i, (a, p, ds) in enumerate(zip(anchors, reqs.pos, reqs.states))])
    blocks = draft(reqs.next)
    anchors = reqs.next
    verify, drafting, rounds, key = [], [], [], None
    for r in range(args.warmup + args.steps):
        items = [(rid, p, BlockTokens(a, b.tokens)) for rid, p, a, b in
                 zip(reqs.rids, reqs.pos, anchors, blocks)]
        if key is None and getattr(runner, "target_graphs", None) is not None:
            key = runner.target_graphs.fits(items)
        _sync(device)
        t0 = time.perf_counter()
        logits, taps = runner.target_forward(items)
        anchors = logits.view(B, q, -1)[:, -1].argmax(-1).tolist()   # the round's read back
        for i, ds in enumerate(reqs.states):                # every row committed
            runner.commit_context(ds, taps[i * q:(i + 1) * q], reqs.pos[i])
        reqs.pos = [p + q for p in reqs.pos]
        _sync(device)
        t1 = time.perf_counter()
        blocks = draft(anchors)
        _sync(device)
        t2 = time.perf_counter()
        if r >= args.warmup:
            verify.append(t1 - t0)
            drafting.append(t2 - t1)
            rounds.append(t2 - t0)
    reqs.close()
    ms = _median_ms(rounds)
    return {"round_ms": ms, "verify_ms": _median_ms(verify), "draft_ms": _median_ms(drafting),
            "tok_s_all_accepted": B * q / ms * 1e3}, key


def comm_per_step(runner, cfg, world, key) -> dict | None:
    """The collectives of one fixed-shape step of bucket `key` and their time on the group."""
    if world == 1 or key is None:
        return None
    from dspark.distributed.comm_profile import step_collectives
    B, q, P = key
    shapes = step_collectives(cfg, world, B * q, runner.target_graphs._layout(B, q, P).end)
    return {"collectives": len(shapes), "comm_ms": 1e3 * runner.collective_time(shapes)}


def run_row(path, cfg, kind, world, device, dtype, args, prompts, res: dict, save) -> dict:
    """Fill `res` batch by batch, calling `save()` after each (a run cut short keeps them). One
    runner serves every batch size (loaded once, sized for the largest: a V4-Flash-width load
    takes about a minute)."""
    top = max(args.batches)
    t0 = time.perf_counter()
    if kind == "single":
        runner, cache, close = single_runner(path, device, dtype, args, top)
    else:
        runner, cache, close = tp_runner(path, cfg, world, device, dtype, args, top)
    res["load_s"] = time.perf_counter() - t0
    try:
        if hasattr(runner, "capture_graphs") and torch.device(device).type == "cuda":
            runner.capture_graphs(range(1, cfg.dspark_block_size + 2),
                                  args.prompt_len + _cache_args(cfg, args, top)["total"])
        for b in args.batches:
            dec, toks, dkey = measure_decode(runner, cache, prompts[:b], args, device)
            rnd, rkey = measure_rounds(runner, cache, prompts[:b], args, device)
            row = {"decode": dec, "round": rnd, "tokens": toks,
                   "decode_comm": comm_per_step(runner, cfg, world, dkey) if kind == "tp" else None,
                   "verify_comm": comm_per_step(runner, cfg, world, rkey) if kind == "tp" else None}
            if kind == "tp":
                row["memory"] = [{k: v for k, v in s.items() if k in (
                    "rank", "weights", "cuda_allocated", "cuda_max_allocated", "fixed_steps")}
                    for s in runner.worker_stats()]
            roof = roofline(cfg, dtype, b, args, dec, rnd) if world == 1 else None
            row["roofline"] = roof
            if args.kernel_profile and torch.device(device).type == "cuda":
                n = args.warmup + args.steps
                row["kernels"] = {
                    "decode": kernel_times(lambda: measure_decode(runner, cache, prompts[:b],
                                                                  args, device), n),
                    "round": kernel_times(lambda: measure_rounds(runner, cache, prompts[:b],
                                                                 args, device), n)}
            res["batches"][b] = row
            save()
            print(f"{kind} {world} B={b}: decode {dec['step_ms']:.2f} ms ({dec['tok_s']:.0f} tok/s)"
                  f", round {rnd['round_ms']:.2f} ms (verify {rnd['verify_ms']:.2f}, draft "
                  f"{rnd['draft_ms']:.2f})" + (
                      f"; bytes roofline: decode {roof['decode_ms']:.3f} ms "
                      f"({roof['decode_pct']:.0f}%), round {roof['round_ms']:.3f} ms "
                      f"({roof['round_pct']:.0f}%)" if roof and "decode_pct" in roof else ""),
                  flush=True)
            for what, kt in row.get("kernels", {}).items():
                print_kernel_times(f"B={b} {what}", kt)
    finally:
        close()
        del runner, cache
        gc.collect()
        if torch.device(device).type == "cuda":
            torch.cuda.empty_cache()
    return res


def kernel_times(fn, steps: int, top: int = 20) -> dict:
    """fn() (a measurement of `steps` steps or rounds) under torch.profiler: device ms and
    kernels per step, and the `top` kernels by device µs per step."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    rows = sorted(((a.key, a.self_device_time_total / steps, a.count / steps)
                   for a in prof.key_averages() if a.self_device_time_total > 0),
                  key=lambda r: -r[1])
    return {"device_ms_per_step": sum(r[1] for r in rows) / 1e3,
            "kernels_per_step": sum(r[2] for r in rows),
            "top": [{"kernel": k, "us_per_step": us, "calls_per_step": n} for k, us, n in rows[:top]]}


def print_kernel_times(label: str, kt: dict) -> None:
    print(f"  {label}: {kt['device_ms_per_step']:.3f} ms of kernels, "
          f"{kt['kernels_per_step']:.1f} kernels per step")
    for r in kt["top"]:
        print(f"    {r['us_per_step']:8.1f} us x{r['calls_per_step']:5.1f}  {r['kernel'][:100]}")


def roofline(cfg, dtype, batch: int, args, dec: dict, rnd: dict) -> dict:
    """Bytes of the decode step and of the round (dspark/bench/roofline.py: the verify of
    B (γ + 1) tokens and the draft pass, routed experts at their expectation under uniform
    routing) over the copy bandwidth measured in this run: the roofline ms and the measured
    step's share of it (one device; a TP rank reads its shard)."""
    from dspark.bench.roofline import decode_bytes, round_bytes
    mid = args.warmup + args.steps // 2                  # the median step's position
    gamma = cfg.dspark_block_size
    out = {"decode_bytes": decode_bytes(cfg, dtype, batch, args.prompt_len + mid,
                                        args.kv_cache_dtype),
           "round_bytes": round_bytes(cfg, dtype, batch, args.prompt_len + mid * (gamma + 1),
                                      args.kv_cache_dtype)}
    bw = getattr(args, "copy_bandwidth", None)
    if bw:
        out["copy_tbps"] = bw["tbps"]
        out["decode_ms"] = out["decode_bytes"] / (bw["tbps"] * 1e9)
        out["round_ms"] = out["round_bytes"]["total"] / (bw["tbps"] * 1e9)
        out["decode_pct"] = 100 * out["decode_ms"] / dec["step_ms"]
        out["round_pct"] = 100 * out["round_ms"] / rnd["round_ms"]
    return out


# ---- driver -------------------------------------------------------------------------------------

def _table(result, batches):

    hdr = f"{'runner':>8} " + " ".join(
        f"{'B=' + str(b) + ' dec ms':>11} {'tok/s':>7} {'comm ms':>7} {'round ms':>8} "
        f"{'verify':>7} {'draft':>6}" for b in batches) + f" {'greedy = first row':>20}"
    print(hdr)
    for r in result["runs"]:
        name = "single" if r["kind"] == "single" else f"tp {r['world']}"
        if "error" in r:
            print(f"{name:>8} failed: {r['error'][:200]}")
            continue
        cells = []
        for b in batches:
            x = r["batches"].get(b)
            if x is None:
                cells.append(" " * 54)
                continue
            comm = x.get("decode_comm")
            cells.append(f"{x['decode']['step_ms']:>11.2f} {x['decode']['tok_s']:>7.0f} "
                         f"{(comm['comm_ms'] if comm else 0.0):>7.3f} {x['round']['round_ms']:>8.2f}"
                         f" {x['round']['verify_ms']:>7.2f} {x['round']['draft_ms']:>6.2f}")
        ag = r.get("agreement")
        agtxt = "ref" if ag is None else ", ".join(
            f"B{b}:{'yes' if a['all_equal'] else 'lead ' + str(a['min_leading'])}"
            for b, a in ag.items())
        print(f"{name:>8} " + " ".join(cells) + f" {agtxt:>20}")



def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(mc.PRESETS), default="flash")
    ap.add_argument("--layers", type=int, default=None, help="backbone layers (flash: 4)")
    ap.add_argument("--model", default=None, help="use this checkpoint (with DSpark stages)")
    ap.add_argument("--workdir", default=None, help="where the generated checkpoint goes "
                    "(default /tmp/dspark_bench/<preset>-<layers>L-fp8-fp4-dspark, reused)")
    ap.add_argument("--workers", type=int, default=min(32, os.cpu_count() or 1))
    ap.add_argument("--world", default="1,2", help="tensor-parallel world sizes, comma separated")
    ap.add_argument("--no-single", action="store_true", help="skip the single-device row")
    ap.add_argument("--batch", default="1,16", help="batch sizes, comma separated")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps / rounds")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps / rounds first")
    ap.add_argument("--prompt-len", type=int, default=None)
    ap.add_argument("--drafter", choices=("replicated", "sharded"), default="replicated")
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=("fp8", "bf16", "fp32"))
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--deterministic", action="store_true",
                    help="the single-device engine in deterministic mode (batch-invariant "
                         "kernels; its cost against a run without); single row only")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="CUDA: each batch's decode steps and rounds once more under the "
                         "profiler: device µs per step of each kernel")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    d_layers, d_steps, d_prompt = PRESET_DEFAULTS[args.preset]
    args.steps = args.steps or d_steps
    args.prompt_len = args.prompt_len or d_prompt
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.batches = [int(b) for b in args.batch.split(",") if b]
    worlds = [int(w) for w in args.world.split(",") if w]
    if args.deterministic and (worlds or args.no_single):
        raise SystemExit("--deterministic measures the single-device row only: add --world \"\" "
                         "and leave out --no-single")
    result = {"args": {k: v for k, v in vars(args).items() if k != "cfg"}, "runs": [],
              "skipped": []}
    t_all = time.perf_counter()

    def save():
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2, default=str)

    # -- checkpoint first (its writers are forked: no CUDA context yet) --
    path, cfg, result["checkpoint"] = prepare_checkpoint(
        args.model, args.preset, args.layers or d_layers, args.workdir, args.workers, dspark=True)
    if not cfg.has_dspark:
        raise SystemExit(f"{path}: no DSpark stages (mtp.*); the rounds need a DSpark checkpoint")
    args.cfg = cfg
    result["config"] = {k: getattr(cfg, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
        "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "weight_dtype",
        "expert_format", "dspark_block_size")}
    if device.type == "cuda":
        avail = torch.cuda.device_count()
        result["device"] = {"name": torch.cuda.get_device_name(0), "count": avail,
                            "torch": torch.__version__}
        result["skipped"] = [w for w in worlds if w > avail]
        for w in result["skipped"]:
            print(f"world {w}: skipped ({avail} GPU(s) visible)")
        worlds = [w for w in worlds if w <= avail]
        args.copy_bandwidth = copy_bandwidth(device)
        torch.cuda.empty_cache()                 # its buffers go back before the runners load
        print(f"copy bandwidth {args.copy_bandwidth['tbps']:.2f} TB/s", flush=True)
    else:
        result["device"] = {"name": "cpu", "torch": torch.__version__}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    from dspark.distributed.sharding import check_world_size
    est = {}
    for w in worlds:
        check_world_size(cfg, w)
        est[w] = weight_bytes_per_rank(cfg, w, dtype, args.drafter)
        print(f"world {w}: estimated weight bytes per rank {max(est[w]) / 1e9:.2f} GB (max over "
              f"ranks)", flush=True)
    result["weight_bytes_per_rank_estimate"] = est
    save()

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
               for _ in range(max(args.batches))]
    rows = ([] if args.no_single else [("single", 1)]) + [("tp", w) for w in worlds]
    for kind, w in rows:
        r = {"kind": kind, "world": w, "batches": {}}
        result["runs"].append(r)
        try:
            run_row(path, cfg, kind, w, device, dtype, args, prompts, r, save)
        except Exception as exc:          # keep the other rows
            msg = f"{type(exc).__name__}: {str(exc)[:2000]}"
            print(f"{kind} {w} failed: {msg}", flush=True)
            r["error"] = msg
        save()

    ok = [r for r in result["runs"] if "error" not in r]
    for r in ok[1:]:
        r["agreement"] = {}
        for b, x in r["batches"].items():
            ref = ok[0]["batches"].get(b)
            if ref is not None:
                lead = [_leading(a, c) for a, c in zip(x["tokens"], ref["tokens"])]
                r["agreement"][b] = {"all_equal": x["tokens"] == ref["tokens"],
                                     "min_leading": min(lead), "of": args.steps + args.warmup}
    print(f"\n{cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.n_routed_experts} "
          f"experts, weights {cfg.weight_dtype}/{cfg.expert_format} kept quantized, {device.type} "
          f"{str(dtype).replace('torch.', '')}, KV {args.kv_cache_dtype}, prompt "
          f"{args.prompt_len}, γ = {cfg.dspark_block_size}, drafter {args.drafter}; medians of "
          f"{args.steps} steps / rounds")
    _table(result, args.batches)
    result["total_s"] = time.perf_counter() - t_all
    print(f"total {result['total_s']:.1f} s")
    save()
    return result


if __name__ == "__main__":
    main()
