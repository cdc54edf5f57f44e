#!/usr/bin/env bash
# Set up ls_fairseq, then (optionally) run the tests or the demo.
#
#   bash scripts/setup.sh           # install only
#   bash scripts/setup.sh --test    # install, then the test suite (GPU tests skip themselves without a GPU)
#   bash scripts/setup.sh --demo    # install, then the demo: train a toy translator, translate, print BLEU
#
# Python: $PYTHON if set, else python3, else python (>= 3.10). Inside a virtual environment (or conda, or
# pyenv) everything goes there. A system Python that pip may not change ("externally managed", as on
# Debian/Ubuntu) gets a virtual environment in .venv/ beside this checkout; activate it afterwards with
#   source .venv/bin/activate
# torch: one that already imports is kept (a CUDA build stays a CUDA build). Otherwise, on a machine
# without an NVIDIA GPU the CPU build is installed (PyTorch's CPU index; the configured index only when
# it serves a CPU build), on a GPU machine the CUDA build from the configured index.
# Offline installs work through pip's own settings, e.g. PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels.
# Every step is skipped when what it installs is already there, so a second run takes seconds.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
FAIRSEQ_VERSION="0.12.3.1"
MODE="${1:-}"
case "$MODE" in ""|--test|--demo) ;; *) echo "usage: bash scripts/setup.sh [--test|--demo]" >&2; exit 2 ;; esac

T0=$SECONDS
t_step=$SECONDS
log() { echo "[setup $((SECONDS - T0))s] $*"; }
done_step() { log "$1 ($((SECONDS - t_step)) s)"; t_step=$SECONDS; }

# 0. the interpreter
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if command -v python3 >/dev/null; then PY=python3
  elif command -v python >/dev/null; then PY=python
  else echo "setup: no python3 or python on PATH; install Python >= 3.10 first" >&2; exit 1; fi
fi
"$PY" - <<'PYEOF' || exit 1
import sys
if sys.version_info < (3, 10):
    sys.exit(f"setup: ls_fairseq needs Python >= 3.10 (found {sys.version.split()[0]})")
PYEOF
managed="$("$PY" - <<'PYEOF'
import os, sys, sysconfig
in_env = sys.prefix != sys.base_prefix or "CONDA_PREFIX" in os.environ
print("yes" if not in_env and os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else "no")
PYEOF
)"
if [[ "$managed" == "yes" || -x "$REPO/.venv/bin/python" ]]; then
  if [[ ! -x "$REPO/.venv/bin/python" ]]; then
    log "$PY is the system's Python (externally managed): creating a virtual environment in $REPO/.venv"
    "$PY" -m venv "$REPO/.venv" || { echo "setup: could not create a venv; install python3-venv (Debian/Ubuntu: apt install python3-venv)" >&2; exit 1; }
  fi
  PY="$REPO/.venv/bin/python"
  export PATH="$REPO/.venv/bin:$PATH"
  log "using $PY (activate later with: source $REPO/.venv/bin/activate)"
fi
"$PY" -m pip --version >/dev/null 2>&1 || { echo "setup: $PY has no pip (Debian/Ubuntu: apt install python3-pip)" >&2; exit 1; }
pip_install() { "$PY" -m pip install --disable-pip-version-check "$@"; }
dist_version() {  # installed version of a distribution, empty when absent
  "$PY" - "$1" <<'PYEOF'
import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    print("")
PYEOF
}
gpu=no
if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q GPU; then gpu=yes; fi
log "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])'); NVIDIA GPU: $gpu"

# 1. torch: never replace one that imports.
if TORCH_BEFORE="$("$PY" -c 'import torch; print(torch.__version__, torch.__file__)' 2>/dev/null)"; then
  log "torch ${TORCH_BEFORE%% *} already importable: left as it is"
  if [[ "$gpu" == yes ]] && [[ "$("$PY" -c 'import torch; print(torch.version.cuda is None)')" == True ]]; then
    echo "setup: WARNING: this machine has an NVIDIA GPU but torch ${TORCH_BEFORE%% *} is CPU-only; install a CUDA build of torch (https://pytorch.org/get-started/locally/) and run setup again" >&2
  fi
elif [[ "$gpu" == yes ]]; then
  log "installing torch==${TORCH_VERSION} (CUDA build)"
  pip_install "torch==${TORCH_VERSION}"
else
  log "installing torch==${TORCH_VERSION}, CPU build (no NVIDIA GPU here)"
  if ! pip_install --timeout 30 --retries 1 --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"; then
    log "PyTorch's CPU index is not reachable: checking what the configured index serves"
    report="$(mktemp)"
    pip_install --dry-run --ignore-installed --quiet --report "$report" "torch==${TORCH_VERSION}"
    if "$PY" - "$report" <<'PYEOF'
import json, sys
items = json.load(open(sys.argv[1]))["install"]
cuda = [i["metadata"]["name"] for i in items if i["metadata"]["name"].lower().startswith("nvidia")]
sys.exit(1 if cuda else 0)
PYEOF
    then
      pip_install "torch==${TORCH_VERSION}"
    else
      rm -f "$report"
      echo "setup: the configured package index serves only a CUDA build of torch (several GB) and PyTorch's CPU index (https://download.pytorch.org/whl/cpu) is not reachable; install a CPU build of torch yourself, then run setup again" >&2
      exit 1
    fi
    rm -f "$report"
  fi
fi
TORCH_BEFORE="$("$PY" -c 'import torch; print(torch.__version__, torch.__file__)')"
done_step "torch ${TORCH_BEFORE%% *}"

# 2. fairseq-fixed (fairseq 0.12.2 does not import on Python >= 3.11). Built without build isolation so pip does not
#    fetch a second torch into a build environment; a source build then needs cython first.
if [[ "$(dist_version fairseq-fixed)" == "${FAIRSEQ_VERSION}" ]]; then
  log "fairseq-fixed ${FAIRSEQ_VERSION} already installed"
else
  if ! "$PY" -m pip download --disable-pip-version-check --quiet --no-deps --only-binary=:all: -d "$(mktemp -d)" \
      "fairseq-fixed==${FAIRSEQ_VERSION}" >/dev/null 2>&1; then
    "$PY" -c "import Cython" 2>/dev/null || pip_install cython  # no wheel for this platform: a source build
  fi
  log "installing fairseq-fixed==${FAIRSEQ_VERSION}"
  pip_install --no-build-isolation "fairseq-fixed==${FAIRSEQ_VERSION}"
fi
done_step "fairseq-fixed"

# 3. evaluation, tests, the WMT14 recipe's text tools and the DeepSpeed launcher (pure Python: DS_BUILD_OPS=0
#    compiles nothing; none of them pulls in torch).
missing=()
for pkg in sacrebleu pytest; do
  [[ -n "$(dist_version "$pkg")" ]] || missing+=("$pkg")
done
((${#missing[@]} == 0)) || pip_install "${missing[@]}"
if [[ -z "$(dist_version sacremoses)" || -z "$(dist_version subword-nmt)" ]]; then
  pip_install --no-build-isolation sacremoses==0.2.0 subword-nmt==0.3.8
fi
[[ -n "$(dist_version deepspeed)" ]] || DS_BUILD_OPS=0 pip_install --no-build-isolation deepspeed==0.19.8
for pkg in pybind11 ninja; do
  [[ -n "$(dist_version "$pkg")" ]] || pip_install "$pkg"
done
done_step "sacrebleu, pytest, sacremoses, subword-nmt, deepspeed, pybind11, ninja"

# 4. ls_fairseq itself (editable; builds the CUDA extension where torch has CUDA and nvcc is found).
installed_at="$(cd / && "$PY" - <<'PYEOF'
import os
try:
    import ls_fairseq
    print(os.path.dirname(os.path.dirname(os.path.abspath(ls_fairseq.__file__))))
except ImportError:
    print("")
PYEOF
)"
py_bin="$(cd / && "$PY" -c 'import sys, os; print(os.path.dirname(sys.executable))')"
if [[ "$installed_at" == "$REPO" ]] && [[ -x "$py_bin/lightseq-train" ]] && [[ "${FORCE:-0}" != "1" ]]; then
  log "ls_fairseq already installed from $REPO (FORCE=1 reinstalls, e.g. to rebuild the CUDA extension)"
else
  log "installing ls_fairseq from $REPO"
  (cd "$REPO" && pip_install --no-build-isolation --no-deps -e .)
fi
TORCH_AFTER="$("$PY" -c 'import torch; print(torch.__version__, torch.__file__)')"
if [[ "$TORCH_BEFORE" != "$TORCH_AFTER" ]]; then
  echo "[setup] ERROR: torch changed during setup ($TORCH_BEFORE -> $TORCH_AFTER)" >&2
  exit 1
fi
done_step "ls_fairseq $(dist_version ls_fairseq)"
(cd / && "$PY" -m ls_fairseq.info 2>/dev/null | sed -n '1,6p') || true
log "done in $((SECONDS - T0)) s (check the install any time with: $PY -m ls_fairseq.info)"

# 5. what was asked for
export PATH="$py_bin:$PATH"
case "$MODE" in
  --test) cd "$REPO" && exec "$PY" -m pytest -q ;;
  --demo) exec env PYTHON="$PY" bash "$REPO/scripts/demo.sh" ;;
esac
