#!/usr/bin/env bash
# One call on a 2-GPU machine: where the host time of a 2-GPU rank goes, against one GPU.
# benchmarks/profile_ranks.py --host-ops records updates 120-129 (CPU ops and CUDA kernels) of
# 1 GPU --update-freq 2 and of 2 GPUs (the default), grouped, t2t, 8192 tokens per GPU; then ROUNDS
# (default 1) scaling rounds (benchmarks/gpu_scaling_rounds.sh) on the same machine. Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
P="benchmarks/profile_ranks.py --profile-updates 120:10 --host-ops"
A=("${COMMON[@]}" --max-update 131 --grouped-shuffling)
CUDA_VISIBLE_DEVICES=0 python $P "${A[@]}" --update-freq 2 > "$OUT/ho1_1gpu_uf2.log" 2>&1
echo "ho1 rc=$?"
torchrun --nproc_per_node 2 $P "${A[@]}" --distributed-world-size 2 > "$OUT/ho2_2gpu.log" 2>&1
echo "ho2 rc=$?"
for f in "$OUT"/ho*.log; do echo "== $(basename "$f")"; grep -h "^\[rank" "$f" | cut -c1-200; done
ROUNDS=${ROUNDS:-1}
if [[ "$ROUNDS" -gt 0 ]]; then ROUNDS=$ROUNDS MACHINE_CHECK=0 OUT="$OUT/rounds" bash benchmarks/gpu_scaling_rounds.sh; fi
