#!/usr/bin/env bash
# One call on a 2-GPU machine: throughput scaling and loss agreement of lightseq-train on 2 GPUs
# (its default for ls_adam: --ddp-backend legacy_ddp with the flat gradient all-reduce overlapped
# with the backward; the same with the all-reduce after the backward; fairseq's c10d DDP) against
# 1 GPU with --update-freq 2 (the same global batch per update).
# Dropout 0 so that the ranks' random streams do not matter for the loss comparison. Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
UPD=${UPDATES:-200}
COMMON+=(--max-update "$UPD")
CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --update-freq 2 --save-dir /tmp/s1 > "$OUT/s1_1gpu_uf2.log" 2>&1
echo "1 GPU update-freq 2 rc=$?"
# lightseq-train's default for ls_adam on several GPUs: legacy_ddp, all-reduce overlapped with the backward
$T "${COMMON[@]}" --distributed-world-size 2 --save-dir /tmp/s2 > "$OUT/s2_2gpu_default_overlap.log" 2>&1
echo "2 GPUs default (legacy_ddp, overlapped all-reduce) rc=$?"
LS_FAIRSEQ_SYNC_ALL_REDUCE=1 $T "${COMMON[@]}" --distributed-world-size 2 --save-dir /tmp/s3 \
  > "$OUT/s3_2gpu_legacy_sync_all_reduce.log" 2>&1
echo "2 GPUs legacy_ddp, all-reduce after the backward rc=$?"
if [[ "${SKIP_C10D:-0}" != 1 ]]; then
  $T "${COMMON[@]}" --distributed-world-size 2 --ddp-backend c10d --save-dir /tmp/s4 > "$OUT/s4_2gpu_c10d.log" 2>&1
  echo "2 GPUs c10d rc=$?"
fi
grep -h -m1 -E "legacy_ddp|ddp.backend|overlap" "$OUT"/s2_*.log | cut -c1-250
python benchmarks/summarize_train_logs.py "$OUT/s*.log" 60
