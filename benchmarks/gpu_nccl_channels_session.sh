#!/usr/bin/env bash
# One call on a 2-GPU machine: does limiting NCCL to a few channels (fewer SMs taken from the
# backward pass while the overlapped all-reduce runs) help a 2-GPU update? t2t, 8192 tokens per GPU,
# grouped shuffling, against 1 GPU --update-freq 2 --grouped-shuffling (the same batches). Logs under $OUT.
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
  --no-save --max-update ${UPDATES:-160} --grouped-shuffling)
T="python -m ls_fairseq.cli.train"
run() { local name=$1; shift; "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; }
run c1_1gpu_uf2 env CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --update-freq 2
run c2_2gpu_default $T "${COMMON[@]}" --distributed-world-size 2
run c3_2gpu_nccl_4ch env NCCL_MAX_NCHANNELS=4 NCCL_MAX_CTAS=4 $T "${COMMON[@]}" --distributed-world-size 2
run c4_2gpu_nccl_8ch env NCCL_MAX_NCHANNELS=8 NCCL_MAX_CTAS=8 $T "${COMMON[@]}" --distributed-world-size 2
python benchmarks/summarize_train_logs.py "$OUT/c*.log" 60
