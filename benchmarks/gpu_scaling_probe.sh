#!/usr/bin/env bash
# One call on a 2-GPU machine: where the time of a 2-GPU update goes. LS_FAIRSEQ_STEP_TIMING=1 logs
# the GPU time of each micro-batch's forward+backward; 1 GPU with --update-freq 2 runs the same
# batch pairs that the two ranks of a 2-GPU run get, so "slower of the two" is what a rank-synchronous
# update must wait for. Then the scaling with two micro-batches per GPU (2 GPUs --update-freq 2 vs
# 1 GPU --update-freq 4). Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
export LS_FAIRSEQ_STEP_TIMING=1
CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --max-update 200 --update-freq 2 > "$OUT/p1_1gpu_uf2_timing.log" 2>&1
echo "1 GPU uf2 rc=$?"
$T "${COMMON[@]}" --max-update 200 --distributed-world-size 2 > "$OUT/p2_2gpu_timing.log" 2>&1
echo "2 GPUs rc=$?"
CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --max-update 120 --update-freq 4 > "$OUT/p3_1gpu_uf4.log" 2>&1
echo "1 GPU uf4 rc=$?"
$T "${COMMON[@]}" --max-update 120 --distributed-world-size 2 --update-freq 2 > "$OUT/p4_2gpu_uf2.log" 2>&1
echo "2 GPUs uf2 rc=$?"
grep -h "step timing" "$OUT"/p*.log | cut -c1-300
python benchmarks/summarize_train_logs.py "$OUT/p*.log" 40
