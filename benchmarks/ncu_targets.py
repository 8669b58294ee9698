"""Drive the decode hot kernels a few times each for Nsight Compute, e.g. (on the GPU machine):

    ncu --kernel-name regex:'sparse_mqa_v3|fp4_moe_gate_up' --launch-skip 2 --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats python benchmarks/ncu_targets.py

Kernels: sparse-MQA v3 at the V4-Flash decode shape of the FlashMLA anchors (64 heads, 2 query
tokens per request, window 128 + top-k 512 of 2048 entries, pages of 64; --batch requests, the
shipped default config), the grouped FP4 MoE at --tokens tokens (V4-Flash widths, 256
experts, top-6), and the skinny FP8 linear of attention's wo_b (4096 x 8192) at --tokens tokens.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--pair-decode", action="store_true", help="MoE: the pair-decode candidate")
    ap.add_argument("--only", choices=("attention", "moe", "fp8"), default=None)
    args = ap.parse_args(argv)
    if args.only in (None, "attention"):
        from bench_attention import build_case

        from dspark.kernels.sparse_mqa import sparse_mqa_fp8
        case = build_case(args.batch, 2, 64, 128, 512, 64, 2048, "cuda")
        for _ in range(args.calls):
            sparse_mqa_fp8(**case)
        torch.cuda.synchronize()
    if args.only in (None, "moe"):
        from dspark.kernels.fp4_moe import fp4_moe_grouped, stack_fp4_experts
        from dspark.formats.quant import quant_fp4
        E, k, D, I = 256, 6, 4096, 2048
        gen = torch.Generator(device="cuda").manual_seed(0)
        experts = [tuple(quant_fp4(torch.randn(*s, device="cuda", generator=gen) * 0.02)
                         for s in ((I, D), (I, D), (D, I))) for _ in range(E)]
        stack = stack_fp4_experts(experts)
        x = torch.randn(args.tokens, D, device="cuda", dtype=torch.bfloat16, generator=gen)
        idx = torch.rand(args.tokens, E, device="cuda", generator=gen).topk(k, dim=-1).indices
        w = torch.rand(args.tokens, k, device="cuda", generator=gen)
        for _ in range(args.calls):
            fp4_moe_grouped(x, idx, w, stack, 10.0, pair_decode=args.pair_decode)
        torch.cuda.synchronize()
    if args.only in (None, "fp8"):
        from dspark.kernels import fp8_gemm as fg
        from dspark.formats.quant import quant_fp8_blocks
        N, K = 4096, 8192
        w, sc = quant_fp8_blocks(torch.randn(N, K, device="cuda") * 0.02)
        x = torch.randn(args.tokens, K, device="cuda", dtype=torch.bfloat16)
        for _ in range(args.calls):
            # the engine's path: the tensor-core GEMV (fp8_gemv_tc) for 1-8 tokens
            fg.fp8_skinny_triton(x, w.view(torch.uint8), sc.view(torch.uint8), N, K,
                                 torch.bfloat16, fg.skinny_precision(x.dtype))
        torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
