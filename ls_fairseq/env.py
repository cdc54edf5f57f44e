"""Every environment variable ls_fairseq reads at run time, in one place (docs/environment.md).

None is needed to install, train or translate: the defaults are what was measured best. What is left:

- loading the extension: LS_FAIRSEQ_JIT (1 or verbose), LS_FAIRSEQ_BUILD_DIR (the build-time ones,
  LS_FAIRSEQ_CUDA and LS_FAIRSEQ_DEBUG_SYNC, are read by ls_fairseq/_build_flags.py, which setup.py
  loads before the package can be imported);
- diagnosis: LS_FAIRSEQ_DISABLE_KERNELS (the PyTorch references on the GPU), LS_FAIRSEQ_STEP_TIMING;
- user settings: LS_FAIRSEQ_CPU_AFFINITY.

Each is read when it is needed (not at import), so a test or a launcher may set it late.
"""

import os


def _get(name: str, default: str = "") -> str:
    return os.environ.get(name, default).strip()


def _on(name: str) -> bool:
    return _get(name) == "1"


# ------------------------------------------------------------ building and loading the extension
def _jit() -> str:
    """LS_FAIRSEQ_JIT: unset or 0 (no JIT build), 1 (build on first use), verbose (and show the compiler)."""
    value = _get("LS_FAIRSEQ_JIT").lower()
    if value not in ("", "0", "1", "verbose"):
        raise ValueError(f"LS_FAIRSEQ_JIT={value!r}: expected 0, 1 or verbose")
    return value


def jit() -> bool:
    return _jit() in ("1", "verbose")


def jit_verbose() -> bool:
    return _jit() == "verbose"


def build_dir() -> str:
    return _get("LS_FAIRSEQ_BUILD_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ls_fairseq", "jit")


# ------------------------------------------------------------ diagnosis
def kernels_disabled() -> bool:
    return _on("LS_FAIRSEQ_DISABLE_KERNELS")


def step_timing() -> bool:
    return _on("LS_FAIRSEQ_STEP_TIMING")


# ------------------------------------------------------------ user settings
def cpu_affinity() -> str:
    """'auto', 'on' or 'off' (LS_FAIRSEQ_CPU_AFFINITY: auto, 1, 0)."""
    value = _get("LS_FAIRSEQ_CPU_AFFINITY", "auto").lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "true", "yes", "on"):
        return "on"
    if value in ("0", "false", "no", "off"):
        return "off"
    raise ValueError(f"LS_FAIRSEQ_CPU_AFFINITY={value!r}: expected auto, 0 or 1")

