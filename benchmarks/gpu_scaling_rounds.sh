#!/usr/bin/env bash
# One call on a 2-GPU machine: ROUNDS (default 3) rounds, each on the same batches (grouped): 1 GPU with
# --update-freq 2, then one 2-GPU run per variant. UPDATES (default 120) each; words/s after update AFTER
# (default 40). Prints each variant's ratios to its round's 1-GPU run and their median
# (benchmarks/scaling_pairs.py), the ratios between the first variant and each other one, and the machine
# check before and after. Logs under $OUT.
#   VARIANTS: space-separated NAME=ENV, ENV a comma-separated list of assignments for the 2-GPU run or "-",
#             e.g. VARIANTS="whole=LS_FAIRSEQ_SHARD_ADAM=0 sharded=LS_FAIRSEQ_SHARD_ADAM=1"; an item that starts
#             with -- is a training flag instead (--bucket-cap-mb=100).
#             Default: one variant "2gpu" with TWO_ENV (e.g. TWO_ENV=LS_FAIRSEQ_SHARD_ADAM=1).
#   PROBE=1:  first, benchmarks/host_probe.py on GPU 0 (t2t, 8192 tokens, 12 batches): host and GPU ms of the
#             forward, backward and optimizer step, into machine.txt. Where the host ms of a step come close
#             to its GPU ms, the 2-GPU runs (one micro-batch per update) are host-bound on this machine.
#   LS_FAIRSEQ_STEP_TIMING=1 (exported): every run logs its GPU time per update, per micro-batch, after the
#             last backward and between updates, and the host time of each part of the step (medians, each
#             rank); the lines are collected at the end.
#   PACK_TO:  a folder that receives logs.tgz (every log) and pairs.txt: a device call that may bring back
#             only a few files sets OUT to a scratch folder and PACK_TO to its own output folder, in this
#             order: PACK_TO=$OUT OUT=/tmp/rounds bash benchmarks/gpu_scaling_rounds.sh
cd "$(dirname "$0")/.."
source benchmarks/multi_gpu_common.sh
G=(--max-update "${UPDATES:-120}" --grouped-shuffling)
read -r -a variants <<< "${VARIANTS:-2gpu=${TWO_ENV:--}}"
names=()
for v in "${variants[@]}"; do names+=("${v%%=*}"); done
if [[ "${PROBE:-0}" == 1 ]]; then
  CUDA_VISIBLE_DEVICES=0 python benchmarks/host_probe.py "${COMMON[@]}" --batches 12 --skip-cprofile 2>&1 \
    | grep -E "^(STEP|PHASE)" | tee -a "$OUT/machine.txt"
fi
for k in $(seq 1 "${ROUNDS:-3}"); do
  run "r${k}a_1gpu_uf2" env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" "${G[@]}" --update-freq 2
  for v in "${variants[@]}"; do
    name=${v%%=*} assignments=${v#*=}
    [[ "$assignments" == "-" ]] && assignments=""
    envs=() args=()
    for item in ${assignments//,/ }; do
      if [[ "$item" == --* ]]; then args+=("$item"); else envs+=("$item"); fi
    done
    run "r${k}b_${name}" env "${envs[@]}" $T "${COMMON[@]}" "${G[@]}" --distributed-world-size 2 "${args[@]}"
  done
done
python benchmarks/machine_check.py 2>&1 | tee -a "$OUT/machine.txt"
: > "$OUT/pairs.txt"
# ratios TITLE LEFT RIGHT: each round's RIGHT log over its LEFT log (names with @ for the round number)
ratios() {
  local logs=() k
  for k in $(seq 1 "${ROUNDS:-3}"); do logs+=("$OUT/${2//@/$k}.log" "$OUT/${3//@/$k}.log"); done
  echo "== $1" | tee -a "$OUT/pairs.txt"
  python benchmarks/scaling_pairs.py "${AFTER:-40}" "${logs[@]}" | tee -a "$OUT/pairs.txt"
}
for name in "${names[@]}"; do ratios "${name} vs 1 GPU --update-freq 2" "r@a_1gpu_uf2" "r@b_${name}"; done
for name in "${names[@]:1}"; do ratios "${name} vs ${names[0]}" "r@b_${names[0]}" "r@b_${name}"; done
intervals "$OUT"/r*.log | tee -a "$OUT/pairs.txt"
timing_lines "$OUT"/r*.log | tee -a "$OUT/pairs.txt"
if [[ -n "${PACK_TO:-}" ]]; then
  mkdir -p "$PACK_TO" && tar czf "$PACK_TO/logs.tgz" -C "$OUT" . && cp "$OUT/pairs.txt" "$PACK_TO/"
fi
