#!/usr/bin/env bash
# One call on a 2-GPU machine: the gradient all-reduce variants of a grouped 2-GPU run (t2t, 8192
# tokens per GPU, 200 updates) against 1 GPU --update-freq 2 --grouped-shuffling (the same batches),
# then the GPU tests on GPU 0. Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
COMMON+=(--max-update 200)
run a1_1gpu_uf2_grouped env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --update-freq 2 --grouped-shuffling
run a2_2gpu_overlap_25mb $T "${COMMON[@]}" --distributed-world-size 2
run a3_2gpu_overlap_100mb $T "${COMMON[@]}" --distributed-world-size 2 --bucket-cap-mb 100
run a4_2gpu_overlap_1000mb $T "${COMMON[@]}" --distributed-world-size 2 --bucket-cap-mb 1000
run a5_2gpu_sync_all_reduce env LS_FAIRSEQ_SYNC_ALL_REDUCE=1 $T "${COMMON[@]}" --distributed-world-size 2
run a6_2gpu_overlap_25mb_simple env NCCL_PROTO=Simple $T "${COMMON[@]}" --distributed-world-size 2
python benchmarks/summarize_train_logs.py "$OUT/a*.log" 60
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  CUDA_VISIBLE_DEVICES=0 timeout 240 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
fi
