#!/usr/bin/env bash
# WMT14 English-German data for ls_fairseq: download (or take a local copy of) the standard
# corpora, Moses-tokenise (sacremoses), learn a joined BPE (subword-nmt), clean by length and
# ratio, binarise with fairseq-preprocess --joined-dictionary.
#
#   train: europarl v7 + commoncrawl + news-commentary v12     valid: newstest2013
#   test:  newstest2014 (the "full" set, 3003 sentences)
#
# Usage: scripts/prepare_wmt14_en_de.sh [options]
#   --raw-dir DIR     use already-downloaded raw files in DIR instead of downloading. DIR has either
#                     the five archives (training-parallel-europarl-v7.tgz, training-parallel-commoncrawl.tgz,
#                     training-parallel-nc-v12.tgz, dev.tgz, test-full.tgz) or their extracted layout:
#                       training/europarl-v7.de-en.{en,de}   commoncrawl.de-en.{en,de}
#                       training/news-commentary-v12.de-en.{en,de}   dev/newstest2013.{en,de}
#                       test-full/newstest2014-deen-src.en.sgm   test-full/newstest2014-deen-ref.de.sgm
#   --work-dir DIR    where text files go (default: wmt14_en_de)
#   --dest-dir DIR    where fairseq-preprocess writes (default: data-bin/wmt14_en_de)
#   --bpe-size N      BPE merge operations (default: 32000; use a small one for a quick test)
#   --workers N       processes for tokenisation / BPE / binarisation (default: number of cores)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TEXT_PY="$HERE/wmt14/text.py"
PYTHON="${PYTHON:-python}"

RAW_DIR=""
WORK_DIR="wmt14_en_de"
DEST_DIR="data-bin/wmt14_en_de"
BPE_SIZE=32000
WORKERS="$(nproc 2>/dev/null || echo 4)"

usage() { sed -n '2,20p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --raw-dir) RAW_DIR="$2"; shift 2 ;;
    --work-dir) WORK_DIR="$2"; shift 2 ;;
    --dest-dir) DEST_DIR="$2"; shift 2 ;;
    --bpe-size) BPE_SIZE="$2"; shift 2 ;;
    --workers) WORKERS="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "prepare_wmt14_en_de.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done

for tool in fairseq-preprocess subword-nmt; do
  command -v "$tool" >/dev/null || { echo "error: '$tool' not found (pip install fairseq-fixed subword-nmt)" >&2; exit 1; }
done
"$PYTHON" -c "import sacremoses" 2>/dev/null || { echo "error: sacremoses missing (pip install sacremoses)" >&2; exit 1; }

SRC=en
TGT=de
URLS=(
  "http://statmt.org/wmt13/training-parallel-europarl-v7.tgz"
  "http://statmt.org/wmt13/training-parallel-commoncrawl.tgz"
  "http://data.statmt.org/wmt17/translation-task/training-parallel-nc-v12.tgz"
  "http://data.statmt.org/wmt17/translation-task/dev.tgz"
  "http://statmt.org/wmt14/test-full.tgz"
)
CORPORA=(
  "training/europarl-v7.de-en"
  "commoncrawl.de-en"
  "training/news-commentary-v12.de-en"
)
VALID="dev/newstest2013"
TEST_SRC="test-full/newstest2014-deen-src.en.sgm"
TEST_REF="test-full/newstest2014-deen-ref.de.sgm"

mkdir -p "$WORK_DIR"
TMP="$WORK_DIR/tmp"
mkdir -p "$TMP"
if [[ -n "$RAW_DIR" && ! -d "$RAW_DIR" ]]; then
  echo "error: --raw-dir $RAW_DIR is not a folder" >&2; exit 1
fi
ORIG="${RAW_DIR:-$WORK_DIR/orig}"

have_layout() {
  local f
  for f in "${CORPORA[@]}"; do
    [[ -f "$ORIG/$f.$SRC" && -f "$ORIG/$f.$TGT" ]] || return 1
  done
  [[ -f "$ORIG/$VALID.$SRC" && -f "$ORIG/$VALID.$TGT" && -f "$ORIG/$TEST_SRC" && -f "$ORIG/$TEST_REF" ]]
}

# ---- 1. raw files: extract local archives, or download (only without --raw-dir) -------------------
# Archives (downloaded or found in --raw-dir) are extracted into WORK_DIR/orig; --raw-dir is never written.
if ! have_layout; then
  ARCHIVES="$ORIG"
  ORIG="$WORK_DIR/orig"
  mkdir -p "$ORIG"
  if ! have_layout; then
    for url in "${URLS[@]}"; do
      file="$ARCHIVES/$(basename "$url")"
      if [[ ! -f "$file" ]]; then
        if [[ -n "$RAW_DIR" ]]; then
          echo "error: --raw-dir $RAW_DIR has neither the extracted files nor $(basename "$url")" >&2
          exit 1
        fi
        mkdir -p "$ARCHIVES"
        echo "downloading $url"
        if command -v wget >/dev/null; then wget -q -O "$file.part" "$url"; else curl -fsSL -o "$file.part" "$url"; fi
        mv "$file.part" "$file"
      fi
      echo "extracting $file"
      tar -xzf "$file" -C "$ORIG"
    done
    have_layout || { echo "error: raw files incomplete under $ORIG after extraction" >&2; exit 1; }
  fi
fi

# ---- 2. Moses normalisation + tokenisation -------------------------------------------------------
echo "tokenising train data"
for l in $SRC $TGT; do
  : > "$TMP/train.$l"
  for f in "${CORPORA[@]}"; do
    "$PYTHON" "$TEXT_PY" tokenize -l $l -j "$WORKERS" < "$ORIG/$f.$l" >> "$TMP/train.$l"
  done
done
echo "tokenising valid (newstest2013) and test (newstest2014) data"
for l in $SRC $TGT; do
  "$PYTHON" "$TEXT_PY" tokenize -l $l -j "$WORKERS" < "$ORIG/$VALID.$l" > "$TMP/valid.$l"
done
"$PYTHON" "$TEXT_PY" sgm < "$ORIG/$TEST_SRC" > "$TMP/test.raw.$SRC"
"$PYTHON" "$TEXT_PY" sgm < "$ORIG/$TEST_REF" > "$TMP/test.raw.$TGT"
for l in $SRC $TGT; do
  # the classic recipe maps the typographic apostrophe before tokenising the test set
  sed -e "s/’/'/g" "$TMP/test.raw.$l" | "$PYTHON" "$TEXT_PY" tokenize -l $l -j "$WORKERS" > "$TMP/test.$l"
done

# ---- 3. joined BPE --------------------------------------------------------------------------------
CODES="$WORK_DIR/code"
echo "learning $BPE_SIZE joined BPE merges"
cat "$TMP/train.$SRC" "$TMP/train.$TGT" | subword-nmt learn-bpe -s "$BPE_SIZE" > "$CODES"
for l in $SRC $TGT; do
  for split in train valid test; do
    subword-nmt apply-bpe -c "$CODES" --num-workers "$WORKERS" < "$TMP/$split.$l" > "$TMP/bpe.$split.$l"
  done
done

# ---- 4. length / ratio cleaning of the training pairs (1..250 tokens, ratio 1.5) -----------------
"$PYTHON" "$TEXT_PY" clean "$TMP/bpe.train" $SRC $TGT "$WORK_DIR/train" 1 250 --ratio 1.5
for l in $SRC $TGT; do
  cp "$TMP/bpe.valid.$l" "$WORK_DIR/valid.$l"
  cp "$TMP/bpe.test.$l" "$WORK_DIR/test.$l"
  cp "$TMP/test.raw.$l" "$WORK_DIR/test.raw.$l"   # untokenised newstest2014, for sacrebleu
done

# ---- 5. binarise ------------------------------------------------------------------------------------
# --padding-factor 16: a vocabulary of a multiple of 16 words (the FP8 GEMM's tile), so that --fp8 also runs the
# vocabulary projection in FP8 (fairseq's default pads to a multiple of 8)
fairseq-preprocess --source-lang $SRC --target-lang $TGT \
  --trainpref "$WORK_DIR/train" --validpref "$WORK_DIR/valid" --testpref "$WORK_DIR/test" \
  --destdir "$DEST_DIR" --joined-dictionary --padding-factor 16 --workers "$WORKERS"
cp "$CODES" "$DEST_DIR/code"
cp "$WORK_DIR/test.raw.$SRC" "$WORK_DIR/test.raw.$TGT" "$DEST_DIR/"
echo "done: binarised data in $DEST_DIR (BPE codes and raw newstest2014 copied there)"
