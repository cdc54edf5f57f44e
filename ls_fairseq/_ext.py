"""The one place that loads the compiled extension ``ls_fairseq._C``.

Order of attempts:
  1. the prebuilt module installed by ``setup.py`` (``ls_fairseq/_C*.so``);
  2. if ``LS_FAIRSEQ_JIT=1`` (or ``=verbose``, which shows the compiler's commands): a JIT build
     through ``torch.utils.cpp_extension.load`` + ninja.

``LS_FAIRSEQ_DISABLE_KERNELS=1`` forces the pure-PyTorch reference path everywhere.
Nothing here touches CUDA at import time; the first call to :func:`get` does the loading.
"""

import glob
import importlib
import os
import threading

from ls_fairseq import env

_lock = threading.Lock()
_state = {"tried": False, "module": None, "reason": None, "source": None}

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sources():
    kernels = sorted(glob.glob(os.path.join(_ROOT, "csrc", "kernels", "*.cu")))
    adapters = sorted(glob.glob(os.path.join(_ROOT, "csrc", "torch", "*.cpp")))
    adapters += sorted(glob.glob(os.path.join(_ROOT, "csrc", "torch", "*.cu")))
    return kernels + adapters


def _jit_build():
    from torch.utils import cpp_extension

    srcs = _sources()
    if not srcs:
        raise RuntimeError("no sources under csrc/ (JIT build needs a source checkout)")
    build_dir = env.build_dir()
    os.makedirs(build_dir, exist_ok=True)
    from ls_fairseq._build_flags import cxx_flags, host_compiler_env, nvcc_flags

    # the same host-compiler choice as setup.py (a compiler that links libstdc++ statically
    # into the module makes every error message crash the interpreter)
    os.environ.update(host_compiler_env())

    return cpp_extension.load(
        name="ls_fairseq_C",
        sources=srcs,
        extra_include_paths=[os.path.join(_ROOT, "csrc")],
        extra_cflags=cxx_flags(),
        extra_cuda_cflags=nvcc_flags(),
        build_directory=build_dir,
        verbose=env.jit_verbose(),
    )


def _load():
    if env.kernels_disabled():
        return None, "disabled by LS_FAIRSEQ_DISABLE_KERNELS=1", None
    try:
        import torch
    except ImportError as e:  # pragma: no cover
        return None, f"torch not importable: {e}", None
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} is a CPU-only build", None
    errors = []
    try:
        mod = importlib.import_module("ls_fairseq._C")
        return mod, None, "prebuilt"
    except ImportError as e:
        errors.append(f"prebuilt ls_fairseq._C not found ({e})")
    if env.jit():
        try:
            return _jit_build(), None, "jit"
        except Exception as e:  # noqa: BLE001 - report any build failure as the reason
            errors.append(f"JIT build failed: {type(e).__name__}: {e}")
    else:
        errors.append("set LS_FAIRSEQ_JIT=1 to build it just in time")
    return None, "; ".join(errors), None


def get():
    """The loaded extension module, or None (see :func:`reason`)."""
    if not _state["tried"]:
        with _lock:
            if not _state["tried"]:
                mod, why, source = _load()
                _state.update(module=mod, reason=why, source=source, tried=True)
    return _state["module"]


def reason():
    """Why the extension is unavailable (None when it is loaded)."""
    get()
    return _state["reason"]


def source():
    """'prebuilt', 'jit' or None."""
    get()
    return _state["source"]


def reset_for_tests():
    import sys

    with _lock:
        _state.update(tried=False, module=None, reason=None, source=None)
        dispatch = sys.modules.get("ls_fairseq.ops._dispatch")
        if dispatch is not None:  # what it remembered of the previous module
            dispatch._HAS_ENTRY.clear()
