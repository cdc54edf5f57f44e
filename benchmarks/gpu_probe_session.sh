#!/usr/bin/env bash
# One device call: build, GPU tests, then host_probe (ms per step, host vs GPU per phase, cProfile)
# and profile_step (top kernels) of ls_transformer_wmt_en_de_big_t2t on the synthetic corpus.
# Usage on the GPU machine: bash benchmarks/gpu_probe_session.sh [max-tokens list, default "4096 8192"]
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ls_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
if ! python -c "import ls_fairseq._C" 2>/dev/null; then
  ( time python setup.py build_ext --inplace ) > /tmp/build.log 2>&1 || { tail -40 /tmp/build.log; exit 1; }
  tail -3 /tmp/build.log
fi
[[ -d .benchdata/wmt_synth ]] || python benchmarks/make_wmt_synth.py --out .benchdata/wmt_synth > /dev/null
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  timeout "${TEST_TIMEOUT:-300}" python -m pytest -q -m gpu tests/gpu -p no:cacheprovider -q 2>&1 | tail -40 > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log"
fi
FLAGS=(.benchdata/wmt_synth --task translation -s src -t tgt --share-all-embeddings --fp16
  --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --label-smoothing 0.1 --num-workers 0
  --optimizer ls_adam --criterion ls_label_smoothed_cross_entropy
  --arch ls_transformer_wmt_en_de_big_t2t)
for mt in ${1:-4096 8192}; do
  extra=(); [[ "$mt" != 4096 ]] && extra=(--skip-cprofile)
  python benchmarks/host_probe.py "${FLAGS[@]}" --max-tokens "$mt" --batches 12 "${extra[@]}" 2>&1 \
    | grep -v -i warning > "$OUT/host_probe_ls_$mt.log"
  grep -E "^(STEP|PHASE)" "$OUT/host_probe_ls_$mt.log"
done
if [[ "${SKIP_PROFILE:-0}" != 1 ]]; then
  python benchmarks/profile_step.py "${FLAGS[@]}" --max-tokens 8192 --batches 12 --top 40 2>&1 \
    | grep -v -i warning > "$OUT/profile_ls_8192.log"
  head -3 "$OUT/profile_ls_8192.log"
fi
ls "$OUT"
