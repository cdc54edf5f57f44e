#!/usr/bin/env bash
# A standard session on a GPU machine: build, GPU tests, op benchmark, attention benchmark, training benchmark.
#
#   bash benchmarks/gpu_session.sh                      # everything (about 15 minutes on one H100)
#   STEPS="build tests" bash benchmarks/gpu_session.sh  # a subset: build tests ops attention train
#
# Knobs: OUT (logs, default ./gpu_session_logs), DATA (training corpus, made by make_wmt_synth.py when absent),
# MAX_TOKENS (default 4096,8192), KINDS (default native,ls_eager,ls), EPOCHS (default 2), TESTS (pytest's
# arguments for the tests step, default tests/gpu; e.g. TESTS="tests/gpu -k 'not multi_gpu'" to split the suite).
# The last lines of each step's log are printed; whole logs stay under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_session_logs}"
DATA="${DATA:-/tmp/wmt_synth}"
STEPS="${STEPS:-build tests ops attention train}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { [[ " $STEPS " == *" $1 "* ]]; }

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
  [[ -f "$DATA/dict.src.txt" ]] || python benchmarks/make_wmt_synth.py "$DATA" > /dev/null
  LS_FAIRSEQ_STEP_TIMING=1 python benchmarks/bench_train.py --out "$OUT/train" --data "$DATA" \
    --archs transformer_wmt_en_de_big_t2t --max-tokens "${MAX_TOKENS:-4096,8192}" \
    --kinds "${KINDS:-native,ls_eager,ls}" --epochs "${EPOCHS:-2}" 2>&1 | tee "$OUT/bench_train.log" | grep -E "RATIO|^\|"
  grep -h "step timing\|CUDA-graph step:" "$OUT"/train/*.log | cut -c1-300
fi
