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


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def data_bin(tmp_path_factory):
    """The toy corpus of scripts/make_toy_corpus.py (_models.TOY_CORPUS), binarised once for every test that
    trains on it (read-only: a test that changes files copies them first)."""
    from _models import make_toy_data_bin

    out = make_toy_data_bin(tmp_path_factory.mktemp("toy"))
    assert os.path.isfile(os.path.join(out, "test.src-tgt.tgt.bin"))
    return out
