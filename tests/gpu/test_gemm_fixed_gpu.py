"""Fixed GEMM algorithms (csrc/torch/gemm.cpp, ls_fairseq/fairseq_ext/gemm_fixed.py) on the GPU: the products
against fp32 torch, one kernel per class whatever the token count, CUDA-graph replay, and ATen where off or where
the operands do not fit."""

import pytest
import torch

from ls_fairseq import _ext
from ls_fairseq.fairseq_ext import gemm_fixed

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=5e-3, atol=5e-3)}


@pytest.fixture(autouse=True)
def _fresh():
    if not gemm_fixed.available():
        pytest.fail("fixed GEMM algorithms are not available in this CUDA build (cuBLASLt not found)")
    assert gemm_fixed.enable(4096)
    yield
    gemm_fixed.disable()


def _C():
    return _ext.get()


def _forms(rows, dtype, g):
    """(name, run, reference) of each form the layers use, at ``rows`` tokens: forward with and without bias, the
    input gradient, the weight gradient written and added."""
    K, N = 256, 384
    x = torch.randn(rows, K, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(N, K, device="cuda", dtype=dtype, generator=g) * 0.1
    b = torch.randn(N, device="cuda", dtype=dtype, generator=g)
    gy = torch.randn(rows, N, device="cuda", dtype=dtype, generator=g)
    acc = torch.randn(N, K, device="cuda", dtype=dtype, generator=g)
    C = _C()

    def into(add):
        out = acc.clone()
        C.gemm_mm_into(out, gy.t(), x, add, 1)
        return out

    f = lambda t: t.float()  # noqa: E731
    return [
        ("fwd_bias", lambda: C.gemm_mm(x, w.t(), b, 0), f(x) @ f(w).t() + f(b)),
        ("fwd", lambda: C.gemm_mm(x, w.t(), None, 0), f(x) @ f(w).t()),
        ("dgrad", lambda: C.gemm_mm(gy, w, None, 0), f(gy) @ f(w)),
        ("wgrad", lambda: C.gemm_mm(gy.t(), x, None, 1), f(gy).t() @ f(x)),
        ("wgrad_add", lambda: into(True), f(acc) + f(gy).t() @ f(x)),
        ("wgrad_write", lambda: into(False), f(gy).t() @ f(x)),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_form_matches_fp32_torch_one_class_each(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_list = [64, 1000, 2048, 4096]
    for rows in rows_list:
        for name, run, ref in _forms(rows, dtype, g):
            out = run()
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), ref, **TOL[dtype], msg=f"{name} at {rows} rows")
    r = gemm_fixed.report()
    assert r["on"] and r["ref_tokens"] == 4096
    assert r["classes"] == 5 and r["classes_lt"] == 5, r  # one class per form (wgrad written or as a new tensor: one)
    assert r["shapes_lt"] == 5 * len(rows_list) and r["shapes_aten"] == 0 and r["refusals"] == 0, r


def test_one_class_runs_one_kernel_at_every_row_count():
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
    C = _C()
    rows_list = [8 * r for r in (37, 101, 160, 211, 298, 333, 384, 411, 456, 489, 500, 512)]
    xs = [torch.randn(r, 1024, device="cuda", dtype=torch.bfloat16, generator=g) for r in rows_list]
    C.gemm_mm(xs[0], w.t(), None, 0)  # the class's first product: its kernel loaded outside the profile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        outs = [C.gemm_mm(x, w.t(), None, 0) for x in xs]
        torch.cuda.synchronize()
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out.float(), x.float() @ w.float().t(), rtol=2e-2, atol=0.5)
    kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    gemm_kernels = {k for k in kernels if "gemm" in k.lower() or "sm90" in k.lower() or "xmma" in k.lower()}
    assert len(gemm_kernels) == 1, sorted(kernels)
    r = gemm_fixed.report()
    assert r["classes"] == 1 and r["classes_lt"] == 1 and r["shapes_lt"] == len(rows_list) and r["refusals"] == 0, r


def test_replays_in_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(2)
    C = _C()
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    b = torch.randn(768, device="cuda", dtype=torch.bfloat16, generator=g)
    acc = torch.zeros(768, 512, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the class chosen and the handles made before the capture
        C.gemm_mm(x, w.t(), b, 0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = C.gemm_mm(x, w.t(), b, 0)
        C.gemm_mm_into(acc, y.t(), x, True, 1)
    for step in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
        acc.zero_()
        graph.replay()
        torch.cuda.synchronize()
        ref = x.float() @ w.float().t() + b.float()
        torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(acc.float(), y.float().t() @ x.float(), rtol=2e-2, atol=0.5)
    assert gemm_fixed.report()["refusals"] == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_off_is_aten_bit_for_bit(dtype):
    gemm_fixed.disable()
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1000, 256, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(384, 256, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(384, device="cuda", dtype=dtype, generator=g)
    C = _C()
    assert torch.equal(C.gemm_mm(x, w.t(), b, 0), torch.addmm(b, x, w.t()))
    assert torch.equal(C.gemm_mm(x, w.t(), None, 0), torch.mm(x, w.t()))
    assert torch.equal(gemm_fixed.mm(x, w.t()), torch.mm(x, w.t()))
    gy = torch.randn(1000, 384, device="cuda", dtype=dtype, generator=g)
    out, ref = torch.ones(384, 256, device="cuda", dtype=dtype), torch.ones(384, 256, device="cuda", dtype=dtype)
    C.gemm_mm_into(out, gy.t(), x, True, 1)
    assert torch.equal(out, ref.addmm_(gy.t(), x))
    r = gemm_fixed.report()
    assert not r["on"] and r["classes"] == 0, r


def test_operands_that_do_not_fit_go_through_aten():
    g = torch.Generator(device="cuda").manual_seed(4)
    C = _C()
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    cases = [
        torch.randn(1000, 256, device="cuda", generator=g),  # fp32
        torch.randn(1001, 256, device="cuda", dtype=torch.bfloat16, generator=g),  # rows not a multiple of 8
        torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16, generator=g)[:, ::2],  # strided
        torch.randn(1000 * 256 + 1, device="cuda", dtype=torch.bfloat16, generator=g)[1:].view(1000, 256),  # unaligned
    ]
    for x in cases:
        ww = w.to(x.dtype)
        assert torch.equal(C.gemm_mm(x, ww.t(), None, 0), torch.mm(x, ww.t()))
    with pytest.raises(RuntimeError):  # sizes that do not match: ATen's own error
        C.gemm_mm(torch.randn(64, 128, device="cuda", dtype=torch.bfloat16), w.t(), None, 0)
    r = gemm_fixed.report()
    assert r["classes"] == 0 and r["shapes_lt"] == 0, r


def test_head_helpers_match_torch():
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    logits = gemm_fixed.mm(x, w.t())
    torch.testing.assert_close(logits.float(), x.float() @ w.float().t(), rtol=2e-2, atol=2e-2)
    dx = gemm_fixed.mm(logits, w)
    torch.testing.assert_close(dx.float(), logits.float() @ w.float(), rtol=2e-2, atol=0.1)
    grad = torch.ones_like(w)
    gemm_fixed.mm_into(grad, logits.t(), x, add=True, token=1)
    torch.testing.assert_close(grad.float(), 1 + logits.float().t() @ x.float(), rtol=2e-2, atol=0.5)
    r = gemm_fixed.report()
    assert r["classes"] == 3 and r["shapes_lt"] == 3 and r["refusals"] == 0, r
    assert "3 of 3 classes" in gemm_fixed.describe()
