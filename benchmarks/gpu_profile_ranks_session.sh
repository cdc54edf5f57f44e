#!/usr/bin/env bash
# One call on a 2-GPU machine: torch.profiler timelines of 30 updates on every rank
# (benchmarks/profile_ranks.py): 1 GPU --update-freq 2 --grouped-shuffling, 2 GPUs (default:
# grouped, overlapped all-reduce), 2 GPUs with the all-reduce after the backward. Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
COMMON+=(--max-update 155)
P="benchmarks/profile_ranks.py --profile-updates 120:30"
CUDA_VISIBLE_DEVICES=0 python $P "${COMMON[@]}" --update-freq 2 --grouped-shuffling > "$OUT/pr1_1gpu_uf2.log" 2>&1
echo "pr1 rc=$?"
CUDA_VISIBLE_DEVICES=0 python $P "${COMMON[@]}" > "$OUT/pr0_1gpu_uf1.log" 2>&1
echo "pr0 rc=$?"
torchrun --nproc_per_node 2 $P "${COMMON[@]}" --distributed-world-size 2 > "$OUT/pr2_2gpu.log" 2>&1
echo "pr2 rc=$?"
LS_FAIRSEQ_SYNC_ALL_REDUCE=1 torchrun --nproc_per_node 2 $P "${COMMON[@]}" --distributed-world-size 2 \
  > "$OUT/pr3_2gpu_sync_all_reduce.log" 2>&1
echo "pr3 rc=$?"
for f in "$OUT"/pr*.log; do echo "== $(basename "$f")"; grep -h "^\[rank" "$f" | grep -v "calls  " | cut -c1-220; done
