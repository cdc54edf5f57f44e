import faulthandler
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _needs_kernels():
    from ls_fairseq import _ext

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if _ext.get() is None:
        pytest.fail(f"ls_fairseq._C is not available on a CUDA machine: {_ext.reason()}")
    yield
    from ls_fairseq.fairseq_ext.graph import gemm_lt

    gemm_lt.disable()  # a run of the CUDA-graph step in this process leaves the products on cuBLASLt


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small WMT-shaped data-bin (4,000 pairs, a 2,000-word vocabulary) for the GPU tests' lightseq-train runs."""
    out = tmp_path_factory.mktemp("wmt_corpus")
    subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "make_wmt_synth.py"), str(out), "--pairs",
                    "4000", "--valid-pairs", "100", "--vocab", "2000"], check=True, capture_output=True)
    return str(out)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Keep Python's fault handler on while the test process exits (pytest turns its own off before that), so that a
    crash in CUDA or C++ teardown after the tests prints every thread's Python stack."""
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
