"""Fixed GEMM algorithms on the CPU: the helpers are torch's products, and nothing turns on without cuBLASLt
(the GPU side is tests/gpu/test_gemm_fixed_gpu.py)."""

import torch

from ls_fairseq import env
from ls_fairseq.fairseq_ext import gemm_fixed


def test_helpers_are_torch_products_on_the_cpu():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(24, 16, generator=g), torch.randn(32, 16, generator=g)
    assert torch.equal(gemm_fixed.mm(x, w.t()), torch.mm(x, w.t()))
    y = torch.randn(24, 32, generator=g)
    out, ref = torch.randn(32, 16, generator=g), None
    ref = out.clone().addmm_(y.t(), x)
    gemm_fixed.mm_into(out, y.t(), x, add=True, token=1)
    assert torch.equal(out, ref)
    gemm_fixed.mm_into(out, y.t(), x, add=False, token=1)
    assert torch.equal(out, torch.mm(y.t(), x))


def test_not_on_without_cublaslt():
    if torch.cuda.is_available():
        return  # the GPU tests cover a CUDA build
    assert not gemm_fixed.available()
    assert gemm_fixed.enable(4096) is False
    assert not gemm_fixed.is_on()
    assert gemm_fixed.describe() == "off"


def test_switch(monkeypatch):
    monkeypatch.delenv("LS_FAIRSEQ_FIXED_GEMM", raising=False)
    assert env.fixed_gemm() is False
    monkeypatch.setenv("LS_FAIRSEQ_FIXED_GEMM", "1")
    assert env.fixed_gemm() is True
