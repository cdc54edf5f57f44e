#!/usr/bin/env bash
# One call on a 2-GPU machine: torch.profiler timelines (benchmarks/profile_ranks.py, updates 120-150)
# of 2 GPUs with the whole ls_adam state and with the sharded state and peer writes, then one
# interleaved scaling set (1 GPU uf2, 2 GPUs whole, 2 GPUs sharded with peer writes). Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
P="benchmarks/profile_ranks.py --profile-updates 120:30"
for v in whole:0 peer:1; do
  LS_FAIRSEQ_SHARD_ADAM=${v#*:} torchrun --nproc_per_node 2 $P "${COMMON[@]}" --max-update 155 --grouped-shuffling \
    --distributed-world-size 2 > "$OUT/pr_${v%:*}.log" 2>&1
  echo "pr_${v%:*} rc=$?"
  grep -h "^\[rank 0\]" "$OUT/pr_${v%:*}.log" | grep -v "calls  nvjet\|calls  fmha" | cut -c1-190
done
G=(--max-update "${UPDATES:-200}" --grouped-shuffling)
run q1_1gpu_uf2 env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
run q2_2gpu_whole env LS_FAIRSEQ_SHARD_ADAM=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run q3_2gpu_sharded_peer env LS_FAIRSEQ_SHARD_ADAM=1 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
python benchmarks/summarize_train_logs.py "$OUT/q*.log" 60 | tee "$OUT/summary.txt" | cut -c1-40,200-
intervals "$OUT"/q*.log | tee -a "$OUT/summary.txt"
