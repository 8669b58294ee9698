"""The routed-expert MoE of one V4-Flash layer (256 FP4 experts, top-6, D 4096, I 2048) on the
GPU paths `fp4_moe_grouped` chooses from, by batch tokens: the per-pair tensor-core kernels
(`fp4_moe_tc`, one expert read per (token, slot) pair), the same kernels with the tokens of one
expert in the MMA's 8 columns (`fp4_moe_tc_grouped`) and the `tl.dot_scaled` path
(`fp4_moe_mma`, 16 tokens per block).

Each path is captured in a CUDA graph (so the grouped paths' align step costs what it costs in
the engine's graphs) and replayed with the L2 flushed before each timed replay; median of
--iters. `experts` = distinct experts the routing touches, `GB/s` = their bytes / time (the
bytes a pass over each used expert must read), against the H200's ~4.3 TB/s copy bandwidth.
Outputs are compared with the per-pair kernels (`same` = bit-identical).

    python benchmarks/bench_moe_paths.py --tokens 1 6 16 36 96 --json out/bench_moe_paths.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from dspark.formats.quant import quant_fp4  # noqa: E402
from dspark.kernels.fp4_moe import stack_fp4_experts  # noqa: E402

COPY_BW = 4.3e12


def _graph_time(fn, iters: int) -> tuple[float, torch.Tensor]:
    out = fn()                                   # compile outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = fn()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(iters):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(times), static.clone() if static is not None else out


def _layer(E, D, I, gen):
    experts = [tuple(quant_fp4(torch.randn(*shape, device="cuda", generator=gen) * 0.02)
                     for shape in ((I, D), (I, D), (D, I))) for _ in range(E)]
    stack = stack_fp4_experts(experts)
    per_expert = sum(p[0].numel() + p[1].numel() for p in experts[0])
    del experts
    return stack, per_expert


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+",
                    default=[1, 2, 6, 12, 16, 24, 36, 48, 64, 96, 128, 192, 256, 384])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--configs", action="store_true",
                    help="also time the grouped kernels' (up split, down split, unroll, warps) "
                         "variants")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_paths: needs a CUDA GPU (sm_90); on CPU run "
              "python -m pytest -q tests/test_fp4_moe_tc_grouped.py")
        return 0
    from dspark.kernels import fp4_moe_mma as mma
    from dspark.kernels import fp4_moe_tc as tc
    from dspark.kernels import fp4_moe_tc_grouped as tcg
    from dspark.kernels.fp4_moe import fp4_moe_grouped

    E, k, D, I = 256, 6, 4096, 2048
    gen = torch.Generator(device="cuda").manual_seed(0)
    stack, per_expert = _layer(E, D, I, gen)
    configs = [dict()]
    if args.configs:
        configs += [dict(up_split=2), dict(up_split=4), dict(down_split=2), dict(unroll=1),
                    dict(warps=2), dict(up_split=2, down_split=2)]
    rows = []
    print(f"{'T':>4s} {'pairs':>5s} {'experts':>7s} {'path':28s} {'us':>8s} {'GB/s':>6s} "
          f"{'%copy':>6s} {'same':>5s}")
    for T in args.tokens:
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = torch.rand(T, E, device="cuda", generator=gen).topk(k, dim=-1).indices
        w = torch.rand(T, k, device="cuda", generator=gen)
        used = int(torch.unique(idx).numel())
        paths = {"per-pair tc": lambda: tc.fp4_moe_tc(x, idx, w, stack, 10.0)}
        for cfg in configs:
            name = "grouped tc" + ("" if not cfg else " " + ",".join(
                f"{a}={b}" for a, b in cfg.items()))
            paths[name] = (lambda c: lambda: tcg.fp4_moe_tc_grouped(x, idx, w, stack, 10.0,
                                                                     **c))(cfg)
        paths["dot_scaled mma"] = lambda: mma.fp4_moe_mma(x, idx, w, stack, 10.0)
        paths["fp4_moe_grouped (dispatch)"] = lambda: fp4_moe_grouped(x, idx, w, stack, 10.0)
        ref = None
        for name, fn in paths.items():
            t, y = _graph_time(fn, args.iters)
            if ref is None:
                ref = y
            same = bool(torch.equal(y, ref))
            gbps = used * per_expert / t / 1e9
            rows.append(dict(T=T, pairs=T * k, experts=used, path=name, us=t * 1e6, gbps=gbps,
                             same_as_per_pair=same,
                             rel_err=float((y - ref).abs().max() / ref.abs().max())))
            print(f"{T:4d} {T * k:5d} {used:7d} {name:28s} {t * 1e6:8.1f} {gbps:6.0f} "
                  f"{100 * gbps * 1e9 / COPY_BW:5.1f}% {str(same):>5s}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), copy_bw=COPY_BW,
                           shape=dict(E=E, k=k, D=D, I=I), rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
