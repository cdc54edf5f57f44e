#!/usr/bin/env bash
# One call on a 2-GPU machine: ls_adam with its state sharded over the ranks (LS_FAIRSEQ_SHARD_ADAM=1;
# it was the default of lightseq-train's deferred step on several GPUs when this ran) against the whole state on every rank
# (LS_FAIRSEQ_SHARD_ADAM=0), both against one GPU with --update-freq 2 on the same batches.
#   s1    1 GPU, --update-freq 2 --grouped-shuffling
#   s2    2 GPUs, --grouped-shuffling, sharded, the next forward waits for each layer's weights
#   s3    2 GPUs, --grouped-shuffling, LS_FAIRSEQ_SHARD_ADAM=0 (the whole state on every rank)
#   s4    2 GPUs, --grouped-shuffling, sharded, LS_FAIRSEQ_GATHER_WAITS=0 (the step waits for its all-gathers)
#   s5    = s2 again, s6 = s1 again (run-to-run spread)
#   then  the two-GPU tests (tests/gpu/test_multi_gpu.py), log gpu_multi_tests.log
#   pr    per-rank profile of the sharded 2-GPU run (benchmarks/profile_ranks.py), if PROFILE=1
# Environment: MAX_TOKENS (8192), UPDATES (200), SKIP_TESTS=1, PROFILE=1. Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
UPD=${UPDATES:-200}
G=(--max-update "$UPD" --grouped-shuffling)
run s1_1gpu_uf2 env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
export LS_FAIRSEQ_SHARD_ADAM=1
run s2_2gpu_sharded $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run s3_2gpu_whole env LS_FAIRSEQ_SHARD_ADAM=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run s4_2gpu_sharded_step_waits env LS_FAIRSEQ_GATHER_WAITS=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run s5_2gpu_sharded_again $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run s6_1gpu_uf2_again env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
grep -ho "ls_adam: optimizer state sharded over [0-9]* ranks\|ls_adam: gradient [a-z-]* overlapped\|all-gathers layer by layer" \
  "$OUT"/s[2-5]*.log | sort | uniq -c
python benchmarks/summarize_train_logs.py "$OUT/s*.log" 60
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  python -m pytest -q -m gpu tests/gpu/test_multi_gpu.py > "$OUT/gpu_multi_tests.log" 2>&1
  echo "tests rc=$? $(tail -1 "$OUT/gpu_multi_tests.log")"
fi
if [[ "${PROFILE:-0}" == 1 ]]; then
  torchrun --nproc_per_node 2 benchmarks/profile_ranks.py --profile-updates 120:30 "${COMMON[@]}" --max-update 155 \
    --distributed-world-size 2 --grouped-shuffling > "$OUT/pr_2gpu_sharded.log" 2>&1
  echo "pr rc=$?"
  grep -h "^\[rank" "$OUT/pr_2gpu_sharded.log" | cut -c1-220
fi
