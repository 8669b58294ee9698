"""Benchmark sparse_mqa_fp8 at V4-Flash decode shapes against the FlashMLA anchor numbers.

Shape per request: 2 query tokens (decode + 1 speculative), 64 heads × 512 dims, keys =
128 sliding-window entries (SWA cache) + 512 indexer-selected compressed entries (C4 cache), both
fp8_ds_mla pages of 64 entries; sink per head; scale 1/√512.

Timing: CUDA events around a CUDA-graph replay of one call (so host launch overhead is not
counted), L2 flushed before every timed call (the caches of a real step are far larger than L2
anyway), ≥ 0.3 s of warmup, then the median of --iters calls. Each configuration
is checked against the torch reference in the same run before it is timed.

GB/s counts the bytes of the cache records the kernel must read: T · (valid keys) · 584 B
(index lists and q excluded). Tokens of one request share their window keys, so the distinct
HBM traffic can be lower than this logical count.

    python benchmarks/bench_attention.py                    # batches 64/128/256, default config
    python benchmarks/bench_attention.py --impl v3 --kv-splits 4 --num-warps 4 --block-k 32
    python benchmarks/bench_attention.py --sweep --json out/bench_attention.json   # small v1 grid

The full configuration sweep (v1 / v3 kernels, split-D, split-KV, stages; parallel compile; picks
the default-config table) is benchmarks/sweep_attention.py.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # repo root

FLASHMLA_US = {64: 48.8, 128: 91.5, 256: 174.0}  # anchor: FlashMLA sparse decode, same shapes
RECORD_BYTES = 584


def build_case(batch, tokens_per_req, heads, window, topk, page, ctx_entries, device, seed=0):
    """Random caches and index lists laid out like a decode step of ``batch`` requests."""
    from dspark.formats.layouts import fp8_ds_mla_page_bytes, write_fp8_ds_mla

    g = torch.Generator(device="cpu").manual_seed(seed)
    T = batch * tokens_per_req
    swa_pages_per_req = -(-window // page)
    c_pages_per_req = -(-ctx_entries // page)

    def make_cache(num_pages):
        cache = torch.zeros(num_pages, fp8_ds_mla_page_bytes(page), dtype=torch.uint8,
                            device=device)
        n = num_pages * page
        x = torch.randn(n, 512, device=device)
        write_fp8_ds_mla(cache, page, torch.arange(n, device=device), x)
        return cache

    swa = make_cache(batch * swa_pages_per_req)
    comp = make_cache(batch * c_pages_per_req)
    # pages of a request are scattered over the pool, as after a while of serving
    swa_perm = torch.randperm(batch * swa_pages_per_req, generator=g)
    c_perm = torch.randperm(batch * c_pages_per_req, generator=g)
    req = torch.arange(T) // tokens_per_req
    # window: the request's `window` ring slots (all valid in steady-state decode)
    wj = torch.arange(window)
    w_pages = swa_perm.view(batch, swa_pages_per_req)[req[:, None], wj[None, :] // page]
    win = (w_pages * page + wj % page).to(torch.int32)
    # compressed: `topk` distinct entries among the request's ctx_entries
    picks = torch.argsort(torch.rand(T, ctx_entries, generator=g), dim=1)[:, :topk]
    c_pages = c_perm.view(batch, c_pages_per_req)[req[:, None], picks // page]
    comp_idx = (c_pages * page + picks % page).to(torch.int32)
    q = torch.randn(T, heads, 512, generator=g)
    q = (q / q.pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)  # per-head RMS-normed
    sink = torch.randn(heads, generator=g)
    return dict(q=q.to(device), cache=swa, entries_per_page=page, indices=win.to(device),
                sink=sink.to(device), scale=512 ** -0.5, extra_cache=comp,
                extra_indices=comp_idx.to(device))


def time_call(fn, warmup, iters, flush):
    """Median and min µs of one call, measured with CUDA events around a CUDA-graph replay.

    The graph removes the Python wrapper / launch overhead from the measurement (on a slow host
    it is tens of µs and would otherwise show up whenever the GPU runs dry); the L2 flush is
    enqueued before the start event. Falls back to eager calls if capture fails."""
    # warm up for at least `warmup` calls and 0.3 s: an idle GPU needs that long to reach its
    # boost clock, otherwise the first configuration measured looks slower than it is
    t_end = time.perf_counter() + 0.3
    n = 0
    while n < warmup or time.perf_counter() < t_end:
        fn()
        torch.cuda.synchronize()
        n += 1
    run = fn
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # one more call on the capture stream before capturing
            with torch.cuda.graph(graph, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        run = graph.replay
        run()
        torch.cuda.synchronize()
    except Exception as exc:  # pragma: no cover - timing falls back to eager launches
        print(f"  (CUDA graph capture failed, timing eager calls: {type(exc).__name__})")
        run = fn
    times = []
    for _ in range(iters):
        if flush is not None:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)  # µs
    return statistics.median(times), min(times)


def report_compiled(jit_fn):
    """Registers / spills / shared memory of every compiled variant of a Triton kernel (best
    effort: reads triton's runtime caches, whose layout changes between versions)."""
    try:
        for caches in jit_fn.device_caches.values():
            for key, k in caches[0].items():
                if hasattr(k, "_init_handles"):
                    k._init_handles()  # n_regs / n_spills are filled in when the binary loads
                md = k.metadata
                consts = {n: v for n, v in getattr(k.src, "constants", {}).items()
                          if isinstance(n, str) and n.isupper()} if hasattr(k, "src") else {}
                if not consts:  # the key ends with the constexpr values in signature order
                    consts = str(key)[-160:]
                print(f"  regs {k.n_regs:>3}  spills {k.n_spills:>5}  smem {md.shared:>6} B  "
                      f"warps {md.num_warps}  stages {md.num_stages}  {consts}")
    except Exception as exc:  # pragma: no cover - diagnostics only
        print(f"  (could not read compiled-kernel stats: {type(exc).__name__}: {exc})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--tokens-per-req", type=int, default=2)
    ap.add_argument("--heads", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--topk", type=int, default=512)
    ap.add_argument("--page", type=int, default=64, help="entries per page")
    ap.add_argument("--ctx-entries", type=int, default=2048,
                    help="compressed entries per request to pick the top-k from (8K tokens / 4)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-flush", action="store_true", help="do not flush L2 between calls")
    ap.add_argument("--block-h", type=int)
    ap.add_argument("--block-k", type=int)
    ap.add_argument("--split-d", type=int)
    ap.add_argument("--num-warps", type=int)
    ap.add_argument("--num-stages", type=int)
    ap.add_argument("--impl", choices=["v1", "v3"])
    ap.add_argument("--kv-splits", type=int, help="split-KV (flash-decoding) programs per token")
    ap.add_argument("--maxnreg", type=int, help="register cap per thread")
    ap.add_argument("--sweep", action="store_true",
                    help="also try a small grid of block/warp/stage choices, report the best")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    if not torch.cuda.is_available():
        sys.exit("bench_attention.py needs a CUDA GPU (the Triton kernel is timed with CUDA "
                 "events); nothing to measure on CPU. Run tests/test_kernels.py for correctness.")
    assert args.iters >= 20, "use at least 20 timed iterations"

    from dspark.kernels.sparse_mqa import sparse_mqa_fp8
    from dspark.kernels.sparse_mqa_torch import sparse_mqa_fp8_torch

    dev = "cuda"
    flush = None if args.no_flush else torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    base_cfg = dict(block_h=args.block_h, block_k=args.block_k, split_d=args.split_d,
                    num_warps=args.num_warps, num_stages=args.num_stages, impl=args.impl,
                    kv_splits=args.kv_splits, maxnreg=args.maxnreg)
    configs = [base_cfg]
    if args.sweep:
        # H200 sweeps found 16 warps, BLOCK_H 32/16 and split_d 4 always slower: not retried
        grid = list(itertools.product([64], [32, 64], [1, 2], [4, 8], [1, 2]))
        for bh, bk, sd, nw, ns in grid:
            configs.append(dict(block_h=bh, block_k=bk, split_d=sd, num_warps=nw, num_stages=ns))

    rows = []
    for batch in args.batches:
        case = build_case(batch, args.tokens_per_req, args.heads, args.window, args.topk,
                          args.page, args.ctx_entries, dev)
        T = case["q"].shape[0]
        ref = sparse_mqa_fp8_torch(**case)
        n_keys = int((case["indices"] >= 0).sum() + (case["extra_indices"] >= 0).sum())
        bytes_read = n_keys * RECORD_BYTES
        best = None
        for cfg in configs:
            try:
                out = sparse_mqa_fp8(**case, **cfg)
            except Exception as exc:  # e.g. out of shared memory for a big tile
                print(f"  batch {batch} cfg {cfg}: failed ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:100]})")
                continue
            from dspark.kernels.sparse_mqa import LAST_LAUNCH
            resolved = dict(LAST_LAUNCH.get("config", {}))   # what the defaults resolved to
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            if not err < 2e-2:
                print(f"  batch {batch} cfg {cfg}: WRONG (rel err {err:.2e}), not timed")
                continue
            med, mn = time_call(lambda c=case, g=cfg: sparse_mqa_fp8(**c, **g), args.warmup,
                                args.iters, flush)
            rec = dict(batch=batch, tokens=T, heads=args.heads, keys_per_token=n_keys / T,
                       config={k: v for k, v in cfg.items() if v is not None},
                       resolved_config=resolved, median_us=med,
                       min_us=mn, gbps=bytes_read / (med * 1e-6) / 1e9, rel_err=err,
                       flashmla_us=FLASHMLA_US.get(batch),
                       ratio_vs_flashmla=(med / FLASHMLA_US[batch]) if batch in FLASHMLA_US
                       else None)
            if args.sweep:
                print(f"  batch {batch} {rec['config'] or 'default'}: {med:8.1f} µs")
            if best is None or med < best["median_us"]:
                best = rec
        if best is None:
            print(f"batch {batch}: no configuration ran")
            continue
        rows.append(best)
        del case, ref
        torch.cuda.empty_cache()

    print(f"\nsparse_mqa_fp8 on {torch.cuda.get_device_name()}  (H={args.heads}, "
          f"{args.tokens_per_req} q/request, {args.window}+{args.topk} keys, page {args.page})")
    print(f"{'batch':>6} {'tokens':>7} {'median µs':>10} {'min µs':>8} {'GB/s':>8} "
          f"{'FlashMLA µs':>12} {'ours/FlashMLA':>14} {'rel err':>9}  config")
    for r in rows:
        fm = f"{r['flashmla_us']:.1f}" if r["flashmla_us"] else "-"
        ratio = f"{r['ratio_vs_flashmla']:.2f}x" if r["ratio_vs_flashmla"] else "-"
        print(f"{r['batch']:>6} {r['tokens']:>7} {r['median_us']:>10.1f} {r['min_us']:>8.1f} "
              f"{r['gbps']:>8.0f} {fm:>12} {ratio:>14} {r['rel_err']:>9.1e}  "
              f"{r['config'] or 'default'}")
        if not r["config"]:
            print(f"{'':>6} default = {r['resolved_config']}")
    print("\ncompiled variants:")
    from dspark.kernels import sparse_mqa as smqa
    report_compiled(smqa._sparse_mqa_kernel)
    from dspark.kernels import sparse_mqa_v3
    report_compiled(sparse_mqa_v3._sparse_mqa_v3_kernel)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                           triton=__import__("triton").__version__, args=vars(args),
                           results=rows), f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
