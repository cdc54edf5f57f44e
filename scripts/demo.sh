#!/usr/bin/env bash
# The ls_fairseq demo: learn a small invented language on the CPU in a few minutes.
#
#   bash scripts/demo.sh                 # everything under ./demo_work
#   WORK=/tmp/demo bash scripts/demo.sh  # somewhere else
#
# 1. scripts/make_toy_corpus.py writes a synthetic English -> "Toy" corpus (new vocabulary,
#    subject-object-verb order, adjectives after nouns, gender/number agreement);
# 2. fairseq-preprocess binarizes it with one joined dictionary;
# 3. lightseq-train trains ls_transformer_tiny with ls_adam and the
#    ls_label_smoothed_cross_entropy criterion (the fused ops run their PyTorch references on
#    the CPU; on a GPU with the extension built, the same command runs the CUDA kernels);
# 4. lightseq-generate translates the test set with beam 4 and reports sacreBLEU.
#
# Knobs (environment): WORK, EPOCHS (default 30), MAX_MINUTES (training time cap, default 4.5),
# DEVICE_FLAGS (default --cpu), TRAIN_PAIRS (default 6000), EXTRA_TRAIN_FLAGS.
# Re-running starts training afresh (the corpus and binarized data are reused when present).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
WORK="${WORK:-$PWD/demo_work}"
EPOCHS="${EPOCHS:-30}"
MAX_MINUTES="${MAX_MINUTES:-4.5}"
DEVICE_FLAGS="${DEVICE_FLAGS:---cpu}"
TRAIN_PAIRS="${TRAIN_PAIRS:-6000}"
EXTRA_TRAIN_FLAGS="${EXTRA_TRAIN_FLAGS:-}"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python
# The toy model is tiny: more CPU threads than one only add synchronisation, and on a machine whose
# cores are busy with other work torch's default (every core) slows training many times over.
if [[ "$DEVICE_FLAGS" == *--cpu* ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
fi

RAW="$WORK/raw"
BIN="$WORK/data-bin"
CKPT="$WORK/checkpoints"
GEN="$WORK/generate-test.txt"

for cmd in fairseq-preprocess lightseq-train lightseq-generate; do
  command -v "$cmd" >/dev/null || { echo "demo: '$cmd' not found; run scripts/setup.sh first" >&2; exit 1; }
done
mkdir -p "$WORK"
start=$SECONDS
stamp() { echo; echo "=== [$((SECONDS - start)) s] $*"; }

stamp "1/4 toy corpus -> $RAW"
if [[ -s "$RAW/test.tgt" && -f "$RAW/.pairs" && "$(cat "$RAW/.pairs")" == "$TRAIN_PAIRS" ]]; then
  echo "reusing $RAW"
else
  "$PY" "$REPO/scripts/make_toy_corpus.py" --out "$RAW" --train "$TRAIN_PAIRS" --valid 400 --test 500
  echo "$TRAIN_PAIRS" > "$RAW/.pairs"
  rm -rf "$BIN"
fi
echo "example:"
echo "  src: $(head -n 1 "$RAW/test.src")"
echo "  tgt: $(head -n 1 "$RAW/test.tgt")"

stamp "2/4 fairseq-preprocess -> $BIN"
if [[ -s "$BIN/test.src-tgt.tgt.bin" ]]; then
  echo "reusing $BIN"
else
  fairseq-preprocess --source-lang src --target-lang tgt \
    --trainpref "$RAW/train" --validpref "$RAW/valid" --testpref "$RAW/test" \
    --destdir "$BIN" --joined-dictionary --workers 2 2>&1 | grep -E "Dictionary|sents" || true
fi

stamp "3/4 lightseq-train (ls_transformer_tiny, ls_adam, ls_label_smoothed_cross_entropy; $EPOCHS epochs, at most $MAX_MINUTES min)"
rm -rf "$CKPT"
stop_hours="$("$PY" -c "print(float('$MAX_MINUTES') / 60)")"
# shellcheck disable=SC2086  # DEVICE_FLAGS / EXTRA_TRAIN_FLAGS are lists of flags
PYTHONUNBUFFERED=1 lightseq-train "$BIN" $DEVICE_FLAGS \
  --arch ls_transformer_tiny --share-all-embeddings \
  --optimizer ls_adam --adam-betas '(0.9, 0.98)' --clip-norm 1.0 \
  --lr 2e-3 --lr-scheduler inverse_sqrt --warmup-updates 200 \
  --criterion ls_label_smoothed_cross_entropy --label-smoothing 0.1 \
  --dropout 0.1 --max-tokens 2048 --max-epoch "$EPOCHS" --stop-time-hours "$stop_hours" \
  --save-dir "$CKPT" --no-epoch-checkpoints --seed 1 --num-workers 0 \
  --log-format simple --log-interval 25 $EXTRA_TRAIN_FLAGS \
  2>&1 | tee "$WORK/train.log" | grep --line-buffered -E "train_inner|\| valid \||done training|Error" || true
[[ -s "$CKPT/checkpoint_best.pt" ]] || {
  echo "demo: training did not write $CKPT/checkpoint_best.pt; the end of $WORK/train.log:" >&2
  tail -n 20 "$WORK/train.log" >&2
  exit 1
}
epochs_done="$(grep -oE "end of epoch [0-9]+" "$WORK/train.log" | tail -n 1 | grep -oE "[0-9]+$" || echo 0)"
echo "epochs completed: $epochs_done of $EPOCHS"
if ((epochs_done < EPOCHS)) && grep -q "stop_time_hours\|cumulative_training_time" "$WORK/train.log"; then
  echo "demo: NOTE: the time cap of $MAX_MINUTES min stopped training after $epochs_done of $EPOCHS epochs, so the BLEU" \
       "below is that of an unfinished model. Rerun with more time (MAX_MINUTES=15 bash scripts/demo.sh) or on a less busy machine."
fi

stamp "4/4 lightseq-generate test set, beam 4"
# shellcheck disable=SC2086
lightseq-generate "$BIN" $DEVICE_FLAGS --path "$CKPT/checkpoint_best.pt" --gen-subset test \
  --beam 4 --batch-size 128 --scoring sacrebleu > "$GEN" 2>&1 || { tail -n 20 "$GEN" >&2; exit 1; }
grep -E "^H-" "$GEN" | sort -t- -k2 -n | cut -f3 > "$WORK/test.hyp"
"$PY" - "$WORK/test.hyp" "$RAW/test.tgt" "$RAW/test.src" <<'EOF'
import sys
import sacrebleu
hyp = open(sys.argv[1], encoding="utf-8").read().splitlines()
ref = open(sys.argv[2], encoding="utf-8").read().splitlines()
src = open(sys.argv[3], encoding="utf-8").read().splitlines()
if len(hyp) != len(ref):
    sys.exit(f"demo: {len(hyp)} hypotheses for {len(ref)} references")
bleu = sacrebleu.corpus_bleu(hyp, [ref])
exact = sum(h == r for h, r in zip(hyp, ref)) / len(ref)
for i in range(3):
    print(f"  src: {src[i]}\n  ref: {ref[i]}\n  hyp: {hyp[i]}\n")
print(f"test sentences translated: {len(hyp)} of {len(ref)}")
print(f"exact-match sentences:     {100 * exact:.1f}%")
print(f"sacreBLEU:                 {bleu.score:.2f}  ({bleu})")
EOF
grep -E "^Generate test" "$GEN" || true
stamp "done; everything is under $WORK"
