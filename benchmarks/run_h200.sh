#!/usr/bin/env bash
# One device call on an H200 that gathers the GPU numbers the open issues ask for, most wanted
# first, each step time-boxed so one call (<= 600 s) always returns what finished.
# Run from the repo root: `bash benchmarks/run_h200.sh`; results land in $OUT (or ./out) as ONE
# archive, results.tgz (the device returns only a few files per call).
#   BUDGET=570  seconds for the whole script (default 570)
#   STEPS="tests decode bench ..."  which steps, in this order (default: all, in the order below)
#   GPU_TESTS="tests/test_v4_graph.py ..."  what the tests step runs (default: the whole suite's
#              GPU-marked tests; the full set needs more than 200 s, so name files to go first)
#   UNMARKED_TESTS="tests/..." UNMARKED_S=150  the unmarked kernel tests the tests step runs first
#              on CUDA, and their time box
#   GPU_S=300  the time box of the GPU-marked tests; GPU_K="expr": their pytest -k
#   KERNEL_ARGS="--skip-moe ..."  extra arguments of the kernels step
# Triton's compile cache comes back as $OUT/triton-cache.txz.00, .01, ... (xz: a third of gzip's
# size, and a call carries 64 MiB in all): copy the parts to the repo root as
# .triton-cache.txz.* (git-ignored) and name them in the next call's carry; that
# call unpacks it first and skips the cold compiles (~100 s of a fresh machine's bench
# warm-up); kernels whose source changed compile again.
set -uo pipefail
OUT=${OUT:-out}; R="$OUT/r"; mkdir -p "$R"; R=$(realpath "$R")   # absolute: steps may cd elsewhere
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 DSPARK_INSTAFAIL=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.triton-cache}; mkdir -p "$TRITON_CACHE_DIR"
ls .triton-cache.txz* >/dev/null 2>&1 && cat .triton-cache.txz* | xz -d -T0 | tar x -C "$TRITON_CACHE_DIR"
echo "Triton cache $TRITON_CACHE_DIR: $(find "$TRITON_CACHE_DIR" -type f | wc -l) files at the start"
BUDGET=${BUDGET:-570}; T0=$SECONDS
STEPS=${STEPS:-"tests decode kernels bench trace draft qwen3 sweep mhc tp"}   # also: det (deterministic mode), detprof, detflash, launch, abtree (OLD_TREE=dir), pdl (PDL off / on), flash, flashtp, flashprof, host, timeline
left() { local l=$((BUDGET - SECONDS + T0)); [ "$l" -gt "$1" ] && l=$1; [ "$l" -lt 1 ] && l=1; echo $l; }
step() { echo "[t=$((SECONDS - T0))s] $1"; }
for s in $STEPS; do case $s in
tests)   # correctness first: every kernel / graph against its torch or eager reference
  step "GPU tests"
  # kernel tests that are unmarked (they run on CPU under the interpreter too, on CUDA here)
  timeout "$(left ${UNMARKED_S:-150})" python -m pytest -q -rfE ${UNMARKED_TESTS:-tests/test_sampling_kernel.py \
    tests/test_decode_fused.py tests/test_norm_rope.py tests/test_v4_host_plan.py tests/test_sampling.py \
    tests/test_fp4_moe_grouped.py} > "$R/gpu_tests_sampling.txt" 2>&1
  tail -3 "$R/gpu_tests_sampling.txt" | cut -c1-300
  grep -A12 "^=== FAILED" "$R/gpu_tests_sampling.txt" | cut -c1-200 | head -40
  timeout "$(left ${GPU_S:-300})" python -m pytest -q -m gpu -rfE ${GPU_TESTS:-tests} ${GPU_K:+-k "$GPU_K"} \
    > "$R/gpu_tests.txt" 2>&1
  tail -12 "$R/gpu_tests.txt" | cut -c1-300
  grep -A12 "^=== FAILED" "$R/gpu_tests.txt" | cut -c1-200 | head -40 ;;
decode)  # V4-Flash decode vs HBM roofline and vs HF (grouped FP4 MoE + target graphs: the defaults)
  step "bench_decode_v4 (grouped FP4 MoE + target graphs)"
  timeout "$(left 150)" python benchmarks/bench_decode_v4.py --context 128,4096 --new-tokens 32 \
    --kernel-profile 10 --host-profile 20 --loop-timeline 20 --json "$R/bench_decode_v4.json" \
    > "$R/bench_decode_v4.txt" 2>&1
  grep -v -i "warn\|it/s\]" "$R/bench_decode_v4.txt" | tail -40 | cut -c1-250 ;;
quick)   # the decode step at context 128 only, no HF side (kernel + host profiles)
  step "bench_decode_v4 quick"
  timeout "$(left 120)" python benchmarks/bench_decode_v4.py --context 128 --skip-hf \
    --kernel-profile 5 --host-profile 10 --timeline 5 --json "$R/bench_decode_quick.json" > "$R/bench_decode_quick.txt" 2>&1
  grep -v -i "warn\|it/s\]" "$R/bench_decode_quick.txt" | grep -A22 "^ context\|^(c)\|^(d)" | cut -c1-200 ;;
ab)      # A/B of the debug switches (dspark/debug.py) on the quick decode row (device ms per
         # forward included): AB="DSPARK_NO_PDL=1 ..." (each word one variant; join the switches
         # of one variant with commas); AB_ARGS="--timeline 3": extra bench arguments of every
         # variant. A/Bs of a kernel change: two trees (git worktrees) in the same call.
  for v in ${AB:-DSPARK_NO_PDL=0 DSPARK_NO_PDL=1}; do
    step "bench_decode_v4 quick with ${v//,/ }"; tag="$R/ab_${v//[,=]/_}"
    env ${v//,/ } timeout "$(left 90)" python benchmarks/bench_decode_v4.py --context 128 --skip-hf \
      --iters 30 ${AB_ARGS:-} --json "$tag.json" > "$tag.txt" 2>&1
    grep -v -i "warn\|it/s\]" "$tag.txt" | grep -A2 "^ context" | tail -1 | cut -c1-200
  done ;;
quick_serial) # the same with one round at a time (no overlapped decode), for comparison
  step "bench_decode_v4 quick --no-overlap"
  timeout "$(left 120)" python benchmarks/bench_decode_v4.py --context 128 --skip-hf --no-overlap \
    --json "$R/bench_decode_v4_no_overlap.json" > "$R/bench_decode_v4_no_overlap.txt" 2>&1
  grep -v -i "warn\|it/s\]" "$R/bench_decode_v4_no_overlap.txt" | grep -A4 "^ context" | cut -c1-160 ;;
ncu)     # Nsight Compute sections of the attention and MoE decode kernels
  step "ncu"
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -z "$NCU" ]; then echo "no ncu on this machine"; else
    # stall reasons: % of active warps' cycles stalled on each (long_scoreboard = global memory)
    STALLS=$(for s in long_scoreboard short_scoreboard wait math_pipe_throttle lg_throttle \
      mio_throttle not_selected selected barrier dispatch_stall no_instruction tex_throttle; do
      printf "smsp__warp_issue_stalled_%s_per_warp_active.pct," $s; done)
    for k in ${NCU_KERNELS:-attention:sparse_mqa_v3 moe:_tc_gate_up fp8:fp8_gemv_tc}; do
      f="$R/ncu_${k%%:*}_${k#*:}.txt"
      timeout "$(left 150)" "$NCU" --kernel-name "regex:${k#*:}" --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --metrics "${STALLS%,}" python benchmarks/ncu_targets.py --only "${k%%:*}" > "$f" 2>&1
      grep -v "^==PROF==\|^    ---\|^ *$" "$f" | grep -i "duration\|throughput\|stall\|warp cycles\|issued\|registers\|occupancy\|eligible\|active warps\|error" | head -40
    done
  fi ;;
small)   # sparse MQA at 1-8 query tokens (the batch-1 decode step): more KV splits
  step "sweep_attention --grid small"
  timeout "$(left 150)" python benchmarks/sweep_attention.py --grid small --batches 1 2 4 8 \
    --tokens-per-req 1 --no-flashmla --budget-s 110 --json "$R/sweep_attention_small.json" \
    > "$R/sweep_small.txt" 2>&1; grep -v -i warn "$R/sweep_small.txt" | tail -24 ;;
v3c)     # fp16 MMA operands in the sparse-MQA v3 kernel vs the shipped bf16 rows
  step "sweep_attention --grid v3c"
  timeout "$(left 200)" python benchmarks/sweep_attention.py --grid v3c --budget-s 150 \
    --json "$R/sweep_attention_v3c.json" > "$R/sweep_v3c.txt" 2>&1; grep -v -i warn "$R/sweep_v3c.txt" | tail -16 ;;
moe)     # the grouped FP4 MoE kernels at decode / verify token counts
  step "bench_decode_kernels --skip-fp8"
  timeout "$(left 120)" python benchmarks/bench_decode_kernels.py --skip-fp8 --moe-tokens 1 6 16 \
    --json "$R/bench_moe.json" > "$R/bench_moe.txt" 2>&1; grep -v -i warn "$R/bench_moe.txt" | tail -22 ;;
moepaths) # one V4-Flash layer's routed MoE on each GPU path by batch tokens (graph replay, cold L2)
  step "bench_moe_paths"
  timeout "$(left ${MOEPATHS_S:-120})" python benchmarks/bench_moe_paths.py ${MOEPATHS_ARGS:-} \
    --json "$R/bench_moe_paths_h200.json" > "$R/bench_moe_paths_h200.txt" 2>&1
  grep -v -i warn "$R/bench_moe_paths_h200.txt" | tail -${MOEPATHS_LINES:-60} | cut -c1-160 ;;
kernels) # the few-token FP8 / grouped FP4 MoE kernels alone (cold L2, graph replay)
  step "bench_decode_kernels (few-token FP8 / grouped FP4 MoE kernels, old vs new)"
  timeout "$(left 150)" python benchmarks/bench_decode_kernels.py ${KERNEL_ARGS:-} \
    --json "$R/bench_decode_kernels.json" > "$R/bench_decode_kernels.txt" 2>&1
  grep -v -i warn "$R/bench_decode_kernels.txt" | tail -12 ;;
bench)   # DSpark vs speculation off on the shipped pair, per concurrency and policy, with the
         # compiles / captures / eager fallbacks inside each timed run (must be 0); engine
         # defaults (on CUDA: target and draft passes as CUDA graphs); run alone: a busy CPU skews it.
         # POLICIES=fixed,scheduled (default fixed: each scheduled engine adds its SPS profile and
         # 252 graph captures; the run also pays the cold Triton compiles, ~90-140 s)
  step "bench T=1,0 (one process: the same engines for both temperatures)"
  timeout "$(left ${BENCH_S:-400})" python -m dspark.bench --num-prompts 64 \
    --max-tokens 128 --temperature 1,0 --concurrency 1,4,16,64 --policies ${POLICIES:-fixed} --ignore-eos \
    --json "$R/bench_dspark_vs_off_h200.json" --plot "$R/bench_dspark_vs_off_h200.png" \
    > "$R/bench_dspark_vs_off_h200.txt" 2>&1
  tr '\r' '\n' < "$R/bench_dspark_vs_off_h200.txt" | grep -v "it/s\]\|req/s\]\|s/req\]\|bucket\|tensor/s\|^ *$" \
    | grep -v "^conditional\|^WARNING: c=.* off:\|^T=.* c=.*: DSpark" | tail -24 | cut -c1-200
  grep -q "^ conc" "$R/bench_dspark_vs_off_h200.txt" || grep "^T=.* c=.*: DSpark" "$R/bench_dspark_vs_off_h200.txt"
  step "round profile + kernel trace T=1"
  timeout "$(left 60)" python -m dspark.bench --profile --trace --temperature 1.0 \
    --json "$R/profile_T1.json" > "$R/profile_T1.txt" 2>&1
  grep -v "^  [a-z_]*: \|^benchmark results\|\.json:" "$R/profile_T1.txt" | head -24 ;;
det)     # deterministic mode (EngineConfig.deterministic): its GPU tests (batch-invariant kernels,
         # batched == alone == chunked, speculation on == off), then its cost: the same bench
         # (shipped pair, c = 1 and 16) with the default engines and with --deterministic
  step "deterministic GPU tests"
  timeout "$(left ${DET_TESTS_S:-240})" python -m pytest -q -m gpu -rfE tests/test_batch_invariant.py \
    tests/test_deterministic.py ${DET_K:+-k "$DET_K"} > "$R/det_gpu_tests.txt" 2>&1
  tail -3 "$R/det_gpu_tests.txt" | cut -c1-300; grep -A25 "^=== FAILED\|^____" "$R/det_gpu_tests.txt" | grep -v "^ *$" | cut -c1-200 | head -60
  [ "${DET_BENCH:-1}" = 0 ] || for mode in default deterministic; do   # DET_BENCH=0: the tests only
    step "bench $mode (c = 1, 16)"
    timeout "$(left ${DET_BENCH_S:-150})" python -m dspark.bench --num-prompts ${DET_PROMPTS:-32} --max-tokens 128 \
      --temperature 1,0 --concurrency 1,16 --ignore-eos $([ $mode = deterministic ] && echo --deterministic) \
      --json "$R/bench_${mode}_c1_c16_h200.json" > "$R/bench_${mode}_c1_c16_h200.txt" 2>&1
    tr '\r' '\n' < "$R/bench_${mode}_c1_c16_h200.txt" | grep -v "it/s\]\|req/s\]\|s/req\]\|bucket\|^ *$" | tail -14 | cut -c1-200
  done ;;
detprof) # deterministic mode's batch-1 round: split and kernels per phase (DETPROF_T temperatures)
  for T in ${DETPROF_T:-0 1.0}; do
    step "deterministic round profile + kernel trace T=$T"
    timeout "$(left 90)" python -m dspark.bench --profile --trace --deterministic --temperature $T \
      --json "$R/profile_deterministic_T${T%.0}.json" > "$R/profile_deterministic_T${T%.0}.txt" 2>&1
    grep -v "^  [a-z_]*: \|^benchmark results\|\.json:" "$R/profile_deterministic_T${T%.0}.txt" | head -24 | cut -c1-300
  done ;;
flash)   # V4-Flash width, 4 layers + the DSpark stages, random weights (tau ~ 1, so the split and
         # the projection at dspark.md §9's per-position acceptance are what to read)
  D=${FLASH_DIR:-/tmp/flash4_dspark}
  [ -f "$D/config.json" ] || { step "flash checkpoint"; timeout "$(left 300)" python -m dspark.tools.make_checkpoint \
    --preset flash --layers 4 --dtype fp8 --fp4-experts --dspark --out "$D" > "$R/flash_ckpt.txt" 2>&1; }
  step "bench flash round split"
  timeout "$(left 300)" python -m dspark.bench --model "$D" --num-prompts 32 --max-tokens 64 --temperature 0 \
    --ignore-eos --concurrency 1,4,16 --policies fixed,scheduled \
    --json "$R/bench_flash4_round_split_h200.json" --plot "$R/bench_flash4_round_split_h200.png" \
    > "$R/bench_flash4_round_split_h200.txt" 2>&1
  grep -v "it/s\]\|req/s\]\|s/req\]\|bucket" "$R/bench_flash4_round_split_h200.txt" | tail -22 | cut -c1-200 ;;
flashprof) # V4-Flash width, 4 layers: the round split and its kernels per phase at each batch of
         # FLASHPROF_B (default 1, e.g. "1,16"; the checkpoint bench_tp writes, or FLASH_DIR)
  D=${FLASH_DIR:-/tmp/dspark_bench/flash-4L-fp8-fp4-dspark}
  [ -f "$D/config.json" ] || { step "flash checkpoint (bench_tp's)"; timeout "$(left 200)" python -c \
    "import sys; sys.path.insert(0, 'benchmarks'); import bench_decode_v4 as b; b.prepare_checkpoint(None, 'flash', 4, '$D', 16, dspark=True)"; }
  FB=${FLASHPROF_B:-1}; for B in ${FB//,/ }; do
    step "flash round profile + kernel trace T=0, batch $B ($D)"
    timeout "$(left ${FLASHPROF_S:-150})" python -m dspark.bench --model "$D" --profile --trace \
      --concurrency $B --dataset dspark/assets/default/heldout_prompts.jsonl \
      --num-prompts $((B > 4 ? B : 4)) --max-tokens 64 --temperature 0 --ignore-eos \
      --json "$R/profile_flash4_T0_B$B.json" > "$R/profile_flash4_T0_B$B.txt" 2>&1
    grep -v "^  [a-z_]*: \|^benchmark results\|\.json:" "$R/profile_flash4_T0_B$B.txt" | head -30 | cut -c1-250
  done ;;
trace)   # which kernels each phase of a round runs (kernels / device-busy ms per round), at each
         # TRACE_T temperature (default "1.0 0") with TRACE_C requests in every round (default 1)
  for T in ${TRACE_T:-1.0 0}; do C=${TRACE_C:-1}; tag="trace_T${T%.0}_c$C"
    step "round profile + kernel trace T=$T c=$C"
    timeout "$(left ${TRACE_S:-90})" python -m dspark.bench --profile --trace --concurrency $C \
      --num-prompts $((C > 4 ? C : 4)) --max-tokens 128 --ignore-eos --temperature $T --json "$R/$tag.json" > "$R/$tag.txt" 2>&1
    grep -v "^  [a-z_]*: \|^benchmark results\|\.json:" "$R/$tag.txt" | head -30 | cut -c1-250
  done ;;
host)    # where a round's host time goes: cProfile over the timed closed loop, c = 1 and 4
  for T in ${HOST_T:-0 1.0}; do
    step "host profile T=$T"
    timeout "$(left 120)" python benchmarks/host_profile.py --concurrency ${HOST_C:-1,4} --temperature $T \
      > "$R/host_profile_T${T%.0}.txt" 2>&1
    tr '\r' '\n' < "$R/host_profile_T${T%.0}.txt" | grep -A34 "^=== c=" | grep -v "it/s\]\|req/s\]\|s/req\]" | cut -c1-160
  done ;;
flashtp) # V4-Flash width, 4 layers: decode step and DSpark round, single device and TP world 1
         # (FLASHTP_WORLD="": the single-device row only)
  step "bench_tp --world 1 (flash width: decode steps and DSpark rounds)"
  timeout "$(left ${FLASHTP_S:-200})" python benchmarks/bench_tp.py --world "${FLASHTP_WORLD-1}" --batch ${FLASHTP_B:-1,16} \
    --json "$R/bench_tp.json" > "$R/bench_tp.txt" 2>&1
  grep -v -i "warn\|it/s\]" "$R/bench_tp.txt" | tail -8 | cut -c1-250 ;;
timeline) # batch-1 round: plain vs synced per step, and the device's idle time by host phase
  for T in ${TIMELINE_T:-1.0 0}; do
    step "round timeline T=$T"
    timeout "$(left 120)" python benchmarks/round_timeline.py --temperature $T \
      --json "$R/round_timeline_T${T%.0}.json" --trace-out "$R/round_trace_T${T%.0}.json.gz" \
      > "$R/round_timeline_T${T%.0}.txt" 2>&1
    tr '\r' '\n' < "$R/round_timeline_T${T%.0}.txt" | grep "tok/s,\|traced:\|^  \|idle\|Error\|error" | cut -c1-200
  done ;;
draft)
  step "bench_draft"
  timeout "$(left 60)" python benchmarks/bench_draft.py --batch 1 8 --json "$R/bench_draft.json" \
    > "$R/bench_draft.txt" 2>&1; tail -4 "$R/bench_draft.txt" ;;
qwen3)   # Qwen3-4B-width decode and the DSpark round split
  step "bench_qwen3"
  timeout "$(left 120)" python benchmarks/bench_qwen3.py --json "$R/bench_qwen3.json" \
    > "$R/bench_qwen3.txt" 2>&1; tail -14 "$R/bench_qwen3.txt" ;;
sweep)   # our sparse MQA kernel vs FlashMLA (side by side when flash_mla imports)
  step "sweep_attention"
  timeout "$(left 90)" python benchmarks/sweep_attention.py --grid quick --json "$R/sweep_attention.json" \
    > "$R/sweep.txt" 2>&1; grep -v -i warn "$R/sweep.txt" | tail -12 ;;
filters) # filter_logits vs the torch top-k / top-p path, then the engine with top-k / top-p
  step "bench_sampling_filters"
  timeout "$(left 120)" python benchmarks/bench_sampling_filters.py --json "$R/bench_sampling_filters.json" \
    > "$R/bench_sampling_filters.txt" 2>&1; grep -v -i warn "$R/bench_sampling_filters.txt" | tail -11
  step "bench T=1 top-k 50 top-p 0.9"
  timeout "$(left 120)" python -m dspark.bench --num-prompts 8 --max-tokens 128 \
    --temperature 1.0 --top-k 50 --top-p 0.9 --json "$R/bench_filters_engine.json" > "$R/bench_filters_engine.txt" 2>&1
  tail -c 1500 "$R/bench_filters_engine.txt" | tr '\r' '\n' | grep -v "it/s\]\|req/s\]\|s/req\]" | tail -3 ;;
pdl)     # PDL launches (test_pdl runs with and without), the 16-bit skinny linears, the Triton
         # row argmax: their tests on CUDA, graph replay == eager, then (other steps) the decode
         # step and A/Bs, e.g. STEPS="pdl quick ab" AB="DSPARK_NO_PDL=0 DSPARK_NO_PDL=1"
  step "PDL / linear16 / argmax tests on CUDA"
  timeout "$(left 150)" python -m pytest -q -rfE tests/test_pdl.py tests/test_argmax.py \
    tests/test_qlinear.py -k "pdl or argmax or linear16 or skinny" > "$R/pdl_tests.txt" 2>&1
  tail -3 "$R/pdl_tests.txt" | cut -c1-300; grep -A12 "^=== FAILED\|^E  " "$R/pdl_tests.txt" | cut -c1-200 | head -30
  timeout "$(left 150)" python -m pytest -q -rfE -m gpu tests/test_pdl.py tests/test_v4_graph.py \
    -k "pdl or (replay_equals_eager and not bites)" > "$R/pdl_graph_tests.txt" 2>&1
  tail -3 "$R/pdl_graph_tests.txt" | cut -c1-300; grep -A12 "^=== FAILED\|^E  " "$R/pdl_graph_tests.txt" | cut -c1-200 | head -30
  step "bench_pdl_chain (the FP8 GEMV's PDL preload, a chain of 4 GEMVs)"
  timeout "$(left 90)" python benchmarks/bench_pdl_chain.py --json "$R/bench_pdl_chain.json" \
    > "$R/bench_pdl_chain.txt" 2>&1; grep -v -i warn "$R/bench_pdl_chain.txt" | tail -6 ;;
mhc)
  step "bench_mhc"
  timeout "$(left 60)" python benchmarks/bench_mhc.py --T 1,2,6,64 --finish-sweep > "$R/mhc.txt" 2>&1; tail -17 "$R/mhc.txt" ;;
launch)  # host microseconds of each kind of CUDA call a batch-1 round makes (graph replays,
         # eager ops, uploads, reads, Triton launches), defaults and without PDL / side streams
  step "launch_costs --variants"
  timeout "$(left ${LAUNCH_S:-240})" python benchmarks/launch_costs.py --variants \
    --json "$R/launch_costs_h200.json" > "$R/launch_costs_h200.txt" 2>&1
  grep -v -i "warn\|it/s\]" "$R/launch_costs_h200.txt" | tail -45 | cut -c1-160 ;;
detflash) # deterministic mode's cost at V4-Flash width: decode step and DSpark round (bench_tp,
         # single device, B = 1 and 16), the default engine then the deterministic one
  for mode in default deterministic; do
    step "bench_tp flash width, $mode"
    timeout "$(left ${DETFLASH_S:-200})" python benchmarks/bench_tp.py --world "" --batch 1,16 \
      $([ $mode = deterministic ] && echo --deterministic) --json "$R/bench_tp_flash_$mode.json" \
      > "$R/bench_tp_flash_$mode.txt" 2>&1
    tr '\r' '\n' < "$R/bench_tp_flash_$mode.txt" | grep -v -i "warn\|it/s\]" | tail -3 | cut -c1-250
  done ;;
abtree)  # A/B of another tree (OLD_TREE: a `git archive` of the commit before a change, carried)
         # against this one in the same call: the flash-width decode step and round (bench_tp),
         # then the shipped-pair bench (c = 1, 16, T = 0); ABTREE_PARTS="tp" or "bench" for one
         # of them (a flash-width load + cold compiles take ~3 min per tree); ABTREE_ORDER="old new"
         # runs the old tree first (default new first); ABTREE_NEW_ARGS: extra arguments of the
         # new tree's command alone (e.g. "--kernel-profile" for bench_tp)
  if [ -z "${OLD_TREE:-}" ] || [ ! -d "${OLD_TREE:-}/dspark" ]; then
    echo "abtree: set OLD_TREE to a tree holding dspark/ (git archive of the old commit)"; continue; fi
  O=$(realpath "$OLD_TREE"); [ -e "$O/dspark/assets" ] || ln -s "$PWD/dspark/assets" "$O/dspark/assets"
  for part in ${ABTREE_PARTS:-tp bench}; do for tree in ${ABTREE_ORDER:-new old}; do
    d=$PWD; [ $tree = old ] && d=$O
    step "$part A/B ($tree tree)"
    if [ $part = tp ]; then box=${ABTREE_TP_S:-300}
      cmd=(python benchmarks/bench_tp.py --world "" --batch 1,16); show="."
    else box=${ABTREE_BENCH_S:-150}
      cmd=(python -m dspark.bench --num-prompts 32 --max-tokens 128 --temperature 0 --concurrency 1,16 --ignore-eos)
      show="^ *1[6 ] fixed\|^ *1 fixed"; fi
    extra=(); [ $tree = new ] && extra=(${ABTREE_NEW_ARGS:-})
    (cd "$d" && PYTHONPATH=. timeout "$(left $box)" "${cmd[@]}" "${extra[@]}" \
      --json "$R/ab_${part}_$tree.json" > "$R/ab_${part}_$tree.txt" 2>&1)
    tr '\r' '\n' < "$R/ab_${part}_$tree.txt" | grep -v -i "warn\|it/s\]" | grep "$show" | tail -3 | cut -c1-250
  done; done ;;
tp)      # the TP runner against the single-device runner (world 1 on one GPU; 1,2 where lent)
  step "TP GPU tests (NCCL, fixed-shape steps captured with the collectives inside)"
  timeout "$(left 200)" python -m pytest -q -rfE -m gpu tests/test_tp_fixed_shape.py \
    > "$R/tp_tests.txt" 2>&1
  tail -3 "$R/tp_tests.txt" | cut -c1-300; grep -A12 "^=== FAILED" "$R/tp_tests.txt" | cut -c1-200 | head -30
  step "bench_tp (flash width, 4 layers: decode steps and DSpark rounds, B = 1 and 16)"
  W=1; [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && W=1,2
  timeout "$(left 250)" python benchmarks/bench_tp.py --world $W --json "$R/bench_tp.json" \
    > "$R/bench_tp.txt" 2>&1; grep -v -i "warn\|it/s\]" "$R/bench_tp.txt" | tail -8 | cut -c1-250 ;;
*) echo "unknown step $s" ;;
esac; done
step "done"
tar czf "$OUT/results.tgz" -C "$OUT" r && rm -rf "$R"
# in parts of 15 MiB: a file that comes back may be at most 16 MiB
tar c -C "$TRITON_CACHE_DIR" . 2>/dev/null | xz -T0 -6 | split -b 15M -d - "$OUT/triton-cache.txz."
