#!/usr/bin/env bash
# One device call (~9 min on one H200) that gathers the GPU numbers the open issues ask for.
# Run from the repo root: `bash benchmarks/run_h200.sh`; results land in $OUT (or ./out).
# Order: correctness first (GPU-marked tests re-check every kernel and graph against its torch /
# eager reference), then the end-to-end bench of the shipped pair, then the benchmarks.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python -m pytest -q -m gpu tests > "$OUT/gpu_tests.txt" 2>&1; tail -8 "$OUT/gpu_tests.txt"
for T in 0 1.0; do      # issue 6: τ and speed-up vs speculation off at batch 1 (and 8)
  python -m dspark.bench --num-prompts 16 --max-tokens 128 --temperature $T --concurrency 1,8 \
    --json "$OUT/bench_default_T$T.json" --plot "$OUT/bench_default_T$T.png" 2>/dev/null | tail -4
done
python benchmarks/bench_draft.py --batch 1 8 --json "$OUT/bench_draft.json" 2>/dev/null | tail -4
python benchmarks/bench_qwen3.py --json "$OUT/bench_qwen3.json" 2>/dev/null | tail -14     # issue 8
python benchmarks/sweep_attention.py --json "$OUT/sweep_attention.json" 2>/dev/null | tail -12  # issue 7
python -m dspark.kernels.mhc_bench --T 1,2,6,64 2>/dev/null | tail -6
python benchmarks/bench_decode_v4.py --context 128,4096 --new-tokens 32 \
    --json "$OUT/bench_decode_v4.json" 2>/dev/null | tail -12
# the same with the grouped FP4 MoE kernels and the V4 target replayed as CUDA graphs (both opt-in)
python benchmarks/bench_decode_v4.py --context 128,4096 --new-tokens 32 --grouped-moe --target-graphs \
    --skip-hf --json "$OUT/bench_decode_v4_graphs.json" 2>/dev/null | tail -12
# on a multi-GPU box (e.g. nvidia-h200-x2): NCCL tests ran above (-m gpu); tokens/s vs world size
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  python benchmarks/bench_tp.py --world 1,2 --json "$OUT/bench_tp.json" 2>/dev/null | tail -12
fi
