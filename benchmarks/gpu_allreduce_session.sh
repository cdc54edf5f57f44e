#!/usr/bin/env bash
# One call on a 2-GPU machine: the gradient all-reduce variants of a grouped 2-GPU run (t2t, 8192
# tokens per GPU, 200 updates) against 1 GPU --update-freq 2 --grouped-shuffling (the same batches),
# then the GPU tests on GPU 0. Logs under $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ls_scaling}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -c "import ls_fairseq._C" 2>/dev/null || python setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
D=${DATA:-.benchdata/wmt_synth}
COMMON=($D --task translation -s src -t tgt --arch ls_transformer_wmt_en_de_big_t2t --share-all-embeddings
  --optimizer ls_adam --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --dropout 0
  --attention-dropout 0 --activation-dropout 0 --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1
  --fp16 --seed 1 --log-format simple --log-interval 20 --num-workers 2 --max-tokens 8192 --disable-validation
  --no-save --max-update 200)
T="python -m ls_fairseq.cli.train"
run() { local name=$1; shift; "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; }
run a1_1gpu_uf2_grouped env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --update-freq 2 --grouped-shuffling
run a2_2gpu_overlap_25mb $T "${COMMON[@]}" --distributed-world-size 2
run a3_2gpu_overlap_100mb $T "${COMMON[@]}" --distributed-world-size 2 --bucket-cap-mb 100
run a4_2gpu_overlap_1000mb $T "${COMMON[@]}" --distributed-world-size 2 --bucket-cap-mb 1000
run a5_2gpu_sync_all_reduce env LS_FAIRSEQ_SYNC_ALL_REDUCE=1 $T "${COMMON[@]}" --distributed-world-size 2
run a6_2gpu_overlap_25mb_simple env NCCL_PROTO=Simple $T "${COMMON[@]}" --distributed-world-size 2
python benchmarks/summarize_train_logs.py "$OUT/a*.log" 60
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  CUDA_VISIBLE_DEVICES=0 timeout 240 python -m pytest -q -m gpu tests/gpu -p no:cacheprovider 2>&1 | tail -4 | tee "$OUT/gpu_tests.log"
fi
