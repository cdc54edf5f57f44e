"""The layers' products through cuBLASLt (csrc/torch/gemm.cpp, ls_fairseq/fairseq_ext/graph/gemm_lt.py) on the GPU: the
products against fp32 torch, preloaded shapes not waiting for queued work, CUDA-graph replay, and ATen where off or
where the operands do not fit."""

import time

import pytest
import torch

from ls_fairseq import _ext
from ls_fairseq.fairseq_ext.graph import gemm_lt

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
TOL = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=5e-3, atol=5e-3)}


@pytest.fixture(autouse=True)
def _on():
    if not gemm_lt.available():
        pytest.fail("cuBLASLt is not available in this CUDA build")
    assert gemm_lt.enable()
    yield
    gemm_lt.disable()


def _C():
    return _ext.get()


def _forms(rows, dtype, g, K=256, N=384):
    """(name, run, reference) of each form the layers use, at ``rows`` tokens: forward with and without bias, the
    input gradient, the weight gradient written and added."""
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
def test_each_form_matches_fp32_torch(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    before = gemm_lt.report()
    rows_list = [64, 1000, 2048, 4096]
    for rows in rows_list:
        for name, run, ref in _forms(rows, dtype, g, K=264, N=392):  # sizes no other test uses
            out = run()
            assert out.dtype == dtype
            torch.testing.assert_close(out.float(), ref, **TOL[dtype], msg=f"{name} at {rows} rows")
    r = gemm_lt.report()
    # five classes (the weight gradient written or as a new tensor is one), one shape per class and row count
    assert r["classes"] - before["classes"] == 5, r
    assert r["shapes_lt"] - before["shapes_lt"] == 5 * len(rows_list) and r["refusals"] == 0, r


def test_preloaded_shapes_do_not_wait_for_queued_work():
    g = torch.Generator(device="cuda").manual_seed(1)
    C = _C()
    K, N = 1032, 1048  # a class no other test uses
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g)
    C.gemm_mm(torch.randn(64, K, device="cuda", dtype=torch.bfloat16, generator=g), w.t(), None, 0)  # the class seen
    counts = [8 * r for r in (37, 101, 160, 211, 298, 333, 384, 411, 456, 489, 500, 512)]
    got = gemm_lt.preload(counts)
    assert got["classes"] >= 1 and got["shapes"] >= len(counts) and got["runs"] >= 1, got
    xs = [torch.randn(r, K, device="cuda", dtype=torch.bfloat16, generator=g) for r in counts]
    torch.cuda.synchronize()
    kernels = gemm_lt.report()["kernels"]
    torch.cuda._sleep(int(2e9))  # about a second of queued GPU work
    t0 = time.perf_counter()
    outs = [C.gemm_mm(x, w.t(), None, 0) for x in xs]
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert host < 0.2, f"the preloaded products waited {host:.3f} s for queued work"
    assert gemm_lt.report()["kernels"] == kernels  # no kernel the preload had not run
    for x, out in zip(xs, outs):
        torch.testing.assert_close(out.float(), x.float() @ w.float().t(), rtol=2e-2, atol=0.5)


def test_preload_leaves_out_the_skipped_size():
    g = torch.Generator(device="cuda").manual_seed(6)
    C = _C()
    w = torch.randn(2056, 520, device="cuda", dtype=torch.bfloat16, generator=g)
    C.gemm_mm(torch.randn(64, 520, device="cuda", dtype=torch.bfloat16, generator=g), w.t(), None, 0)
    skipped = gemm_lt.preload([136], skip_size=2056)
    every = gemm_lt.preload([136], skip_size=0)
    assert every["classes"] == skipped["classes"] + 1, (skipped, every)


def test_replays_in_a_cuda_graph():
    g = torch.Generator(device="cuda").manual_seed(2)
    C = _C()
    x = torch.randn(2048, 512, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(768, 512, device="cuda", dtype=torch.bfloat16, generator=g) * 0.1
    b = torch.randn(768, device="cuda", dtype=torch.bfloat16, generator=g)
    acc = torch.zeros(768, 512, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the handles made before the capture
        C.gemm_mm(x, w.t(), b, 0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = C.gemm_mm(x, w.t(), b, 0)
        C.gemm_mm_into(acc, y.t(), x, True, 1)
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", dtype=x.dtype, generator=g))
        acc.zero_()
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y.float(), x.float() @ w.float().t() + b.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(acc.float(), y.float().t() @ x.float(), rtol=2e-2, atol=0.5)
    assert gemm_lt.report()["refusals"] == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_off_is_aten_bit_for_bit(dtype):
    gemm_lt.disable()
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1000, 256, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(384, 256, device="cuda", dtype=dtype, generator=g)
    b = torch.randn(384, device="cuda", dtype=dtype, generator=g)
    C = _C()
    before = gemm_lt.report()
    assert torch.equal(C.gemm_mm(x, w.t(), b, 0), torch.addmm(b, x, w.t()))
    assert torch.equal(C.gemm_mm(x, w.t(), None, 0), torch.mm(x, w.t()))
    gy = torch.randn(1000, 384, device="cuda", dtype=dtype, generator=g)
    out, ref = torch.ones(384, 256, device="cuda", dtype=dtype), torch.ones(384, 256, device="cuda", dtype=dtype)
    C.gemm_mm_into(out, gy.t(), x, True, 1)
    assert torch.equal(out, ref.addmm_(gy.t(), x))
    r = gemm_lt.report()
    assert not r["on"] and r["shapes_lt"] == before["shapes_lt"], r


def test_operands_that_do_not_fit_go_through_aten():
    g = torch.Generator(device="cuda").manual_seed(4)
    C = _C()
    w = torch.randn(384, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    before = gemm_lt.report()
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
    r = gemm_lt.report()
    assert r["shapes_lt"] == before["shapes_lt"] and r["classes"] == before["classes"], r
