#!/usr/bin/env bash
# A standard session on a GPU machine: build, GPU tests, op benchmark, attention benchmark, training benchmark.
#
#   bash benchmarks/gpu_session.sh                      # the default steps: build tests ops attention train
#   STEPS="build tests" bash benchmarks/gpu_session.sh  # a subset
#   STEPS="build fp8 profile" bash benchmarks/gpu_session.sh  # optional steps: --fp8 against bf16 (per projection
#                                                             # and training), the graphed step's kernel profile
#   STEPS=scaling bash benchmarks/gpu_session.sh        # optional, two GPUs: scaling rounds (below)
#   STEPS="build entries paths" bash benchmarks/gpu_session.sh  # optional: lightseq-train against fairseq-train
#                                # --user-dir and lightseq-deepspeed (fp16 and bf16); the ops' execution paths
#                                # against each other, graphed and eager (bf16; docs/op_paths.md)
#
# Knobs: OUT (logs, default ./gpu_session_logs), DATA (training corpus, made by make_wmt_synth.py when absent),
# MAX_TOKENS (default 4096,8192), KINDS (default native,ls_eager,ls), EPOCHS (default 2), TESTS (pytest's
# arguments for the tests step, default tests/gpu; e.g. TESTS="tests/gpu -k 'not multi_gpu'" to split the suite),
# PROFILE_TOKENS (the profile step's --max-tokens, default 8192; it profiles bf16, then bf16 with --fp8).
# The last lines of each step's log are printed; whole logs stay under $OUT.
#
# The scaling step: ROUNDS (default 3) rounds, each on the same grouped batches: 1 GPU with --update-freq 2, then
# one 2-GPU run per variant; UPDATES (default 120) updates each, words/s after update AFTER (default 40);
# ls_transformer_wmt_en_de_big_t2t, ls_adam, fp16, dropout 0 (the ranks' random streams stay out of the loss
# comparison), SCALING_TOKENS (default 8192) per GPU batch, no validation, no checkpoints. Prints each variant's
# ratio to its round's 1-GPU run and their median (scaling_tools.py pairs), the ratios between the first variant
# and each other one, and the machine check before and after. Logs under $OUT/scaling.
#   VARIANTS: space-separated NAME=ENV, ENV a comma-separated list of assignments for the 2-GPU run or "-", e.g.
#             VARIANTS="whole=--ls-shard-state=off sharded=--ls-shard-state=on"; an item that starts with --
#             is a training flag (--bucket-cap-mb=100), any other an assignment (NCCL_ALGO=Ring). Default: one
#             variant "2gpu" with TWO_ENV.
#   PROBE=1:  first, scaling_tools.py host-probe on GPU 0 (12 batches): host and GPU ms of the forward, backward
#             and optimizer step into machine.txt; where a step's host ms come close to its GPU ms, the 2-GPU runs
#             (one micro-batch per update) are host-bound on this machine.
#   LS_FAIRSEQ_STEP_TIMING=1 (exported): every run logs its GPU and host time per update; collected at the end.
#   PACK_TO:  a folder that receives logs.tgz (every log) and pairs.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_session_logs}"
DATA="${DATA:-/tmp/wmt_synth}"
STEPS="${STEPS:-build tests ops attention train}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { [[ " $STEPS " == *" $1 "* ]]; }
# the training corpus, made when absent
corpus() { [[ -f "$DATA/dict.src.txt" ]] || python benchmarks/make_wmt_synth.py "$DATA" > /dev/null; }
# train_bench NAME KINDS [bench_train.py flags]: bench_train.py over MAX_TOKENS into $OUT/NAME (summary in
# $OUT/bench_NAME.log); prints its table and the runs' step timings
train_bench() {
  local name=$1 kinds=$2
  shift 2
  corpus
  LS_FAIRSEQ_STEP_TIMING=1 python benchmarks/bench_train.py --out "$OUT/$name" --data "$DATA" \
    --archs transformer_wmt_en_de_big_t2t --max-tokens "${MAX_TOKENS:-4096,8192}" --kinds "$kinds" \
    --epochs "${EPOCHS:-2}" "$@" 2>&1 | tee "$OUT/bench_$name.log" | grep -E "RATIO|^\|"
  grep -h "step timing\|CUDA-graph step:" "$OUT/$name"/*.log | cut -c1-300
}

# scaling: the 2-GPU rounds described above, logs under $OUT/scaling
scaling() {
  local S="$OUT/scaling" k v name assignments item
  mkdir -p "$S"
  # NVLink multicast (NVLS) stays off on the lent 2-GPU machines
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 LS_FAIRSEQ_STEP_TIMING=1
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  python -c "import ls_fairseq._C" 2>/dev/null || python setup.py build_ext --inplace > "$S/build.log" 2>&1 \
    || { tail -30 "$S/build.log"; return 1; }
  corpus
  local common=("$DATA" --task translation -s src -t tgt --arch ls_transformer_wmt_en_de_big_t2t
    --share-all-embeddings --optimizer ls_adam --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000
    --dropout 0 --attention-dropout 0 --activation-dropout 0 --criterion ls_label_smoothed_cross_entropy
    --label-smoothing 0.1 --fp16 --seed 1 --log-format simple --log-interval 20 --num-workers 2
    --max-tokens "${SCALING_TOKENS:-8192}" --disable-validation --no-save)
  local train=(python -m ls_fairseq.cli.train) rounds=(--max-update "${UPDATES:-120}" --grouped-shuffling)
  local variants names=()
  read -r -a variants <<< "${VARIANTS:-2gpu=${TWO_ENV:--}}"
  for v in "${variants[@]}"; do names+=("${v%%=*}"); done
  python benchmarks/scaling_tools.py machine 2>&1 | tee -a "$S/machine.txt"
  if [[ "${PROBE:-0}" == 1 ]]; then
    CUDA_VISIBLE_DEVICES=0 python benchmarks/scaling_tools.py host-probe "${common[@]}" --batches 12 \
      --skip-cprofile 2>&1 | grep -E "^(STEP|PHASE)" | tee -a "$S/machine.txt"
  fi
  run() { local n=$1; shift; "$@" > "$S/$n.log" 2>&1; echo "$n rc=$?"; }
  for k in $(seq 1 "${ROUNDS:-3}"); do
    run "r${k}a_1gpu_uf2" env CUDA_VISIBLE_DEVICES=0 "${train[@]}" "${common[@]}" "${rounds[@]}" --update-freq 2
    for v in "${variants[@]}"; do
      name=${v%%=*} assignments=${v#*=}
      [[ "$assignments" == "-" ]] && assignments=""
      local envs=() args=()
      for item in ${assignments//,/ }; do
        if [[ "$item" == --* ]]; then args+=("$item"); else envs+=("$item"); fi
      done
      run "r${k}b_${name}" env "${envs[@]}" "${train[@]}" "${common[@]}" "${rounds[@]}" \
        --distributed-world-size 2 "${args[@]}"
    done
  done
  python benchmarks/scaling_tools.py machine 2>&1 | tee -a "$S/machine.txt"
  : > "$S/pairs.txt"
  # ratios TITLE LEFT RIGHT: each round's RIGHT log over its LEFT log (names with @ for the round number)
  ratios() {
    local logs=() r
    for r in $(seq 1 "${ROUNDS:-3}"); do logs+=("$S/${2//@/$r}.log" "$S/${3//@/$r}.log"); done
    echo "== $1" | tee -a "$S/pairs.txt"
    python benchmarks/scaling_tools.py pairs "${AFTER:-40}" "${logs[@]}" | tee -a "$S/pairs.txt"
  }
  for name in "${names[@]}"; do ratios "${name} vs 1 GPU --update-freq 2" "r@a_1gpu_uf2" "r@b_${name}"; done
  for name in "${names[@]:1}"; do ratios "${name} vs ${names[0]}" "r@b_${names[0]}" "r@b_${name}"; done
  local f
  for f in "$S"/r*.log; do  # each log's words/s per train_inner interval, then every rank's timing lines
    echo "$(basename "$f") $(grep train_inner "$f" | grep -o 'wps=[0-9]*' | tr '\n' ' ')"
  done | tee -a "$S/pairs.txt"
  for f in "$S"/r*.log; do
    grep -h "step timing\|host ms per update" "$f" \
      | sed -E -e "s/^.*(rank [0-9]+ (step timing|host ms per update))/$(basename "$f" .log) \1/"
  done | tee -a "$S/pairs.txt"
  if [[ -n "${PACK_TO:-}" ]]; then
    mkdir -p "$PACK_TO" && tar czf "$PACK_TO/logs.tgz" -C "$S" . && cp "$S/pairs.txt" "$PACK_TO/"
  fi
}

if step build; then
  (time python setup.py build_ext --inplace) > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  tail -3 "$OUT/build.log"
  python -m ls_fairseq.info | tee "$OUT/info.log" | sed -n '1,8p'
fi
if step tests; then
  eval "python -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/gpu}" 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
fi
if step ops; then
  python benchmarks/bench_ops.py --tokens 8192 4096 2>&1 | tee "$OUT/bench_ops.log" | tail -25
fi
if step attention; then
  python benchmarks/bench_attention.py 2>&1 | tee "$OUT/bench_attention.log" | tail -26
fi
if step train; then
  train_bench train "${KINDS:-native,ls_eager,ls}"
fi
if step entries; then
  train_bench entries ls,ls_fairseq_train,ls_deepspeed --precision fp16
  train_bench entries_bf16 ls,ls_fairseq_train --precision bf16
fi
if step paths; then
  MAX_TOKENS="${MAX_TOKENS:-4096}" train_bench paths \
    ls,ls_py_layers,ls_py_ops,ls_eager,ls_eager_py_layers,ls_eager_py_ops --precision bf16
fi
if step fp8; then
  python benchmarks/bench_ops.py --fp8 --tokens 8192 4096 2>&1 | tee "$OUT/bench_ops_fp8.log" | grep -E "^\||saves"
  train_bench train_fp8 ls,ls_fp8 --precision bf16
fi
if step profile; then
  corpus
  for extra in "" "--fp8"; do
    python benchmarks/profile_step.py "$DATA" --user-dir ls_fairseq --task translation \
      --arch ls_transformer_wmt_en_de_big_t2t --share-all-embeddings --optimizer ls_adam \
      --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1 --lr 5e-4 --lr-scheduler inverse_sqrt \
      --warmup-updates 4000 --adam-betas "(0.9,0.98)" --max-tokens "${PROFILE_TOKENS:-8192}" --bf16 \
      --ls-graph-step on --batches 16 --top 40 $extra > "$OUT/profile_bf16${extra/--/_}.log" 2>&1
    grep -A25 "^PROFILE" "$OUT/profile_bf16${extra/--/_}.log" | cut -c1-160
  done
fi
if step scaling; then
  scaling
fi
