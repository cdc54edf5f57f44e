#!/usr/bin/env bash
# One call on a 2-GPU machine: does limiting NCCL to a few channels (fewer SMs taken from the
# backward pass while the overlapped all-reduce runs) help a 2-GPU update? t2t, 8192 tokens per GPU,
# grouped shuffling, against 1 GPU --update-freq 2 --grouped-shuffling (the same batches). Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
COMMON+=(--max-update ${UPDATES:-160} --grouped-shuffling)
run c1_1gpu_uf2 env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --update-freq 2
run c2_2gpu_default $T "${COMMON[@]}" --distributed-world-size 2
run c3_2gpu_nccl_4ch env NCCL_MAX_NCHANNELS=4 NCCL_MAX_CTAS=4 $T "${COMMON[@]}" --distributed-world-size 2
run c4_2gpu_nccl_8ch env NCCL_MAX_NCHANNELS=8 NCCL_MAX_CTAS=8 $T "${COMMON[@]}" --distributed-world-size 2
python benchmarks/summarize_train_logs.py "$OUT/c*.log" 60
