"""A decode-step-like chain of weight-streaming FP8 GEMVs (batch 1, V4-Flash shapes) with and
without programmatic dependent launch (dspark.cuda.pdl), on CUDA.

    norm_rope (q_norm) -> wq_b [32768 x 1024] ; norm_rope -> wo_a-like [8192 x 4096]
    -> wo_b [4096 x 8192] -> wq_a + wkv [1536 x 4096]

Every chain reads its own copy of the weights (R copies, more than L2 holds, replayed in turn),
so each GEMV starts with its weights in HBM, as in the decode step. Variants: plain launches
(dspark.debug.NO_PDL) and PDL, the shipped launch (early launch; each lane's first step of
weights loaded before the wait). Timed as one CUDA graph of R chains; outputs of every variant
must equal the plain launches' bit for bit.

    python benchmarks/bench_pdl_chain.py --json out/bench_pdl_chain.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_decode_kernels import graph_time  # noqa: E402
from dspark import debug  # noqa: E402
from dspark.cuda import pdl  # noqa: E402
from dspark.kernels.fp8_gemm import fp8_linear  # noqa: E402
from dspark.kernels.norm_rope import norm_rope  # noqa: E402
from dspark.formats.quant import quant_fp8_blocks  # noqa: E402

# (name, N, K): the chain's GEMVs in order; a norm_rope (triggering the next launch) before the
# first two, as the q_norm / the attention output's combine are in the decode step
CHAIN = [("wq_b", 32768, 1024), ("wo_a-like", 8192, 4096), ("wo_b", 4096, 8192),
         ("wq_a+wkv", 1536, 4096)]
VARIANTS = [("plain", True), ("pdl + preload", False)]      # (name, debug.NO_PDL)


def chain(x, nws, weights):
    """x [1, 1024] bf16 -> the chain's output; weights: [(w, s)] in CHAIN order."""
    h = norm_rope(x, nws[0], 1e-6)
    h = fp8_linear(h, *weights[0])                       # wq_b: [1, 32768]
    h = norm_rope(h[:, :4096].contiguous(), nws[1], 1e-6)
    for w, s in weights[1:]:
        h = fp8_linear(h, w, s)
    return h


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl_chain: needs a CUDA GPU (sm_90+ for PDL)")
    gen = torch.Generator().manual_seed(0)
    sets = []
    for _ in range(a.copies):
        ws = []
        for _, N, K in CHAIN:
            w, s = quant_fp8_blocks(torch.randn(N, K, generator=gen) * (1 / K ** 0.5))
            ws.append((w.cuda(), s.cuda()))
        sets.append(ws)
    nws = [(1 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16).cuda() for n in (1024, 4096)]
    x = torch.randn(1, 1024, generator=gen).to(torch.bfloat16).cuda()
    mb = sum(N * K * 1.0 for _, N, K in CHAIN) / 1e6
    saved = debug.NO_PDL
    rows, want = [], None
    print(f"{len(CHAIN)} FP8 GEMVs per chain ({mb:.0f} MB of weights), {a.copies} weight copies, "
          f"PDL available: ", end="")
    debug.NO_PDL = False
    print(pdl.enabled(x.device))
    print(f"{'variant':18s} {'us / chain':>10s} {'TB/s':>6s} {'equal':>6s}")
    for name, no_pdl in VARIANTS:
        debug.NO_PDL = no_pdl
        if not no_pdl and not pdl.enabled(x.device):
            print(f"{name:18s} (PDL not available)")
            continue
        outs = [chain(x, nws, ws) for ws in sets]        # eager (compiles), then the graph
        if want is None:
            want = outs
        # each thunk keeps its output: after graph_time they are the graph's replayed buffers
        gouts = [None] * len(sets)
        calls = [lambda i=i, ws=ws: gouts.__setitem__(i, chain(x, nws, ws))
                 for i, ws in enumerate(sets)]
        us = 1e6 * graph_time(calls, a.iters)
        equal = all(torch.equal(o, w) for o, w in zip(outs, want)) and all(
            torch.equal(o, w) for o, w in zip(gouts, want))
        rows.append(dict(variant=name, pdl=not no_pdl, us_per_chain=us, equal=equal))
        print(f"{name:18s} {us:10.1f} {mb / us:6.2f} {str(equal):>6s}", flush=True)
    debug.NO_PDL = saved
    if a.json:
        json.dump(dict(summary="PDL chain: " + ", ".join(
            f"{r['variant']} {r['us_per_chain']:.1f} us" for r in rows),
            device={"name": torch.cuda.get_device_name()}, chain=CHAIN, rows=rows),
            open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
