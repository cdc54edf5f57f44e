import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tests start fairseq's and the plugin's console scripts (fairseq-preprocess, lightseq-train, ...) as
# subprocesses: take those of the interpreter that runs the tests, also when its environment is not activated.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

# One intra-op thread in the tests' process and in every process it starts (they inherit the environment):
# the models here are tiny, and on a machine of few cores that other work shares, a second OpenMP thread
# per process makes each small matrix product wait for a core instead (up to 20x slower).
# Set OMP_NUM_THREADS to run with more.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # imported before this file (a plugin): the setting above came too late for it
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and the compiled extension (skipped otherwise)")
    config.addinivalue_line("markers", "slow: end-to-end runs that take more than a few seconds")


def _gpu_available():
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


@pytest.hookimpl(trylast=True)  # after -k / -m deselection: ``items`` is what this session runs
def pytest_collection_modifyitems(config, items):
    _start_cpu_builds(config, items)
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# ----------------------------------------------------------------------------- C++ modules for CPU tests
_BUILDER = pytest.StashKey()


def _start_cpu_builds(config, items):
    """The tests that load a C++ module built for the CPU (tests/_cpu_builds.py) run last (in their own
    order; the others keep theirs). The modules that the cache does not hold yet are compiled by a process
    of its own, started now (one compiler job: the tests keep the other core), while the other tests run."""
    import shutil
    import subprocess

    import _cpu_builds

    def needs(item):
        return _cpu_builds.USED_BY.get(os.path.basename(str(item.path)))

    items.sort(key=lambda item: needs(item) is not None)  # stable
    if config.option.collectonly or shutil.which(os.environ.get("CXX", "c++")) is None:
        return
    names = [n for n in dict.fromkeys(needs(item) for item in items if needs(item)) if not _cpu_builds.is_cached(n)]
    if not names:
        return
    env = dict(os.environ, MAX_JOBS="1")
    config.stash[_BUILDER] = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "tests", "_cpu_builds.py"), *names], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def pytest_unconfigure(config):
    builder = config.stash.get(_BUILDER, None)
    if builder is not None and builder.poll() is None:  # the session ended first (interrupted, -x)
        builder.terminate()
        builder.wait()


@pytest.fixture(scope="session")
def cpu_builds(request):
    """Waits for the C++ modules compiled beside the tests, if this session started their build. (Where that
    build failed, the test's own fixture compiles again, and shows the compiler's error.)"""
    builder = request.config.stash.get(_BUILDER, None)
    if builder is not None:
        builder.wait()


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    """The toy corpus of scripts/make_toy_corpus.py (_models.TOY_CORPUS), binarised once for every test that
    trains on it (read-only: a test that changes files copies them first)."""
    from _models import make_toy_data_bin

    out = make_toy_data_bin(tmp_path_factory.mktemp("toy"))
    assert os.path.isfile(os.path.join(out, "test.src-tgt.tgt.bin"))
    return out
