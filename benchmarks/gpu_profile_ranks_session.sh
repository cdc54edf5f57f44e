#!/usr/bin/env bash
# One call on a 2-GPU machine: torch.profiler timelines of 30 updates on every rank
# (benchmarks/profile_ranks.py): 1 GPU --update-freq 2 --grouped-shuffling, 2 GPUs (default:
# grouped, overlapped all-reduce), 2 GPUs with the all-reduce after the backward. Logs under $OUT.
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
  --no-save --max-update 155)
P="benchmarks/profile_ranks.py --profile-updates 120:30"
CUDA_VISIBLE_DEVICES=0 python $P "${COMMON[@]}" --update-freq 2 --grouped-shuffling > "$OUT/pr1_1gpu_uf2.log" 2>&1
echo "pr1 rc=$?"
CUDA_VISIBLE_DEVICES=0 python $P "${COMMON[@]}" > "$OUT/pr0_1gpu_uf1.log" 2>&1
echo "pr0 rc=$?"
torchrun --nproc_per_node 2 $P "${COMMON[@]}" --distributed-world-size 2 > "$OUT/pr2_2gpu.log" 2>&1
echo "pr2 rc=$?"
LS_FAIRSEQ_SYNC_ALL_REDUCE=1 torchrun --nproc_per_node 2 $P "${COMMON[@]}" --distributed-world-size 2 \
  > "$OUT/pr3_2gpu_sync_all_reduce.log" 2>&1
echo "pr3 rc=$?"
for f in "$OUT"/pr*.log; do echo "== $(basename "$f")"; grep -h "^\[rank" "$f" | grep -v "calls  " | cut -c1-220; done
