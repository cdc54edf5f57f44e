#!/usr/bin/env bash
# One call on a 2-GPU machine: throughput scaling and loss agreement of lightseq-train on 2 GPUs
# (its default for ls_adam: --ddp-backend legacy_ddp with the flat gradient all-reduce overlapped
# with the backward; the same with the all-reduce after the backward; fairseq's c10d DDP) against
# 1 GPU with --update-freq 2 (the same global batch per update).
# Dropout 0 so that the ranks' random streams do not matter for the loss comparison. Logs under $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ls_scaling}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -c "import ls_fairseq._C" 2>/dev/null || python setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
D=${DATA:-.benchdata/wmt_synth}
UPD=${UPDATES:-200}
COMMON=($D --task translation -s src -t tgt --arch ls_transformer_wmt_en_de_big_t2t --share-all-embeddings
  --optimizer ls_adam --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --dropout 0
  --attention-dropout 0 --activation-dropout 0 --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1
  --fp16 --seed 1 --log-format simple --log-interval 20 --num-workers 2 --max-tokens 8192 --disable-validation
  --no-save --max-update "$UPD")
T="python -m ls_fairseq.cli.train"
CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --update-freq 2 --save-dir /tmp/s1 > "$OUT/s1_1gpu_uf2.log" 2>&1
echo "1 GPU update-freq 2 rc=$?"
# lightseq-train's default for ls_adam on several GPUs: legacy_ddp, all-reduce overlapped with the backward
$T "${COMMON[@]}" --distributed-world-size 2 --save-dir /tmp/s2 > "$OUT/s2_2gpu_default_overlap.log" 2>&1
echo "2 GPUs default (legacy_ddp, overlapped all-reduce) rc=$?"
LS_FAIRSEQ_SYNC_ALL_REDUCE=1 $T "${COMMON[@]}" --distributed-world-size 2 --save-dir /tmp/s3 \
  > "$OUT/s3_2gpu_legacy_sync_all_reduce.log" 2>&1
echo "2 GPUs legacy_ddp, all-reduce after the backward rc=$?"
if [[ "${SKIP_C10D:-0}" != 1 ]]; then
  $T "${COMMON[@]}" --distributed-world-size 2 --ddp-backend c10d --save-dir /tmp/s4 > "$OUT/s4_2gpu_c10d.log" 2>&1
  echo "2 GPUs c10d rc=$?"
fi
grep -h -m1 -E "legacy_ddp|ddp.backend|overlap" "$OUT"/s2_*.log | cut -c1-250
python benchmarks/summarize_train_logs.py "$OUT/s*.log" 60
