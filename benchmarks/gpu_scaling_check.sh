#!/usr/bin/env bash
# One call on a 2-GPU machine: the scaling pair (1 GPU --update-freq 2 vs 2 GPUs) with the whole
# ls_adam state on every rank and with the sharded state (LS_FAIRSEQ_SHARD_ADAM=1, the forward waits
# for each layer's all-gathered weights), interleaved, and 1 GPU --update-freq 1 (the same per-GPU
# batch without the second micro-batch). All grouped, same flags as gpu_shard_session.sh.
#   t1 1 GPU uf2 | t2 2 GPUs whole | t3 2 GPUs sharded | t4 1 GPU uf1 | t5 = t2 | t6 = t3
# EXTRA_ENV (e.g. "NCCL_MIN_NCHANNELS=32") is added to every 2-GPU run. Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
echo "load before: $(cat /proc/loadavg) cores $(nproc)"
UPD=${UPDATES:-200}
G=(--max-update "$UPD" --grouped-shuffling)
E=(env ${EXTRA_ENV:-})
run t1_1gpu_uf2 env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
run t2_2gpu_whole "${E[@]}" LS_FAIRSEQ_SHARD_ADAM=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run t3_2gpu_sharded "${E[@]}" LS_FAIRSEQ_SHARD_ADAM=1 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run t4_1gpu_uf1 env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}"
run t5_2gpu_whole_again "${E[@]}" LS_FAIRSEQ_SHARD_ADAM=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run t6_2gpu_sharded_again "${E[@]}" LS_FAIRSEQ_SHARD_ADAM=1 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
echo "load after: $(cat /proc/loadavg)"
python benchmarks/summarize_train_logs.py "$OUT/t*.log" 60 | tee "$OUT/summary.txt"
intervals "$OUT"/t*.log | tee -a "$OUT/summary.txt"
