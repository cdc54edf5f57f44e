#!/usr/bin/env bash
# One call on a 2-GPU machine: where the time of a 2-GPU update goes. LS_FAIRSEQ_STEP_TIMING=1 logs
# the GPU time of each micro-batch's forward+backward; 1 GPU with --update-freq 2 runs the same
# batch pairs that the two ranks of a 2-GPU run get, so "slower of the two" is what a rank-synchronous
# update must wait for. Then the scaling with two micro-batches per GPU (2 GPUs --update-freq 2 vs
# 1 GPU --update-freq 4). Logs under $OUT.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ls_scaling}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=$PWD LS_FAIRSEQ_STEP_TIMING=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -c "import ls_fairseq._C" 2>/dev/null || python setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
D=${DATA:-.benchdata/wmt_synth}
COMMON=($D --task translation -s src -t tgt --arch ls_transformer_wmt_en_de_big_t2t --share-all-embeddings
  --optimizer ls_adam --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --dropout 0
  --attention-dropout 0 --activation-dropout 0 --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1
  --fp16 --seed 1 --log-format simple --log-interval 20 --num-workers 2 --max-tokens 8192 --disable-validation
  --no-save)
T="python -m ls_fairseq.cli.train"
CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --max-update 200 --update-freq 2 > "$OUT/p1_1gpu_uf2_timing.log" 2>&1
echo "1 GPU uf2 rc=$?"
$T "${COMMON[@]}" --max-update 200 --distributed-world-size 2 > "$OUT/p2_2gpu_timing.log" 2>&1
echo "2 GPUs rc=$?"
CUDA_VISIBLE_DEVICES=0 $T "${COMMON[@]}" --max-update 120 --update-freq 4 > "$OUT/p3_1gpu_uf4.log" 2>&1
echo "1 GPU uf4 rc=$?"
$T "${COMMON[@]}" --max-update 120 --distributed-world-size 2 --update-freq 2 > "$OUT/p4_2gpu_uf2.log" 2>&1
echo "2 GPUs uf2 rc=$?"
grep -h "step timing" "$OUT"/p*.log | cut -c1-300
python benchmarks/summarize_train_logs.py "$OUT/p*.log" 40
