"""Sweep the launch configurations of sparse_mqa_fp8 on one GPU (issue 7); pick the best per shape.

Shapes: V4-Flash decode steps of `batch` requests × 2 query tokens, 64 heads × 512 dims,
keys = 128 sliding-window entries (SWA cache) + 512 top-k compressed entries (C4 cache),
fp8_ds_mla pages of 64 entries (benchmarks/bench_attention.py builds them). FlashMLA anchors:
48.8 / 91.5 / 174 µs at batch 64 / 128 / 256; the goal is ≤ 1.5× those. Batch 16 (no anchor)
decides the small-T row of the default table (split-KV territory). When ``import flash_mla``
works (an SM90 / SM100 build of github.com/deepseek-ai/FlashMLA on PYTHONPATH), FlashMLA's MODEL1
sparse decode is timed on the same case, side by side (same pages read in place through
dspark/attention/flashmla.py's view, same graph replay + L2 flush; its scheduler metadata is
computed once, outside the graph, as the backend does once per forward), and the ratios use
that measurement instead of the anchors (--no-flashmla: anchors only).

Every configuration is compiled first, in parallel worker processes (compile time dominates a
sweep; workers fill Triton's on-disk cache and check each configuration on a small case, so a
configuration that crashes cannot take the timing process down). Then, per shape: each
configuration's output is checked against the torch reference (max abs error / max |ref|
< 2e-2: bf16 MMA operands), captured in a CUDA graph and timed with CUDA events around graph
replays, L2 flushed (256 MB memset) before every replay, interleaved over rounds; median µs.

Prints a table (configuration, registers / spills / shared memory, µs per batch, ratio to
FlashMLA), the best valid configuration per shape, and a DEFAULT_CONFIGS table to paste into
dspark/kernels/sparse_mqa.py; writes everything to --json.

    python benchmarks/sweep_attention.py --json out/sweep_attention.json     # < 3 min on an H200
    python benchmarks/sweep_attention.py --grid quick                        # 7 configurations
    python benchmarks/sweep_attention.py --grid v3 --json out/sweep_v3.json  # the v3 configs
    python benchmarks/sweep_attention.py --grid v3b --batches 64 128 256 --budget-s 90  # v3 knobs
    python benchmarks/sweep_attention.py --grid small --batches 1 2 4 8 --tokens-per-req 1
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

FLASHMLA_US = {64: 48.8, 128: 91.5, 256: 174.0}
FLASHMLA_MEASURED = {}      # batch -> median µs of flash_mla on this GPU (when it imports)
FLASH = "FlashMLA (flash_mla_with_kvcache)"


def flashmla_us(batch):
    """The FlashMLA time to compare with: measured here if possible, else the anchor."""
    return FLASHMLA_MEASURED.get(batch, FLASHMLA_US.get(batch))


def flashmla_call(case):
    """A no-argument callable running FlashMLA's MODEL1 sparse decode on `case` (the
    sparse_mqa_fp8 arguments), or None with the reason printed."""
    import torch
    from dspark.attention import flashmla_unavailable_reason
    why = flashmla_unavailable_reason(DEVICE)
    if why is not None:
        print(f"  (FlashMLA column skipped: {why})")
        return None
    from dspark.attention import flashmla as F
    fm = F.import_flash_mla()
    N = case["entries_per_page"]
    q = case["q"].to(torch.bfloat16).unsqueeze(1)
    kv, ekv = F.record_view(case["cache"], N), F.record_view(case["extra_cache"], N)
    idx, eidx = F.pad_index_list(case["indices"]), F.pad_index_list(case["extra_indices"])
    sink = case["sink"].float().contiguous()
    sched = fm.get_mla_metadata()[0]

    def run():
        return fm.flash_mla_with_kvcache(
            q=q, k_cache=kv, block_table=None, cache_seqlens=None, head_dim_v=512,
            tile_scheduler_metadata=sched, softmax_scale=case["scale"], is_fp8_kvcache=True,
            indices=idx, attn_sink=sink, extra_k_cache=ekv, extra_indices_in_kvcache=eidx)[0]
    return run
TOL = 2e-2
DEVICE = "cuda"


def _c(impl="v3", block_h=64, block_k=64, split_d=1, kv_splits=1, num_warps=8, num_stages=1,
       maxnreg=None, **v3_knobs):
    cfg = dict(impl=impl, block_h=block_h, block_k=block_k, split_d=split_d, kv_splits=kv_splits,
               num_warps=num_warps, num_stages=num_stages)
    if maxnreg is not None:
        cfg["maxnreg"] = maxnreg
    cfg.update(v3_knobs)         # early_decode (v3)
    return cfg


# v3 (dspark/kernels/sparse_mqa_v3.py: chunked decode into shared memory, one loop over both
# lists). Offline sm_90 / triton 3.6 spills per thread: k64 s1 240 B, k64 s2 192 B, k32 s1 36 B,
# k32 s2 16 B, k16 s2 0 B. BLOCK_H 64 everywhere (one wgmma M-tile).
GRID_V3 = [
    _c("v3", block_k=64, num_stages=1), _c("v3", block_k=64, num_stages=2),
    _c("v3", block_k=32, num_stages=1), _c("v3", block_k=32, num_stages=2),
    _c("v3", block_k=32, num_stages=3), _c("v3", block_k=16, num_stages=2),
    _c("v3", block_k=16, num_stages=3),
    _c("v3", block_k=32, num_stages=2, kv_splits=2), _c("v3", block_k=32, num_stages=2, kv_splits=4),
    _c("v3", block_k=16, num_stages=2, kv_splits=4),
]
# full: the v1 fallback kernel next to the v3 family; quick: a few of them
GRID_FULL = [_c("v1", block_k=64, num_warps=8, num_stages=1)] + GRID_V3
GRID_QUICK = [GRID_FULL[i] for i in (0, 1, 2, 4, 9)]

# v3b: early_decode (the tile's 4 chunks decoded before the first score wgmma; offline spills
# 164 -> 48 B/thread) against the shipped v3 row, at 2 and 3 stages. The other v3b candidates
# (bit-level fp8 decode, lazy rescaling, 64-column chunks) ran slower on the H200 and were removed
# (benchmarks/results/sweep_attention_v3b_h200.json; code in commit a218409).
_E = dict(early_decode=True)
GRID_V3B = [
    _c("v3", block_k=64, num_stages=2), _c("v3", block_k=64, num_stages=2, **_E),
    _c("v3", block_k=64, num_stages=3, **_E), _c("v3", block_k=32, num_stages=2, **_E),
    _c("v3", block_k=32, num_stages=2, kv_splits=4, **_E),
]

# v3c: fp16 MMA operands (e4m3 -> f16 in one conversion per value pair, the scale an f16 multiply;
# fp16 q and P) against the shipped bf16 rows.
_H = dict(precision="fp16")
GRID_V3C = [
    _c("v3", block_k=64, num_stages=2, **_E), _c("v3", block_k=64, num_stages=2, **_E, **_H),
    _c("v3", block_k=64, num_stages=3, **_E, **_H), _c("v3", block_k=64, num_stages=2, **_H),
    _c("v3", block_k=32, num_stages=2, kv_splits=4), _c("v3", block_k=32, num_stages=2,
                                                         kv_splits=4, **_H),
]

# small: the batch-1 decode step (1-8 query tokens: a few programs per token) against the shipped
# small-T row (k32 kv4). On the H200 (sweep_attention_small_h200.txt): kv8 = kv4 within
# 1 us, 16 / 32 splits 4-8x slower (a cliff, likely the combine kernel's [splits, 16 heads, 512]
# tile), k16 slower. Still untimed: no split (no combine launch), 2 splits, and 16-head blocks
# (4 head blocks x splits: 4x the programs at 1 token, each key tile decoded per head block;
# offline sm_90 at 4 warps: k64 no spills, k32 8 B/thread).
GRID_SMALL = [
    _c("v3", block_k=32, num_stages=2, kv_splits=4, **_H),
    _c("v3", block_k=32, num_stages=2, kv_splits=8, **_H),
    _c("v3", block_k=64, num_stages=2, kv_splits=1, **_E, **_H),
    _c("v3", block_k=32, num_stages=2, kv_splits=1, **_H),
    _c("v3", block_k=32, num_stages=2, kv_splits=2, **_H),
    _c("v3", block_h=16, block_k=64, num_warps=4, num_stages=2, kv_splits=4, **_H),
    _c("v3", block_h=16, block_k=32, num_warps=4, num_stages=2, kv_splits=4, **_H),
    _c("v3", block_h=16, block_k=64, num_warps=4, num_stages=2, kv_splits=2, **_H),
]


def cfg_name(cfg: dict) -> str:
    s = (f"{cfg['impl']} h{cfg['block_h']} k{cfg['block_k']} d{cfg['split_d']} "
         f"kv{cfg['kv_splits']} w{cfg['num_warps']} s{cfg['num_stages']}")
    return (s + (f" r{cfg['maxnreg']}" if cfg.get("maxnreg") else "")
            + (" early" if cfg.get("early_decode") else "")
            + (f" {cfg['precision']}" if cfg.get("precision") else ""))


def _case(batch, args_dict):
    from bench_attention import build_case
    a = args_dict
    device = DEVICE
    return build_case(batch, a["tokens_per_req"], a["heads"], a["window"], a["topk"], a["page"],
                      a["ctx_entries"], device)


def _rel_err(out, ref):
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _kernel_stats():
    from dspark.kernels import sparse_mqa as smqa
    k = smqa.LAST_LAUNCH.get("kernel")
    try:
        return dict(regs=int(k.n_regs), spills=int(k.n_spills), smem=int(k.metadata.shared))
    except Exception:  # pragma: no cover - diagnostics only
        return {}


# --- compile workers ---------------------------------------------------------------------------

_W = {}


def _precompile(cfg: dict, args_dict: dict) -> dict:
    """Worker: compile `cfg` (fills the on-disk Triton cache) and check it on a small case."""
    import torch
    from dspark.kernels.sparse_mqa import sparse_mqa_fp8
    from dspark.kernels.sparse_mqa_torch import sparse_mqa_fp8_torch
    if "case" not in _W:
        _W["case"] = _case(8, args_dict)
        _W["ref"] = sparse_mqa_fp8_torch(**_W["case"])
    t0 = time.perf_counter()
    try:
        out = sparse_mqa_fp8(**_W["case"], **cfg)
        torch.cuda.synchronize()
    except Exception as exc:
        return dict(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}",
                    compile_s=time.perf_counter() - t0)
    err = _rel_err(out, _W["ref"])
    return dict(ok=err < TOL, rel_err_small=err, compile_s=time.perf_counter() - t0,
                **_kernel_stats(), **({} if err < TOL else {"error": f"rel err {err:.2e}"}))


def precompile_all(configs, args_dict, workers, timeout_s):
    """Compile every configuration in parallel processes; returns one stats dict per config
    (None where the worker pool could not give an answer: the main process compiles those)."""
    stats = [None] * len(configs)
    if workers <= 0:
        return stats
    ctx = mp.get_context("spawn")
    t0 = time.perf_counter()
    pool = None
    try:
        pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
        futs = {pool.submit(_precompile, c, args_dict): i for i, c in enumerate(configs)}
        for f in cf.as_completed(futs, timeout=timeout_s):
            i = futs[f]
            try:
                stats[i] = f.result()
            except cf.process.BrokenProcessPool:
                continue  # some worker died: unknown which config did it; retried inline
            except Exception as exc:
                stats[i] = dict(ok=False, error=f"worker failed: {type(exc).__name__}")
            st = stats[i]
            print(f"  compiled {cfg_name(configs[i]):<34} "
                  f"{'ok ' if st.get('ok') else 'BAD'} {st.get('compile_s', 0):5.1f} s  "
                  f"{st.get('error', '')}", flush=True)
    except cf.TimeoutError:
        print(f"  (precompile: timed out after {timeout_s:.0f} s; the rest compiles inline)")
    except Exception as exc:  # pragma: no cover - e.g. spawn unavailable
        print(f"  (precompile pool failed: {type(exc).__name__}: {exc}; compiling inline)")
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
    print(f"precompile: {time.perf_counter() - t0:.1f} s with {workers} workers", flush=True)
    return stats


# --- timing ------------------------------------------------------------------------------------

def capture(fn):
    """CUDA graph of one call (falls back to the eager call)."""
    import torch
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay
    except Exception as exc:  # pragma: no cover
        print(f"  (graph capture failed: {type(exc).__name__}; timing eager calls)")
        return fn


def time_interleaved(runs: dict, iters: int, rounds: int, flush):
    """runs: name -> callable. Returns name -> list of µs (iters per round, rounds interleaved)."""
    import torch
    times = {k: [] for k in runs}
    per_round = max(1, iters // rounds)
    for _ in range(rounds):
        for name, run in runs.items():
            run()  # one untimed replay per round
            for _ in range(per_round):
                if flush is not None:
                    flush.zero_()
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record()
                run()
                b.record()
                b.synchronize()
                times[name].append(a.elapsed_time(b) * 1e3)
    return times


def default_table(best_by_T: list[tuple[int, dict]]) -> list:
    """[(max_tokens or None, cfg)] from the best config per measured T (ascending): each row
    covers T up to its shape; the last row is open-ended; equal neighbours merged."""
    rows = []
    for i, (T, cfg) in enumerate(best_by_T):
        bound = None if i == len(best_by_T) - 1 else T
        if rows and rows[-1][1] == cfg:
            rows[-1] = (bound, cfg)
        else:
            rows.append((bound, cfg))
    return rows


def report(args, configs, names, stats, results, skipped_batches, t_start, final):
    """Print the table / best configs / DEFAULT_CONFIGS (final) and write --json (always)."""
    import torch
    batches = [b for b in args.batches if any(b in results[n] for n in names)]
    T_of = {b: b * args.tokens_per_req for b in batches}
    best_rows = []
    for b in batches:
        cands = [(results[n][b]["median_us"], n) for n in names
                 if "median_us" in results[n].get(b, {})]
        if cands:
            us, n = min(cands)
            best_rows.append((T_of[b], configs[names.index(n)], us, n, b))
    table = default_table([(T, c) for T, c, *_ in best_rows])
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=__import__("triton").__version__, args=vars(args),
                           flashmla_us=FLASHMLA_US, complete=final,
                           flashmla_measured_us={str(b): us for b, us in
                                                 FLASHMLA_MEASURED.items()},
                           configs=[dict(name=n, config=c, stats=stats[n],
                                         results={str(b): r for b, r in results[n].items()})
                                    for n, c in zip(names, configs)],
                           best={str(T): dict(config=c, median_us=us, name=n)
                                 for T, c, us, n, _ in best_rows},
                           default_configs=[[bnd, c] for bnd, c in table],
                           skipped_batches=skipped_batches,
                           total_s=time.perf_counter() - t_start), f, indent=2)
    if not final:
        return
    print(f"\nsparse_mqa_fp8 sweep on {torch.cuda.get_device_name()}  (H={args.heads}, "
          f"{args.tokens_per_req} q/request, {args.window}+{args.topk} keys, page {args.page}); "
          f"median µs (x FlashMLA, {'measured here' if FLASHMLA_MEASURED else 'anchors'})")
    hdr = f"{'config':<34} {'regs':>4} {'spill':>5} {'smem KB':>7}"
    for b in batches:
        hdr += f" {'b' + str(b) + ' µs':>16}"
    print(hdr)
    for name in names:
        st = stats[name]
        row = (f"{name:<34} {st.get('regs', '-'):>4} {st.get('spills', '-'):>5} "
               f"{(st['smem'] / 1024 if st.get('smem') else 0):>7.0f}")
        for b in batches:
            r = results[name].get(b, {})
            if "median_us" in r:
                fm = flashmla_us(b)
                cell = f"{r['median_us']:.1f}" + (f" ({r['median_us'] / fm:.2f}x)" if fm else "")
            elif "rel_err" in r:
                cell = f"WRONG {r['rel_err']:.0e}"
            else:
                cell = "fail" if st.get("error") else "-"
            row += f" {cell:>16}"
        print(row + (f"  {st['error']}" if st.get("error") and not st.get("ok", True) else ""))
    if FLASHMLA_MEASURED:
        row = f"{FLASH:<34} {'':>4} {'':>5} {'':>7}"
        for b in batches:
            us = FLASHMLA_MEASURED.get(b)
            row += f" {(f'{us:.1f} (1.00x)' if us else '-'):>16}"
        print(row)
    print("\nbest per shape:")
    for T, cfg, us, n, b in best_rows:
        fm = flashmla_us(b)
        print(f"  batch {b:>4} (T={T:>4}): {us:7.1f} µs  {n}"
              + (f"  = {us / fm:.2f}x FlashMLA {fm} µs (target <= {1.5 * fm:.0f})" if fm else ""))
    print("\npaste into dspark/kernels/sparse_mqa.py:\n"
          "DEFAULT_CONFIGS: list[tuple[int | None, dict]] = [")
    for bound, cfg in table:
        print(f"    ({bound}, {cfg!r}),")
    print("]")
    if skipped_batches:
        print(f"(budget: batches {skipped_batches} not measured)")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    if args.json:
        print(f"wrote {args.json}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--tokens-per-req", type=int, default=2)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--ctx-entries", type=int, default=2048)
    ap.add_argument("--grid", choices=["full", "quick", "v3", "v3b", "v3c", "small"],
                    default="full",
                    help="full / quick: the v1 kernel and the v3 configs; v3: the v3 configs; v3b: v3 k64 s2 vs its candidate knobs (GRID_V3B); v3c: fp16 "
                         "operands (GRID_V3C)")
    ap.add_argument("--iters", type=int, default=30, help="timed replays per config and shape")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the configs")
    ap.add_argument("--workers", type=int, default=min(12, os.cpu_count() or 1),
                    help="parallel compile processes (0: compile in the timing process)")
    ap.add_argument("--budget-s", type=float, default=165.0,
                    help="stop starting new shapes after this many seconds")
    ap.add_argument("--no-flush", action="store_true")
    ap.add_argument("--no-flashmla", action="store_true",
                    help="do not time flash_mla even when it imports (ratios use the anchors)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        sys.exit("sweep_attention.py needs a CUDA GPU; run tests/test_kernels.py -k mqa on CPU.")
    t_start = time.perf_counter()
    configs = {"full": GRID_FULL, "quick": GRID_QUICK, "v3": GRID_V3,
               "v3b": GRID_V3B, "v3c": GRID_V3C, "small": GRID_SMALL}[args.grid]
    args_dict = vars(args)
    print(f"{len(configs)} configurations x batches {args.batches}", flush=True)
    pre = precompile_all(configs, args_dict, min(args.workers, len(configs)),
                         timeout_s=max(30.0, args.budget_s * 0.6))

    from dspark.kernels import sparse_mqa as smqa
    from dspark.kernels.sparse_mqa_torch import sparse_mqa_fp8_torch
    dev = DEVICE
    flush = None if args.no_flush else torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    # bring the GPU to its boost clock
    x = torch.randn(4096 if dev == "cuda" else 64, 4096 if dev == "cuda" else 64, device=dev)
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:
        x @ x
    torch.cuda.synchronize()
    del x

    names = [cfg_name(c) for c in configs]
    stats = {n: dict(pre[i] or {}) for i, n in enumerate(names)}
    results = {n: {} for n in names}       # name -> batch -> dict(median_us, min_us, rel_err)
    skipped_batches = []
    for batch in args.batches:
        if time.perf_counter() - t_start > args.budget_s:
            skipped_batches.append(batch)
            continue
        case = _case(batch, args_dict)
        ref = sparse_mqa_fp8_torch(**case)
        runs = {}
        for cfg, name in zip(configs, names):
            if stats[name].get("ok") is False:
                continue  # failed or wrong on the small case (worker) or an earlier shape
            try:
                out = smqa.sparse_mqa_fp8(**case, **cfg)
                torch.cuda.synchronize()
            except Exception as exc:
                stats[name].update(ok=False, error=f"{type(exc).__name__}: "
                                   f"{str(exc).splitlines()[0][:120]}")
                continue
            if not stats[name].get("regs"):
                stats[name].update(_kernel_stats())
            err = _rel_err(out, ref)
            results[name][batch] = dict(rel_err=err)
            if not err < TOL:
                print(f"  batch {batch} {name}: WRONG (rel err {err:.2e}), not timed")
                continue
            runs[name] = capture(lambda c=case, g=cfg: smqa.sparse_mqa_fp8(**c, **g))
        fm_run = None if args.no_flashmla else flashmla_call(case)
        if fm_run is not None:
            err = _rel_err(fm_run()[:, 0].float(), ref)
            torch.cuda.synchronize()
            if err < TOL:
                runs[FLASH] = capture(fm_run)
            else:
                print(f"  batch {batch} FlashMLA: WRONG (rel err {err:.2e}), not timed")
        times = time_interleaved(runs, args.iters, args.rounds, flush)
        fm_ts = times.pop(FLASH, None)
        if fm_ts:
            FLASHMLA_MEASURED[batch] = statistics.median(fm_ts)
        for name, ts in times.items():
            results[name][batch].update(median_us=statistics.median(ts), min_us=min(ts))
        best = min(times, key=lambda n: results[n][batch]["median_us"]) if times else None
        line = f"batch {batch:>4}: best {best} {results[best][batch]['median_us']:.1f} µs" \
            if best else f"batch {batch}: nothing ran"
        if best and batch in FLASHMLA_MEASURED:
            fm_us = FLASHMLA_MEASURED[batch]
            line += (f" vs FlashMLA {fm_us:.1f} µs = "
                     f"{results[best][batch]['median_us'] / fm_us:.2f}x")
        print(line + f"   [{time.perf_counter() - t_start:.0f} s]", flush=True)
        del case, ref, runs
        torch.cuda.empty_cache()
        report(args, configs, names, stats, results, skipped_batches, t_start, final=False)

    report(args, configs, names, stats, results, skipped_batches, t_start, final=True)


if __name__ == "__main__":
    main()
