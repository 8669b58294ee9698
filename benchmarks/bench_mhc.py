"""Check and time the fused mHC kernels (dspark/kernels/mhc.py) against the torch reference on
one CUDA device; prints one row per token count T.

    python benchmarks/bench_mhc.py                   # V4-Flash width: n = 4, D = 4096, bf16 X
    python benchmarks/bench_mhc.py --D 7168 --T 1,6,512

Two timings per op: `eager` = back-to-back calls timed on the wall clock, which is what a
launch-bound decode step pays (CPU issue cost included); `graph` = the same calls replayed from a
CUDA graph, i.e. GPU time alone. Errors: u / X' as max |Δ| over max |ref|, post / comb likewise.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dspark.kernels import mhc as kernels  # noqa: E402
from dspark.models.deepseek_v4 import mhc as reference  # noqa: E402

HC_EPS, NORM_EPS, ITERS = 1e-6, 1e-6, 20


def eager_us(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def graph_us(fn, iters: int, per_graph: int = 10) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):           # warm-up (and Triton compilation) outside capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    reps = max(1, iters // per_graph)
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (reps * per_graph) * 1e6


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--D", type=int, default=4096)
    ap.add_argument("--T", default="1,2,6,64")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--finish-sweep", action="store_true",
                    help="also time the decode-step post + pre pair per _finish_pre launch choice")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.finish_sweep:
        with torch.inference_mode():
            finish_sweep(args.n, args.D, dtype, args.iters)
    n, D, dev = args.n, args.D, "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = (2 + n) * n
    fn = torch.randn(rows, n * D, device=dev, generator=gen) / (n * D) ** 0.5
    base = torch.randn(rows, device=dev, generator=gen) * 0.5
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    print(f"{torch.cuda.get_device_name()}  n={n} D={D} X={args.dtype}  µs per call")
    print(f"{'':>4} | {'hc_pre eager':^24} | {'hc_pre graph':^15} | {'hc_post eager':^15} | "
          f"{'hc_post graph':^15} | max rel err")
    pair = f"{'torch':>7} {'triton':>7}"
    print(f"{'T':>4} | {pair} {'gain':>8} | {pair} | {pair} | {pair} | "
          f"{'u':>7} {'post':>7} {'comb':>7} {'Xpost':>7}")
    with torch.inference_mode():
        for T in (int(t) for t in args.T.split(",")):
            X = (torch.randn(T, n, D, device=dev, generator=gen) * 2).to(dtype)
            o = torch.randn(T, D, device=dev, generator=gen).to(dtype)
            pre_args = (X, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)
            u, post, comb = kernels.hc_pre(*pre_args)
            u_r, post_r, comb_r = reference.hc_pre_reference(*pre_args)
            y = kernels.hc_post(o, X, post_r, comb_r)
            y_r = reference.hc_post_reference(o, X, post_r, comb_r)
            errs = (rel_err(u, u_r), rel_err(post, post_r), rel_err(comb, comb_r), rel_err(y, y_r))
            t = [f(lambda: impl(*pre_args), args.iters)
                 for f in (eager_us, graph_us)
                 for impl in (reference.hc_pre_reference, kernels.hc_pre)]
            p = [f(lambda: impl(o, X, post, comb), args.iters)
                 for f in (eager_us, graph_us)
                 for impl in (reference.hc_post_reference, kernels.hc_post)]
            print(f"{T:>4} | {t[0]:7.1f} {t[1]:7.1f} {t[0] / t[1]:7.1f}x | {t[2]:7.1f} {t[3]:7.1f} | "
                  f"{p[0]:7.1f} {p[1]:7.1f} | {p[2]:7.1f} {p[3]:7.1f} | "
                  + " ".join(f"{e:7.1e}" for e in errs))

def finish_sweep(n: int, D: int, dtype, iters: int) -> None:
    """A decode step's hc_post (leaving the partials) + hc_pre at T = 1, CUDA-graph µs per pair,
    for each `_finish_pre` (BLOCK_D, num_warps) choice (kernels.FINISH_LAUNCH[True])."""
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    rows = (2 + n) * n
    fn = torch.randn(rows, n * D, device=dev, generator=gen) / (n * D) ** 0.5
    base = torch.randn(rows, device=dev, generator=gen) * 0.5
    scale = torch.rand(3, device=dev, generator=gen) + 0.5
    X = (torch.randn(1, n, D, device=dev, generator=gen) * 2).to(dtype)
    o = torch.randn(1, D, device=dev, generator=gen).to(dtype)
    _, post, comb = reference.hc_pre_reference(X, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)

    def pair():
        Y = kernels.hc_post(o, X, post, comb, next_fn=fn)
        return kernels.hc_pre(Y, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)
    saved = kernels.FINISH_LAUNCH[True]
    want = reference.hc_pre_reference(kernels.hc_post(o, X, post, comb), fn, base, scale, n,
                                      ITERS, HC_EPS, NORM_EPS)
    def unfused():
        Y = kernels.hc_post(o, X, post, comb)
        return kernels.hc_pre(Y, fn, base, scale, n, ITERS, HC_EPS, NORM_EPS)
    print(f"hc_post(next_fn) + hc_pre at T=1, n={n} D={D}: graph µs per pair (without next_fn: "
          f"{graph_us(unfused, iters):.1f})")
    try:
        for block_d in (128, 256, 512):
            for warps in (1, 2, 4):
                kernels.FINISH_LAUNCH[True] = (block_d, warps)
                got = pair()
                err = max(rel_err(g, w) for g, w in zip(got, want))
                print(f"  finish_pre BLOCK_D {block_d:>4} warps {warps}: "
                      f"{graph_us(pair, iters):6.1f} µs  (max rel err {err:.1e})")
    finally:
        kernels.FINISH_LAUNCH[True] = saved


if __name__ == "__main__":
    main()
