#!/usr/bin/env bash
# One call on a 2-GPU machine: sharded ls_adam with peer writes (the update kernel stores each rank's
# new weights into both GPUs' copies; ls_fairseq/optim/peer.py). First its tests (the kernel's peer
# store on one GPU; the sharded NCCL runs against the whole state), then the scaling runs, interleaved:
#   p1 1 GPU uf2 | p2 2 GPUs whole state | p3 2 GPUs sharded, peer writes | p4 = p1 | p5 = p2 | p6 = p3
# Same flags as gpu_scaling_check.sh (grouped, 200 updates). Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
echo "load before: $(cat /proc/loadavg) cores $(nproc)"
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  python -m pytest -q -m gpu tests/gpu/test_adam_gpu.py -k "${ADAM_K:-peer}" > "$OUT/tests_adam_peer.log" 2>&1
  echo "adam peer tests rc=$? $(tail -1 "$OUT/tests_adam_peer.log")"
  python -m pytest -q -m gpu tests/gpu/test_multi_gpu.py -k "${TEST_K:-sharded and peer_writes}" \
    > "$OUT/tests_multi_gpu_sharded.log" 2>&1
  echo "multi-gpu tests rc=$? $(tail -1 "$OUT/tests_multi_gpu_sharded.log")"
fi
UPD=${UPDATES:-200}
G=(--max-update "$UPD" --grouped-shuffling)
run p1_1gpu_uf2 env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
run p2_2gpu_whole env LS_FAIRSEQ_SHARD_ADAM=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run p3_2gpu_sharded_peer env LS_FAIRSEQ_SHARD_ADAM=1 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run p4_1gpu_uf2_again env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
run p5_2gpu_whole_again env LS_FAIRSEQ_SHARD_ADAM=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run p6_2gpu_sharded_peer_again env LS_FAIRSEQ_SHARD_ADAM=1 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
echo "load after: $(cat /proc/loadavg)"
grep -h "ls_adam: " "$OUT"/p3_*.log | sort | uniq -c | cut -c1-200
python benchmarks/summarize_train_logs.py "$OUT/p*.log" 60 | tee "$OUT/summary.txt"
intervals "$OUT"/p*.log | tee -a "$OUT/summary.txt"
