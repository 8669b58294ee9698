"""Top-k / top-p: `filter_logits` (one launch, kernels/sampling_filters.py) vs the torch path of
`probs_from_logits` (sort, softmax, cumsum, scatter), on CUDA, graph replay.

For each vocabulary size and row count: us per call of (a) probs_from_logits(logits, T, k, p)
and (b) filter_logits(...) followed by the softmax the fused kernels do on its output (here a
torch softmax, so both sides produce the same probabilities), and whether the kept token sets
agree. The rule of sampling.fused_filters_enabled comes from these numbers.

    python benchmarks/bench_sampling_filters.py --json out/bench_sampling_filters.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from bench_decode_kernels import graph_time  # noqa: E402
from dspark.kernels.sampling_filters import filter_logits  # noqa: E402
from dspark.sampling import probs_from_logits  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[512, 32768, 129280])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6, 48])
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=0.9)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sampling_filters: no CUDA device; on CPU run "
              "python -m pytest -q tests/test_sampling_filters.py")
        return 0
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows_out = []
    print(f"{'V':>7} {'rows':>5} {'torch us':>9} {'fused us':>9} {'speed-up':>8} {'same kept':>9}")
    for V in a.vocab:
        for n in a.rows:
            logits = (torch.randn(n, V, device="cuda", generator=gen) * 3).bfloat16()
            temp = torch.full((n,), 0.8, device="cuda")
            k = torch.full((n,), a.top_k, dtype=torch.int64, device="cuda")
            p = torch.full((n,), a.top_p, device="cuda")
            ref = probs_from_logits(logits, temp, k, p)
            y, _ = filter_logits(logits, temp, k, p)
            same = bool(torch.equal(torch.softmax(y, 1) > 0, ref > 0))
            t_torch = graph_time([lambda: probs_from_logits(logits, temp, k, p)], a.iters)
            t_fused = graph_time([lambda: torch.softmax(filter_logits(logits, temp, k, p)[0], 1)],
                                 a.iters)
            rows_out.append(dict(V=V, rows=n, torch_us=t_torch * 1e6, fused_us=t_fused * 1e6,
                                 same_kept=same))
            print(f"{V:>7} {n:>5} {t_torch * 1e6:>9.1f} {t_fused * 1e6:>9.1f} "
                  f"{t_torch / t_fused:>7.2f}x {str(same):>9}", flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), top_k=a.top_k, top_p=a.top_p,
                           rows=rows_out), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
