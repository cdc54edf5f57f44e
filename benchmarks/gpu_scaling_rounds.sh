#!/usr/bin/env bash
# One call on a 2-GPU machine: ROUNDS (default 3) rounds of the scaling pair, each pair on the same
# batches (grouped): 1 GPU with --update-freq 2, then 2 GPUs. 2-GPU runs get TWO_ENV (e.g.
# "LS_FAIRSEQ_SHARD_ADAM=1"). UPDATES (default 120) each; words/s after update AFTER (default 40).
# Prints each pair's ratio and the median over the rounds (benchmarks/scaling_pairs.py), with the
# machine check before and after. Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
G=(--max-update "${UPDATES:-120}" --grouped-shuffling)
pairs=()
for k in $(seq 1 "${ROUNDS:-3}"); do
  run "r${k}a_1gpu_uf2" env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
  run "r${k}b_2gpu" env ${TWO_ENV:-} $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
  pairs+=("$OUT/r${k}a_1gpu_uf2.log" "$OUT/r${k}b_2gpu.log")
done
python benchmarks/machine_check.py 2>&1 | tee -a "$OUT/machine.txt"
python benchmarks/scaling_pairs.py "${AFTER:-40}" "${pairs[@]}" | tee "$OUT/pairs.txt"
