#!/usr/bin/env bash
# One call on a 2-GPU machine: does grouped shuffling (lightseq-train --grouped-shuffling,
# ls_fairseq/fairseq_ext/batching.py) remove the wait for the rank with the costlier batch?
#   g1  1 GPU, --update-freq 2 --grouped-shuffling  (the same batches, update by update, as g2)
#   g2  2 GPUs, --grouped-shuffling
#   g3  2 GPUs                                       (fairseq's order)
#   g4  1 GPU, --update-freq 2                       (the same batches as g3)
#   g5  1 GPU, --update-freq 4 --grouped-shuffling   (the same batches as g6)
#   g6  2 GPUs, --update-freq 2 --grouped-shuffling
# Scaling is g2/g1, g3/g4 and g6/g5: each pair trains on the same batches, so the batch mix does
# not enter the ratio. Dropout 0: the loss curves of each pair must agree. Logs under $OUT.
#   g7  2 GPUs, --grouped-shuffling --bucket-cap-mb B, for each B in $BUCKETS (the same batches as g1)
# Environment: MAX_TOKENS (8192), UPDATES (200), UF_UPDATES (120, for g5/g6), SKIP_UF=1 skips g5/g6,
# SKIP_PLAIN=1 skips g3/g4, BUCKETS (none): extra g7 runs.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
UPD=${UPDATES:-200}
UF_UPD=${UF_UPDATES:-120}
run g1_1gpu_uf2_grouped env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --max-update "$UPD" --update-freq 2 --grouped-shuffling
run g2_2gpu_grouped $T "${COMMON[@]}" --max-update "$UPD" --distributed-world-size 2 --grouped-shuffling
for b in ${BUCKETS:-}; do
  run "g7_2gpu_grouped_bucket${b}mb" $T "${COMMON[@]}" --max-update "$UPD" --distributed-world-size 2 --grouped-shuffling \
    --bucket-cap-mb "$b"
done
if [[ "${SKIP_PLAIN:-0}" != 1 ]]; then
  run g3_2gpu_plain $T "${COMMON[@]}" --max-update "$UPD" --distributed-world-size 2
  run g4_1gpu_uf2_plain env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --max-update "$UPD" --update-freq 2
fi
if [[ "${SKIP_UF:-0}" != 1 ]]; then
  run g5_1gpu_uf4_grouped env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --max-update "$UF_UPD" --update-freq 4 --grouped-shuffling
  run g6_2gpu_uf2_grouped $T "${COMMON[@]}" --max-update "$UF_UPD" --distributed-world-size 2 --update-freq 2 --grouped-shuffling
fi
python benchmarks/summarize_train_logs.py "$OUT/g[1-47]*.log" 60
python benchmarks/summarize_train_logs.py "$OUT/g[56]*.log" 40
