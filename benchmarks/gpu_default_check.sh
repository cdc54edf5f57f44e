#!/usr/bin/env bash
# A short call on a 2-GPU machine: the default multi-GPU path (whole ls_adam state, per-bucket copy and
# division of the overlapped reduction) through the two-GPU tests, then one pair of 120-update runs on the
# same batches: 1 GPU --update-freq 2 vs 2 GPUs (grouped). Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
python -m pytest -q -m gpu tests/gpu/test_multi_gpu.py -k "not sharded" > "$OUT/gpu_multi_tests_default.log" 2>&1
echo "tests rc=$? $(tail -1 "$OUT/gpu_multi_tests_default.log")"
G=(--max-update "${UPDATES:-120}" --grouped-shuffling)
run d1_1gpu_uf2 env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
run d2_2gpu_default $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
python benchmarks/summarize_train_logs.py "$OUT/d*.log" 40
