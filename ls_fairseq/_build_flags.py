"""Compiler flags shared by setup.py's ahead-of-time build and the JIT build."""

import logging
import os
import shlex
import shutil
import subprocess
import tempfile

logger = logging.getLogger(__name__)


def abi_flags():
    """The libstdc++ string ABI torch was built with, stated explicitly.

    Recent torch versions no longer pass it to extension builds, and a host compiler whose default
    differs (e.g. a devtoolset-style gcc defaulting to the pre-C++11 ABI) then produces a module whose
    std::string does not match libc10's: every TORCH_CHECK failure (it hands a std::string to libc10)
    crashes the interpreter instead of raising.
    """
    try:
        import torch

        return [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    except Exception:  # noqa: BLE001 - no torch: nothing to match
        return []


def cuda_setting():
    """LS_FAIRSEQ_CUDA, read by setup.py: "auto" (default: build the CUDA extension where torch is a CUDA
    build and nvcc is found), "0" (install without it) or "1" (it is required: stop with the reason where
    it cannot be built)."""
    value = os.environ.get("LS_FAIRSEQ_CUDA", "").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"LS_FAIRSEQ_CUDA={value!r}: expected auto, 0 or 1")
    return value


def cxx_flags():
    return ["-O3", "-std=c++17"] + abi_flags()


def nvcc_flags():
    return [
        "-O3",
        "-std=c++17",
        "--use_fast_math",
        "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_BFLOAT16_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-lineinfo",
    ] + abi_flags() + (["-DLS_FAIRSEQ_DEBUG_SYNC"] if os.environ.get("LS_FAIRSEQ_DEBUG_SYNC") == "1" else [])


# ---- Host toolchain ------------------------------------------------------------------------------
# The extension must use the process's shared libstdc++ (the one torch and the interpreter load). A
# toolchain that links libstdc++ statically into shared objects (a private gcc build without
# libstdc++.so, e.g. CXX=/opt/gcc/bin/g++) puts a second copy of the iostream/locale machinery into
# _C.so; its functions then run against the first copy's global locale data, and the first message
# formatted with an ostream (every failing TORCH_CHECK) dies with SIGSEGV.


def links_shared_libstdcxx(path):
    """True when the shared object at `path` loads libstdc++.so dynamically (DT_NEEDED)."""
    try:
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True, timeout=60)
        if out.returncode == 0:
            return "libstdc++.so" in out.stdout
    except (OSError, subprocess.SubprocessError):
        pass
    with open(path, "rb") as f:  # no readelf: the NEEDED name sits in the dynamic string table
        return b"libstdc++.so." in f.read()


def _probe(cxx):
    """Whether `cxx -shared` links libstdc++ dynamically (None when the compiler does not work)."""
    with tempfile.TemporaryDirectory() as d:
        src, lib = os.path.join(d, "probe.cpp"), os.path.join(d, "probe.so")
        with open(src, "w") as f:
            f.write('#include <sstream>\n#include <string>\n'
                    'std::string probe(long v) { std::ostringstream s; s << v; return s.str(); }\n')
        try:
            r = subprocess.run(shlex.split(cxx) + ["-shared", "-fPIC", "-O1", src, "-o", lib],
                               capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError):
            return None
        if r.returncode != 0 or not os.path.exists(lib):
            return None
        return links_shared_libstdcxx(lib)


def host_compiler_env():
    """Environment overrides (CXX, CC) that give the build a host compiler linking the shared libstdc++.

    Empty when the configured compiler ($CXX, default c++) already does, or when no alternative on PATH
    does (a warning then says so). A configured compiler that links it statically is never kept: its
    module would crash on its first error message, and setup.py refuses such a module.
    """
    cxx = os.environ.get("CXX", "c++")
    if _probe(cxx) is not False:
        return {}
    cur = shutil.which(shlex.split(cxx)[0]) if cxx.strip() else None
    for cand in ("g++", "/usr/bin/g++", "c++", "/usr/bin/c++"):
        path = shutil.which(cand)
        if path is None or (cur and os.path.realpath(path) == os.path.realpath(cur)):
            continue
        if _probe(path):
            cc = os.path.join(os.path.dirname(path), os.path.basename(path).replace("g++", "gcc").replace("c++", "cc"))
            env = {"CXX": path}
            if os.path.exists(cc):
                env["CC"] = cc
            logger.warning("ls_fairseq: %s links libstdc++ statically into shared objects (a second copy of "
                           "libstdc++ inside the extension crashes on the first error message); building with "
                           "%s instead", cxx, env)
            return env
    logger.warning("ls_fairseq: %s links libstdc++ statically into shared objects and no other host compiler on "
                   "PATH links it dynamically; the extension's error path may crash", cxx)
    return {}
