# Sourced (from the repository root) by the 2-GPU scaling scripts: output folder, environment,
# the extension build, and the training flags they share: ls_transformer_wmt_en_de_big_t2t,
# ls_adam, fp16, dropout 0 (so the ranks' random streams do not enter the loss comparison),
# --max-tokens ${MAX_TOKENS:-8192} per GPU batch, no validation, no checkpoints.
# Defines: OUT, COMMON (flags without --max-update), T (lightseq-train), run NAME CMD... (log to $OUT/NAME.log),
# intervals LOG... (each log's words/s per train_inner interval).
# Prints benchmarks/machine_check.py's line (also to $OUT/machine.txt).
set -o pipefail
OUT=${OUT:-/tmp/ls_scaling}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MAX_JOBS=32 TORCH_CUDA_ARCH_LIST=9.0 PYTHONPATH=$PWD
# NVLink multicast (NVLS) stays off on the lent 2-GPU machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python -c "import ls_fairseq._C" 2>/dev/null || python setup.py build_ext --inplace > /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
COMMON=(${DATA:-.benchdata/wmt_synth} --task translation -s src -t tgt --arch ls_transformer_wmt_en_de_big_t2t
  --share-all-embeddings --optimizer ls_adam --lr 5e-4 --lr-scheduler inverse_sqrt --warmup-updates 4000 --dropout 0
  --attention-dropout 0 --activation-dropout 0 --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1
  --fp16 --seed 1 --log-format simple --log-interval 20 --num-workers 2 --max-tokens "${MAX_TOKENS:-8192}"
  --disable-validation --no-save)
T="python -m ls_fairseq.cli.train"
run() { local name=$1; shift; "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$?"; }
# one line per log: its name and the words/s of every train_inner interval
intervals() {
  local f
  for f in "$@"; do echo "$(basename "$f") $(grep train_inner "$f" | grep -o 'wps=[0-9]*' | tr '\n' ' ')"; done
}
# with LS_FAIRSEQ_STEP_TIMING=1: every rank's timing lines (GPU ms, host ms; medians), named by their log
timing_lines() {
  local f
  for f in "$@"; do
    grep -h "step timing\|host ms per update" "$f" \
      | sed -E -e "s/^.*(rank [0-9]+ (step timing|host ms per update))/$(basename "$f" .log) \1/"
  done
}
# how fast the host and GPUs are right now (MACHINE_CHECK=0 skips it): the lent machines vary a lot
if [[ "${MACHINE_CHECK:-1}" == 1 ]]; then python benchmarks/machine_check.py 2>&1 | tee -a "$OUT/machine.txt"; fi
