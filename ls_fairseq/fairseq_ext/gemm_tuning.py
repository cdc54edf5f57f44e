"""GEMM tuning in lightseq-train: each class of product measured once, the fastest algorithm kept.

cuBLASLt proposes several algorithms for a matrix product and ATen runs the first it proposes; for the projections of
a transformer another is often faster (the op benchmark ``benchmarks/bench_gemm.py`` lists them). With
``--ls-gemm-tuning on`` (lightseq-train's default on a GPU) the layers' products, the head's included, go through
``csrc/torch/gemm.cpp``: the first time a class of product runs outside a CUDA-graph capture (its sizes other than the
token count, layouts, dtypes, bias, accumulation) it is measured at a few token counts up to ``--max-tokens``, ATen
against cuBLASLt's first eight candidates, and from then on each product of the class runs the choice made at the
nearest of those token counts. The classes of a model are met in the first update or two; measuring them all takes
about a second, once per run.

The choice depends on timings, so it is measured once per machine and kept: in a file under ``~/.cache/ls_fairseq``
(``$XDG_CACHE_HOME`` if set) named by the GPU model, the cuBLASLt version and ``--max-tokens``, which later runs load
(the same seed then gives the same run bit for bit, and nothing is measured again), and in every checkpoint
(``extra_state["ls_gemm_tuning"]``), whose choices a resumed run takes over the file's, so that it continues exactly
as the uninterrupted run would (on the same GPU model and cuBLASLt version; on others they are measured afresh, and
the log says so). ``--ls-gemm-tuning off`` leaves every product to ATen.
"""

import json
import logging
import os
import re
from typing import Optional

import torch

logger = logging.getLogger("fairseq.trainer")

# Set by lightseq-train (--ls-gemm-tuning) in every training process before the trainer is built.
OPTIONS = {"on": False}
GRID_FRACTIONS = (0.2, 0.4, 0.6, 0.8, 1.0)  # the measured token counts, as fractions of --max-tokens
CANDIDATES = 8  # cuBLASLt's candidates measured beside ATen
STATE_KEY = "ls_gemm_tuning"
_active = {"on": False, "from_checkpoint": False, "cache": None}  # this process's tuning (start(), load())


def mm(a: torch.Tensor, b: torch.Tensor, token: int = 0) -> torch.Tensor:
    """``a @ b`` for code outside the C++ layers (the CUDA-graph step's head): tuned while tuning is on."""
    if _active["on"]:
        return _ext().gemm_mm(a, b, None, token)
    return torch.mm(a, b)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool, token: int = 0) -> None:
    """``out += a @ b`` (add) or ``out = a @ b``, as :func:`mm`."""
    if _active["on"]:
        _ext().gemm_mm_into(out, a, b, add, token)
    elif add:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)


def grid(max_tokens: Optional[int]) -> list:
    """The token counts at which a class of product is measured: fractions of ``max_tokens``, multiples of 64."""
    top = int(max_tokens or 4096)
    points = sorted({max(64, int(round(top * f / 64.0)) * 64) for f in GRID_FRACTIONS})
    return points


def _ext():
    from ls_fairseq import _ext as ext_mod

    return ext_mod.get()


def unavailable_reason(trainer) -> Optional[str]:
    """Why this run does not tune its products (None: it does)."""
    if not OPTIONS.get("on"):
        return "--ls-gemm-tuning off"
    if not trainer.cuda:
        return "not on a CUDA device"
    ext = _ext()
    if ext is None or not hasattr(ext, "gemm_tuning_available"):
        return "the CUDA extension is not built"
    if not ext.gemm_tuning_available():
        return "cuBLASLt was not found in this process or build"
    return None


def start(trainer) -> bool:
    """Turns tuning on for this run (before its first update); logs once why it stays off."""
    reason = unavailable_reason(trainer)
    if reason is not None:
        if OPTIONS.get("on"):
            logger.info("GEMM tuning off (%s): every product through ATen", reason)
        return False
    points = grid(trainer.cfg.dataset.max_tokens)
    ext = _ext()
    _active["cache"] = cache_path(points, int(ext.gemm_tuning_version()), _device_name())
    kept = 0
    if not _active["from_checkpoint"]:
        saved = _read(_active["cache"])
        if saved is not None and load(saved, quiet=True):
            kept = len(saved["rows"])
    ext.gemm_tuning_enable(points, CANDIDATES)
    _active["on"] = True
    logger.info("GEMM tuning on: each class of product measured at %s tokens, ATen against cuBLASLt's first %d "
                "algorithms; %s (--ls-gemm-tuning off: ATen's choice throughout)", points, CANDIDATES,
                f"{kept} choices loaded from {_active['cache']}" if kept else
                ("the checkpoint's choices" if _active["from_checkpoint"] else f"kept in {_active['cache']}"))
    return True


def cache_path(points, version: int, device: str) -> str:
    """The file that keeps this machine's choices for runs of this grid."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-") or "gpu"
    return os.path.join(base, "ls_fairseq", f"gemm-{slug}-cublaslt{version}-t{max(points)}.json")


def _read(path: Optional[str]) -> Optional[dict]:
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
        return saved if isinstance(saved, dict) and isinstance(saved.get("rows"), list) else None
    except (OSError, ValueError) as e:
        logger.warning("GEMM tuning: could not read %s (%s): measured afresh", path, e)
        return None


def _write(path: Optional[str], saved: Optional[dict]) -> None:
    """Writes the choices atomically (a reader never sees half a file); a failure only costs the next run a
    measurement."""
    if not path or saved is None:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(saved, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("GEMM tuning: could not keep the choices in %s (%s)", path, e)


def report(last: Optional[list] = None) -> Optional[list]:
    """Logs what was measured since ``last`` (a previous return value); returns the report now."""
    ext = _ext()
    if ext is None:
        return last
    now = list(ext.gemm_tuning_report())
    if last is not None and now[4] == last[4]:
        return now
    classes, decisions, lt, seconds, points, aten_ms, chosen_ms = now
    if points > 0:
        _write(_active["cache"], state())
        logger.info("GEMM tuning: %d classes of product measured at %d points in %.2f s; cuBLASLt's algorithm "
                    "chosen at %d of %d (one product at each point: %.2f ms through ATen, %.2f ms as chosen)",
                    classes, points, seconds, lt, decisions, aten_ms, chosen_ms)
    return now


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


def state() -> Optional[dict]:
    """The choices for a checkpoint's extra state (None when there are none)."""
    ext = _ext()
    if ext is None or not hasattr(ext, "gemm_tuning_state"):
        return None
    rows = ext.gemm_tuning_state()
    if not rows:
        return None
    return {"cublaslt": int(ext.gemm_tuning_version()), "device": _device_name(), "rows": [list(r) for r in rows]}


def load(saved, quiet: bool = False) -> bool:
    """Takes saved choices (a checkpoint's, or the cache file's with ``quiet``) when they were made on this GPU model
    and cuBLASLt version."""
    ext = _ext()
    if not saved or ext is None or not hasattr(ext, "gemm_tuning_load"):
        return False
    here = {"cublaslt": int(ext.gemm_tuning_version()), "device": _device_name()}
    if saved.get("cublaslt") != here["cublaslt"] or saved.get("device") != here["device"]:
        if not quiet:
            logger.info("GEMM tuning: the checkpoint's choices were made on %s with cuBLASLt %s, this run has %s "
                        "with %s: measured afresh", saved.get("device"), saved.get("cublaslt"), here["device"],
                        here["cublaslt"])
        return False
    try:
        ext.gemm_tuning_load([[int(v) for v in row] for row in saved["rows"]])
    except (RuntimeError, TypeError, ValueError) as e:
        logger.warning("GEMM tuning: saved choices not usable (%s): measured afresh", e)
        return False
    if not quiet:
        _active["from_checkpoint"] = True
        logger.info("GEMM tuning: %d choices taken from the checkpoint", len(saved["rows"]))
    return True
