#!/usr/bin/env bash
# A standard session on a GPU machine: build, GPU tests, op benchmark, attention benchmark, training benchmark.
#
#   bash benchmarks/gpu_session.sh                      # everything (about 15 minutes on one H100)
#   STEPS="build tests" bash benchmarks/gpu_session.sh  # a subset: build tests ops attention train
#   STEPS="build fp8 profile" bash benchmarks/gpu_session.sh  # optional steps: --fp8 against bf16 (per projection
#                                                             # and training), the graphed step's kernel profile
#
# Knobs: OUT (logs, default ./gpu_session_logs), DATA (training corpus, made by make_wmt_synth.py when absent),
# MAX_TOKENS (default 4096,8192), KINDS (default native,ls_eager,ls), EPOCHS (default 2), TESTS (pytest's
# arguments for the tests step, default tests/gpu; e.g. TESTS="tests/gpu -k 'not multi_gpu'" to split the suite),
# PROFILE_TOKENS (the profile step's --max-tokens, default 8192; it profiles bf16, then bf16 with --fp8).
# The last lines of each step's log are printed; whole logs stay under $OUT.
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
