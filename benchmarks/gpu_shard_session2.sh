#!/usr/bin/env bash
# One call on a 2-GPU machine, after gpu_shard_session.sh: the sharded ls_adam (LS_FAIRSEQ_SHARD_ADAM=1;
# the forward waits for each layer's weights) against the whole state on every rank, interleaved to see drift,
# with the host load logged before and after. Same flags as gpu_shard_session.sh.
#   u1 1 GPU --update-freq 2 | u2 2 GPUs sharded | u3 2 GPUs whole (LS_FAIRSEQ_SHARD_ADAM=0)
#   u4 2 GPUs sharded, LS_FAIRSEQ_GATHER_WAITS=0 | u5 = u2 | u6 = u3
# then the two-GPU tests unless SKIP_TESTS=1. Logs under $OUT.
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
echo "load before: $(cat /proc/loadavg) cores $(nproc)"
UPD=${UPDATES:-200}
export LS_FAIRSEQ_SHARD_ADAM=1  # the sharded runs; the whole-state runs set 0
G=(--max-update "$UPD" --grouped-shuffling)
run u1_1gpu_uf2 env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
run u2_2gpu_sharded $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run u3_2gpu_whole env LS_FAIRSEQ_SHARD_ADAM=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run u4_2gpu_sharded_step_waits env LS_FAIRSEQ_GATHER_WAITS=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run u5_2gpu_sharded_again $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
run u6_2gpu_whole_again env LS_FAIRSEQ_SHARD_ADAM=0 $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2
echo "load after: $(cat /proc/loadavg)"
python benchmarks/summarize_train_logs.py "$OUT/u*.log" 60
intervals "$OUT"/u[2-6]*.log
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  python -m pytest -q -m gpu tests/gpu/test_multi_gpu.py > "$OUT/gpu_multi_tests.log" 2>&1
  echo "tests rc=$? $(tail -1 "$OUT/gpu_multi_tests.log")"
fi
