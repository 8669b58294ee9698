#!/usr/bin/env bash
# One device call that gathers every GPU number the open issues ask for (run from the repo root
# on the H200: `bash benchmarks/run_h200.sh`); results land in $OUT (or ./out).
# Order: correctness first (GPU-marked tests re-check every kernel against its torch reference),
# then the end-to-end bench of the shipped pair, then kernel benchmarks.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python -m pytest -q -m gpu tests 2>&1 | tail -20 | tee "$OUT/gpu_tests.txt"
for T in 0 1.0; do
  python -m dspark.bench --num-prompts 64 --max-tokens 128 --temperature $T --concurrency 1,8,32 \
    --json "$OUT/bench_T$T.json" --plot "$OUT/bench_T$T.png" 2>/dev/null | tail -8
done
python benchmarks/bench_attention.py --json "$OUT/bench_attention.json" | tail -8
python benchmarks/bench_gemm.py --json "$OUT/bench_gemm.json" 2>&1 | tail -12
