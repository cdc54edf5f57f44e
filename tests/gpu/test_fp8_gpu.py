"""FP8 on the GPU: the quantisation kernel bit for bit against the reference, the FP8 linear node against
the reference that quantises the same way (forward and both gradients, odd row counts), whole layers, and
lightseq-train --fp8 with the CUDA-graph step."""

import os
import re
import subprocess
import sys

import pytest
import torch

from ls_fairseq.ops import fp8

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _needs_fp8():
    if torch.cuda.get_device_capability() < fp8.MIN_CAPABILITY:
        pytest.skip("no FP8 tensor cores on this GPU")


def _codes(q):
    return q.view(torch.uint8)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 8, 13, 4096, 1000003])
def test_quantize_kernel_is_the_reference_bit_for_bit(fmt, dtype, n):
    g = torch.Generator(device="cuda").manual_seed(n)
    x = (torch.randn(n, device="cuda", generator=g) * 7).to(dtype)
    q, s = fp8._ext.get().fp8_quantize(x, fmt)
    q_ref, s_ref = fp8.fp8_quantize_reference(x, fmt)
    assert q.dtype == fp8.FP8_DTYPES[fmt] and s.dtype == torch.float32
    assert float(s) == float(s_ref)
    assert torch.equal(_codes(q), _codes(q_ref))


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_quantize_kernel_unaligned_and_special_values(fmt):
    base = torch.randn(4099, device="cuda", dtype=torch.bfloat16)
    x = base[3:]  # 6 bytes past an aligned start: the scalar path
    q, s = fp8._ext.get().fp8_quantize(x, fmt)
    q_ref, s_ref = fp8.fp8_quantize_reference(x, fmt)
    assert float(s) == float(s_ref) and torch.equal(_codes(q), _codes(q_ref))
    z = torch.zeros(100, device="cuda", dtype=torch.float16)
    q, s = fp8._ext.get().fp8_quantize(z, fmt)
    assert float(s) == 1.0 and torch.equal(_codes(q), torch.zeros_like(_codes(q)))
    for bad in (float("inf"), float("nan")):
        y = torch.ones(64, device="cuda", dtype=torch.float16)
        y[17] = bad
        q, s = fp8._ext.get().fp8_quantize(y, fmt)
        assert torch.isnan(s) and torch.isnan(q.float()).all()


def _bound(a, b):
    """|a| |b|^T: the scale of what accumulating the products can cost."""
    return a.abs() @ b.abs().t()


# Hopper's FP8 tensor cores add products in an accumulator of about 14 significant bits between the
# promotions to fp32: allow 2^-11 of the sum of the products' magnitudes for the accumulation, on top of
# half an ulp of the output dtype. A wrong scale or code is off by far more (e4m3 alone rounds by 2^-4).
ACC = 2.0 ** -11


@pytest.mark.parametrize("grad_format", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,K,N,bias", [(1, 16, 16, False), (37, 64, 48, True), (3 * 61, 1024, 4096, False),
                                            (1031, 4096, 1024, True)])
def test_fp8_linear_against_the_reference(grad_format, dtype, rows, K, N, bias):
    g = torch.Generator(device="cuda").manual_seed(rows + K)
    x = torch.randn(rows, K, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(N, device="cuda", generator=g).to(dtype).requires_grad_() if bias else None
    dy = torch.randn(rows, N, device="cuda", generator=g).to(dtype)
    y = fp8._ext.get().ag_fp8_linear(x, w, b, grad_format)
    y.backward(dy)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    br = b.detach().clone().requires_grad_() if bias else None
    yr = fp8.fp8_linear_reference(xr, wr, br, grad_format)
    yr.backward(dy)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    # forward: the same FP8 codes; the GPU accumulates in fp32 (fast accumulation) and rounds once
    xq, sx = fp8.fp8_quantize_reference(x.detach(), fp8.E4M3)
    wq, sw = fp8.fp8_quantize_reference(w.detach(), fp8.E4M3)
    xd, wd = xq.float() * sx, wq.float() * sw
    gold = xd @ wd.t() + (b.detach().float() if bias else 0)
    tol = ulp * gold.abs() + ACC * _bound(xd, wd) + 1e-6
    assert torch.all((y.float() - gold).abs() <= tol), (y.float() - gold).abs().max()
    assert torch.all((y.float() - yr.float()).abs() <= 2 * tol)
    # input gradient: FP8 codes of dy in the gradient format against the e4m3 W
    gq, sg = fp8.fp8_quantize_reference(dy, grad_format)
    gd = gq.float() * sg
    gold_dx = gd @ wd
    tol = ulp * gold_dx.abs() + ACC * _bound(gd, wd.t()) + 1e-6
    assert torch.all((x.grad.float() - gold_dx).abs() <= tol), (x.grad.float() - gold_dx).abs().max()
    # weight gradient: the high-precision product (a GEMM in dtype)
    gold_dw = dy.float().t() @ x.detach().float()
    tol = ulp * (gold_dw.abs() + 2 ** -6 * _bound(dy.float().t(), x.detach().float().t())) + 1e-6  # bf16/fp16 GEMM
    assert torch.all((w.grad.float() - gold_dw).abs() <= tol)
    if bias:
        torch.testing.assert_close(b.grad.float(), dy.float().sum(0), rtol=ulp, atol=ulp * rows ** 0.5)


def test_fp8_linear_errors():
    mod = fp8._ext.get()
    x = torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        mod.ag_fp8_linear(x, torch.randn(20, 32, device="cuda", dtype=torch.bfloat16), None, 0)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        mod.ag_fp8_linear(x.float(), torch.randn(16, 32, device="cuda"), None, 0)
    with pytest.raises(RuntimeError, match="format"):
        mod.ag_fp8_linear(x, torch.randn(16, 32, device="cuda", dtype=torch.bfloat16), None, 5)


def _layers(fp8_mode, dtype=torch.bfloat16, seed=0):
    from ls_fairseq.modules.decoder_layer import BatchedCrossKV, DecoderLayer
    from ls_fairseq.modules.encoder_layer import EncoderLayer

    torch.manual_seed(seed)
    enc = EncoderLayer(256, 1024, 4, dropout=0.0).cuda().to(dtype)
    dec = DecoderLayer(256, 1024, 4, dropout=0.0).cuda().to(dtype)
    kv = BatchedCrossKV(256, 4, 1).cuda().to(dtype)
    for m in (enc, dec, kv, enc.self_attn, dec.self_attn, dec.encoder_attn):
        m.fp8 = fp8_mode
    return enc, dec, kv


@pytest.mark.parametrize("mode", [1, 2])
def test_layers_fp8_close_to_bf16_and_cpp_equals_python(mode, monkeypatch):
    from ls_fairseq.ops import _dispatch

    x = torch.randn(6, 29, 256, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(6, 31, 256, device="cuda", dtype=torch.bfloat16)
    probe = torch.randn(6, 29, 256, device="cuda")

    def run(fp8_mode, cpp=True):
        monkeypatch.setattr(_dispatch, "_CPP_LAYERS", cpp)
        enc, dec, kv = _layers(fp8_mode)
        xi, si = x.clone().requires_grad_(), src.clone().requires_grad_()
        e = enc(si)
        k, v = kv(e)
        out = dec(xi, k, v)
        (out.float() * probe).sum().backward()  # a random direction (a post-LN output's mean square is ~1)
        grads = [p.grad for m in (enc, dec, kv) for p in m.parameters()]
        return out.detach(), xi.grad, si.grad, grads

    ref = run(0)
    got = run(mode)
    py = run(mode, cpp=False)
    # the C++ layer call records the same nodes as the Python layers: identical results
    assert torch.equal(got[0], py[0]) and torch.equal(got[1], py[1]) and torch.equal(got[2], py[2])
    assert all(torch.equal(a, b) for a, b in zip(got[3], py[3]))
    # and FP8 stays close to bf16: a few per cent where e4m3 / e5m2 round
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
    assert rel(got[0], ref[0]) < 0.05
    assert rel(got[1], ref[1]) < 0.15 and rel(got[2], ref[2]) < 0.15
    flat = lambda grads: torch.cat([g.float().flatten() for g in grads])  # noqa: E731
    assert rel(flat(got[3]), flat(ref[3])) < 0.15  # all parameter gradients together (some are ~0 alone)
    # in eval mode FP8 is off
    enc, _, _ = _layers(mode)
    enc0, _, _ = _layers(0)
    enc.eval()
    enc0.eval()
    with torch.no_grad():
        assert torch.equal(enc(x), enc0(x))


def test_lightseq_train_fp8_with_graph_step(corpus, tmp_path):
    from tests._models import SMALL_LS_TRAIN, train_inner_records

    cmd = [sys.executable, "-m", "ls_fairseq.cli.train", corpus, *SMALL_LS_TRAIN, "--max-tokens", "2048", "--max-update", "150", "--seed", "1",
           "--log-format", "json", "--log-interval", "1", "--num-workers", "1", "--save-dir", str(tmp_path / "ck"),
           "--ls-graph-buckets", "12", "--bf16", "--fp8"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    assert re.search(r"CUDA-graph step: [1-9]\d* micro-batches from [1-9]\d* captured buckets", out), out[-3000:]
    losses = [float(r["loss"]) for _, r in sorted(train_inner_records(out).items())]
    assert len(losses) >= 100 and all(l == l for l in losses)
    assert losses[-1] < losses[0] - 1.0  # it learns
    # the checkpoint holds plain weights: it loads and validates without --fp8 machinery
    sd = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
    assert all(t.dtype in (torch.float32, torch.float16, torch.bfloat16) for t in sd.values() if t.is_floating_point())
