"""Build ls_fairseq (metadata and entry points are in pyproject.toml).

The CUDA extension ls_fairseq._C is built when torch is a CUDA build and nvcc is found; otherwise a
pure-Python package is installed and the ops run their PyTorch references (LS_FAIRSEQ_CUDA=1: stop
instead, with the reason). torch is deliberately not a dependency: the environment's own torch is
used, and pip must not build in an isolated environment without it. Install with:

    pip install --no-build-isolation -e .

On a machine with an NVIDIA GPU a build that cannot make the extension stops with the reason
(LS_FAIRSEQ_CUDA=0 installs without it on purpose).
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "ls_fairseq"))
from _build_flags import cuda_setting, cxx_flags, host_compiler_env, links_shared_libstdcxx, nvcc_flags  # noqa: E402

sys.path.pop(0)


def _gpu_visible() -> bool:
    """Whether this machine has an NVIDIA GPU (device nodes, or nvidia-smi listing one)."""
    if os.path.exists("/dev/nvidia0"):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "GPU" in out


def _without_extension(reason: str, fix: str, setting: str):
    """Install the pure-Python package, or stop when a GPU is here (it would silently train on the slow path) or
    the extension was asked for (LS_FAIRSEQ_CUDA=1)."""
    if setting == "1":
        sys.exit(f"ls_fairseq: LS_FAIRSEQ_CUDA=1, but the CUDA extension cannot be built: {reason}. {fix}")
    if _gpu_visible():
        sys.exit(f"ls_fairseq: this machine has an NVIDIA GPU, but the CUDA extension cannot be built: {reason}. "
                 f"{fix} (LS_FAIRSEQ_CUDA=0 installs without the extension on purpose.)")
    print(f"ls_fairseq: {reason}; installing without the CUDA extension (the ops run their PyTorch references)",
          file=sys.stderr)
    return [], {}


def _cuda_extension():
    try:
        setting = cuda_setting()
    except ValueError as e:
        sys.exit(f"ls_fairseq: {e}")
    if setting == "0":
        print("ls_fairseq: LS_FAIRSEQ_CUDA=0, installing without the CUDA extension", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
    except ImportError:
        return _without_extension(
            "torch is not importable in the build environment",
            "Install torch first, then build without isolation: pip install --no-build-isolation -e . "
            "(or run bash scripts/setup.sh).", setting)
    if torch.version.cuda is None:  # then torch.utils.cpp_extension finds no CUDA either
        return _without_extension(f"torch {torch.__version__} is a CPU-only build",
                                  "Install a CUDA build of torch (https://pytorch.org/get-started/locally/).", setting)
    if CUDA_HOME is None:
        return _without_extension("nvcc was not found (CUDA_HOME unset)",
                                  "Install the CUDA toolkit matching torch.version.cuda, or set CUDA_HOME.", setting)
    sources = sorted(glob.glob("csrc/kernels/*.cu")) + sorted(glob.glob("csrc/torch/*.cpp"))
    sources += sorted(glob.glob("csrc/torch/*.cu"))
    if not any(s.endswith("bindings.cpp") for s in sources):
        return _without_extension("csrc/torch/bindings.cpp is missing", "Build from a complete source checkout.",
                                  setting)
    # Default archs: Ampere (sm_80) and Hopper (sm_90) with PTX for newer chips.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    ext = CUDAExtension(
        name="ls_fairseq._C",
        sources=sources,
        include_dirs=[os.path.join(here, "csrc")],
        extra_compile_args={"cxx": cxx_flags(), "nvcc": nvcc_flags()},
    )
    # The extension must load the process's shared libstdc++, never carry its own copy (see
    # _build_flags.py): switch away from a host compiler that links it statically, and refuse a
    # module that still does.
    env = host_compiler_env()
    if env:
        print(f"ls_fairseq: host compiler {os.environ.get('CXX', 'c++')} links libstdc++ statically; using {env}")
        os.environ.update(env)

    class _BuildExt(BuildExtension.with_options(use_ninja=True)):
        def build_extension(self, ext):
            super().build_extension(ext)
            path = self.get_ext_fullpath(ext.name)
            if os.path.exists(path) and not links_shared_libstdcxx(path):
                raise RuntimeError(
                    f"{path} does not load libstdc++.so dynamically: the host compiler "
                    f"({os.environ.get('CXX', 'c++')}) linked a private copy of libstdc++ into it, and such a "
                    "module crashes the interpreter on its first error message. Build with a compiler that "
                    "links libstdc++ dynamically (CXX=/usr/bin/g++ CC=/usr/bin/gcc).")

    return [ext], {"build_ext": _BuildExt}


ext_modules, cmdclass = _cuda_extension()

setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
