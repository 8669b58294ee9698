"""Benchmark the quantized-weight GEMMs at V4-Flash shapes on CUDA (H200).

* fp8_linear (Triton, FP8 e4m3 + 128x128 UE8M0 tiles, bf16 activations) vs a bf16 dense GEMM
  (torch F.linear on the de-quantized weight) for the dense projections of one layer:
  wq_a [1024, 4096], wq_b [32768, 1024], wkv [512, 4096], wo_a group [1024, 4096],
  wo_b [4096, 8192], shared expert w1/w3 [2048, 4096], w2 [4096, 2048].
* fp4_linear (Triton, packed e2m1 + 1x32 UE8M0) for one routed expert's w1 [2048, 4096] and
  w2 [4096, 2048], and the full FP4 routed MoE of one layer (256 experts, top-6, per-expert loop)
  vs the same MoE with bf16 de-quantized experts.

Timing: CUDA events around each call after warmup, L2 flushed (256 MB write) before every timed
call, median of --iters. GB/s = weight bytes the call must read (codes + scales; bf16: 2 B/elem)
/ time, reported against the ~4.3 TB/s copy bandwidth of the H200 (HOPPER.md / H200.md). The MoE
row counts only the experts actually routed to. Each configuration is checked against
de-quantize + F.linear before timing.

    python benchmarks/bench_gemm.py                     # T = 1, 16, 128, 1024
    python benchmarks/bench_gemm.py --tokens 1 64 --json out/bench_gemm.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dspark.kernels.fp4_moe import fp4_linear, fp4_moe  # noqa: E402
from dspark.kernels.fp8_gemm import fp8_linear  # noqa: E402
from dspark.formats.quant import (dequant_fp4_experts, dequant_fp8_blocks, quant_fp4,  # noqa: E402
                                 quant_fp8_blocks)

COPY_BW = 4.3e12
DENSE = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096),
         "wo_a/group": (1024, 4096), "wo_b": (4096, 8192), "shared.w1": (2048, 4096),
         "shared.w2": (4096, 2048)}
EXPERT = {"expert.w1": (2048, 4096), "expert.w2": (4096, 2048)}


def _time(fn, iters: int) -> float:
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times)


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def bench_dense(T, iters, rows):
    for name, (N, K) in DENSE.items():
        w, s = quant_fp8_blocks(torch.randn(N, K, device="cuda") * 0.02)
        wd = dequant_fp8_blocks(w, s, torch.bfloat16)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        err = _rel(fp8_linear(x, w, s), F.linear(x.float(), wd.float()))
        t8 = _time(lambda: fp8_linear(x, w, s), iters)
        tb = _time(lambda: F.linear(x, wd), iters)
        b8 = w.numel() + s.numel()
        rows.append(dict(op=f"fp8 {name}", T=T, N=N, K=K, us=t8 * 1e6, bf16_us=tb * 1e6,
                         gbps=b8 / t8 / 1e9, bf16_gbps=2 * N * K / tb / 1e9, err=err))


def bench_expert(T, iters, rows):
    for name, (N, K) in EXPERT.items():
        w, s = quant_fp4(torch.randn(N, K, device="cuda") * 0.02)
        wd = dequant_fp4_experts(w, s, torch.bfloat16)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        err = _rel(fp4_linear(x, w, s), F.linear(x.float(), wd.float()))
        t4 = _time(lambda: fp4_linear(x, w, s), iters)
        tb = _time(lambda: F.linear(x, wd), iters)
        b4 = w.numel() + s.numel()
        rows.append(dict(op=f"fp4 {name}", T=T, N=N, K=K, us=t4 * 1e6, bf16_us=tb * 1e6,
                         gbps=b4 / t4 / 1e9, bf16_gbps=2 * N * K / tb / 1e9, err=err))


def bench_moe(T, iters, rows, E=256, k=6, D=4096, I=2048):
    gen = torch.Generator(device="cuda").manual_seed(0)
    experts, deq = [], []
    for _ in range(E):        # one layer's experts (~1.9 GB bf16 de-quantized; fine on an H200)
        trip = tuple(quant_fp4(torch.randn(*shape, device="cuda", generator=gen) * 0.02)
                     for shape in ((I, D), (I, D), (D, I)))
        experts.append(trip)
        deq.append(tuple((dequant_fp4_experts(*p, torch.bfloat16),) for p in trip))
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    idx = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1).indices
    w = torch.rand(T, k, device="cuda", generator=gen)
    used = int(torch.unique(idx).numel())

    def dense_lin(a, ws):
        return F.linear(a, ws[0])

    from dspark.kernels.fp4_moe import swiglu_expert

    def bf16_moe():
        out = torch.zeros(x.shape, dtype=torch.float32, device="cuda")
        flat = idx.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=E).tolist()
        tok, start = order // k, 0
        for e, n in enumerate(counts):
            if n:
                sel, t = order[start:start + n], tok[start:start + n]
                out.index_add_(0, t, swiglu_expert(x[t], *deq[e], dense_lin, 10.0,
                                                   w.flatten()[sel]).float())
                start += n
        return out

    err = _rel(fp4_moe(x, idx, w, experts, 10.0), bf16_moe())
    t4 = _time(lambda: fp4_moe(x, idx, w, experts, 10.0), iters)
    tb = _time(bf16_moe, iters)
    per_expert = sum(p[0].numel() + p[1].numel() for p in experts[0])
    rows.append(dict(op=f"fp4 MoE ({used}/{E} experts used)", T=T, N=D, K=I, us=t4 * 1e6,
                     bf16_us=tb * 1e6, gbps=used * per_expert / t4 / 1e9,
                     bf16_gbps=used * 3 * D * I * 2 / tb / 1e9, err=err))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 1024])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-moe", action="store_true", help="skip the full-layer MoE rows")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm: no CUDA device. This benchmark times the Triton fp8_linear / FP4 MoE "
              "kernels on the GPU (H200); on CPU run the correctness tests instead: "
              "python -m pytest -q tests/test_qlinear.py")
        return 0
    torch.manual_seed(0)
    rows = []
    for T in args.tokens:
        bench_dense(T, args.iters, rows)
        bench_expert(T, args.iters, rows)
        if not args.no_moe:
            bench_moe(T, max(3, args.iters // 4), rows)
    print(f"{'op':32s} {'T':>5s} {'N':>6s} {'K':>6s} {'us':>9s} {'GB/s':>7s} {'%copy':>6s} "
          f"{'bf16 us':>9s} {'bf16GB/s':>8s} {'rel err':>8s}")
    for r in rows:
        print(f"{r['op']:32s} {r['T']:5d} {r['N']:6d} {r['K']:6d} {r['us']:9.1f} {r['gbps']:7.0f} "
              f"{100 * r['gbps'] * 1e9 / COPY_BW:5.1f}% {r['bf16_us']:9.1f} {r['bf16_gbps']:8.0f} "
              f"{r['err']:8.1e}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=COPY_BW, results=rows), f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
