"""The C++ modules that CPU tests build from csrc/ with torch.utils.cpp_extension (the compiled extension
ls_fairseq._C needs CUDA): the autograd nodes and layers over CPU stand-ins of their CUDA adapters
(tests/test_cpp_nodes.py) and the gradient-bucket hooks (tests/test_overlap.py).

Each is compiled once and cached, keyed on everything its build reads: the first session on a machine
compiles (a minute or two), later ones load it (a new build removes those of other sources that nothing
loaded for three days). tests/conftest.py starts a cold cache's builds in a process of their own when the
session collects those tests, and runs them last, so the compiler works beside the other tests. Also a script, the builder that conftest starts:

    python tests/_cpu_builds.py NAME [NAME ...]
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name: (sources relative to the repository, extra compiler flags)
BUILDS = {
    # -O0 for build speed: the wiring is what is tested
    "ls_fairseq_cpp_nodes_test": ([os.path.join("tests", "cpp", "stand_in_adapters.cpp"),
                                   os.path.join("tests", "cpp", "nodes_module.cpp"),
                                   os.path.join("csrc", "torch", "autograd.cpp"),
                                   os.path.join("csrc", "torch", "layers.cpp"),
                                   os.path.join("csrc", "torch", "weight_grads.cpp")], ["-O0"]),
    "ls_fairseq_grad_buckets_test": ([os.path.join("tests", "cpp", "grad_buckets_module.cpp"),
                                      os.path.join("csrc", "torch", "grad_buckets.cpp")], []),
}
# the test files that load them (conftest starts the builds these need)
USED_BY = {"test_cpp_nodes.py": "ls_fairseq_cpp_nodes_test", "test_overlap.py": "ls_fairseq_grad_buckets_test"}


def _folder(name):
    """(the cache folder of ``name``'s build, its compiler flags). The folder is named after a hash of the
    sources, every header under csrc/ and tests/cpp/, the flags, torch, Python and the compiler; it lies in
    a cache of this user's under the temporary directory (``LS_FAIRSEQ_TEST_BUILD_CACHE`` to choose another)."""
    import hashlib
    import shutil
    import tempfile

    import torch

    from ls_fairseq._build_flags import cxx_flags, host_compiler_env

    sources, extra_cflags = BUILDS[name]
    os.environ.update(host_compiler_env())
    cflags = cxx_flags() + list(extra_cflags)
    cxx = os.environ.get("CXX", "c++")
    compiler = shutil.which(cxx.split()[0]) if cxx.strip() else None
    h = hashlib.sha256()
    for part in (name, torch.__version__, torch.version.git_version, sys.version, cxx,
                 os.path.realpath(compiler) if compiler else "", *cflags):
        h.update(str(part).encode() + b"\0")
    if compiler:
        h.update(str(os.stat(os.path.realpath(compiler)).st_mtime_ns).encode())
    headers = []
    for folder in ("csrc", os.path.join("tests", "cpp")):
        for dirpath, _, files in os.walk(os.path.join(ROOT, folder)):
            headers += [os.path.join(dirpath, f) for f in files if f.endswith((".h", ".hpp", ".cuh"))]
    for path in list(sources) + sorted(os.path.relpath(p, ROOT) for p in headers):
        h.update(path.encode() + b"\0")
        with open(os.path.join(ROOT, path), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    user = getattr(os, "getuid", lambda: "")()  # one cache per user: another's is not writable
    cache = os.environ.get("LS_FAIRSEQ_TEST_BUILD_CACHE") or os.path.join(tempfile.gettempdir(),
                                                                          f"ls_fairseq-test-builds-{user}")
    return os.path.join(cache, f"{name}-{h.hexdigest()[:20]}"), cflags


def is_cached(name) -> bool:
    folder, _ = _folder(name)
    return os.path.isfile(os.path.join(folder, f"{name}.so"))


def cached_cpu_extension(name):
    """The module ``name`` of :data:`BUILDS` (compiled now if the cache does not hold it yet); returns
    (module, the folder that holds ``name``.so). A build happens in a folder of its own that is renamed
    into place once complete, so an interrupted build leaves nothing that a later session would take for
    finished, and two sessions building at once both succeed."""
    import importlib.util
    import shutil
    import tempfile

    from torch.utils import cpp_extension

    final, cflags = _folder(name)
    library = os.path.join(final, f"{name}.so")
    if os.path.isfile(library):
        try:
            os.utime(final)  # in use: kept by _prune
        except OSError:
            pass
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module, final
    os.makedirs(os.path.dirname(final), exist_ok=True)
    build = tempfile.mkdtemp(prefix=f"{name}-building-", dir=os.path.dirname(final))
    try:
        module = cpp_extension.load(
            name=name,
            sources=[os.path.join(ROOT, s) for s in BUILDS[name][0]],
            extra_include_paths=[os.path.join(ROOT, "csrc")],
            extra_cflags=cflags,
            build_directory=build,
            verbose=False,
        )
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise
    try:
        os.rename(build, final)
    except OSError:  # another session put the same build in place first
        shutil.rmtree(build, ignore_errors=True)
    _prune(name, keep=final)
    return module, final


def _prune(name, keep, days=3):
    """Remove the builds of ``name`` for other sources (and abandoned build folders) that nothing built or
    loaded for ``days``."""
    import glob
    import shutil
    import time

    for old in glob.glob(os.path.join(os.path.dirname(keep), f"{name}-*")):
        try:
            if old != keep and time.time() - os.path.getmtime(old) > days * 86400:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass


def main(names):
    import signal

    # ended by the test session (interrupted): clean up the build folder on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.path.insert(0, ROOT)
    for name in names:
        cached_cpu_extension(name)


if __name__ == "__main__":
    main(sys.argv[1:])
