#!/usr/bin/env bash
# Short call on a 2-GPU machine: a 2-GPU checkpoint resumed on 2 GPUs (the path that needs the
# distributed checkpoint-broadcast fix in fairseq_ext/compat.py), and a 1-GPU run of the same
# updates for a throughput comparison; LEGACY_DDP=1 adds a 2-GPU run with --ddp-backend legacy_ddp
# (ls_adam's flat all-reduce). Logs under $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ls_resume}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -c "import ls_fairseq._C" 2>/dev/null || python setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
D=${DATA:-.benchdata/wmt_synth}
COMMON=($D --task translation -s src -t tgt --arch ls_transformer_wmt_en_de_big_t2t --share-all-embeddings
  --optimizer ls_adam --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000
  --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1 --fp16 --seed 1
  --log-format simple --log-interval 20 --num-workers 2 --max-tokens 8192 --disable-validation)
T="python -m ls_fairseq.cli.train"
$T "${COMMON[@]}" --distributed-world-size 2 --max-update 60 --save-dir /tmp/ckr > "$OUT/r1_2gpu_60.log" 2>&1
echo "2-GPU first part rc=$?"
$T "${COMMON[@]}" --distributed-world-size 2 --max-update 160 --save-dir /tmp/ckr > "$OUT/r2_2gpu_resume_160.log" 2>&1
echo "2-GPU resume rc=$?"
CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --max-update 100 --no-save --save-dir /tmp/ck1 > "$OUT/r3_1gpu_100.log" 2>&1
echo "1-GPU rc=$?"
if [[ "${LEGACY_DDP:-0}" == 1 ]]; then  # ls_adam's one-collective flat all-reduce (fairseq's legacy DDP wrapper)
  $T "${COMMON[@]}" --distributed-world-size 2 --ddp-backend legacy_ddp --max-update 160 --no-save \
    --save-dir /tmp/ckl > "$OUT/r4_2gpu_legacy_ddp_160.log" 2>&1
  echo "2-GPU legacy_ddp rc=$?"
fi
for f in "$OUT"/r*.log; do echo "== $f"; grep -E "loaded checkpoint|train_inner|Error|error" "$f" | cut -c1-260 | tail -8; done
