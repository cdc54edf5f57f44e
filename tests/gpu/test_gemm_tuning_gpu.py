"""GEMM tuning (csrc/torch/gemm.cpp) on a GPU: each form of product against the ATen call it replaces, the choices
kept and restored, captures, and lightseq-train with its choices in the cache file and the checkpoints."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from tests._models import SMALL_LS_TRAIN, train_inner_records

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRID = [256, 512]


@pytest.fixture
def ext():
    from ls_fairseq import _ext

    mod = _ext.get()
    if not mod.gemm_tuning_available():
        pytest.fail("cuBLASLt not found for GEMM tuning on a CUDA machine")
    mod.gemm_tuning_clear()
    mod.gemm_tuning_enable(GRID, 8)
    yield mod
    mod.gemm_tuning_disable()
    mod.gemm_tuning_clear()


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * 0.5).to(dtype)


def _close(a, b, dtype):
    tol = {torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.float().abs().max().item())


def _measured(mod):
    return mod.gemm_tuning_report()[4]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [512, 400])  # on a grid point; between two
def test_products_match_aten(ext, dtype, rows):
    K, N = 256, 768
    x, w, b = _rand(rows, K, dtype=dtype), _rand(N, K, dtype=dtype, seed=1), _rand(N, dtype=dtype, seed=2)
    g = _rand(rows, N, dtype=dtype, seed=3)
    # 5 classes: forward (x W^T, with and without bias), input gradient (g W), weight gradient (g^T x, written
    # or into a tensor: one class), added into a tensor
    _close(ext.gemm_mm(x, w.t(), None, 0), torch.mm(x, w.t()), dtype)
    _close(ext.gemm_mm(x, w.t(), b, 0), torch.addmm(b, x, w.t()), dtype)
    _close(ext.gemm_mm(g, w, None, 0), torch.mm(g, w), dtype)
    _close(ext.gemm_mm(g.t(), x, None, 1), torch.mm(g.t(), x), dtype)
    out = torch.full((N, K), 0.25, device="cuda", dtype=dtype)
    ext.gemm_mm_into(out, g.t(), x, True, 1)
    _close(out, torch.addmm(torch.full((N, K), 0.25, device="cuda", dtype=dtype), g.t(), x), dtype)
    ext.gemm_mm_into(out, g.t(), x, False, 1)
    _close(out, torch.mm(g.t(), x), dtype)
    classes, decisions, lt, seconds, points, _, _ = ext.gemm_tuning_report()
    assert classes == 5 and decisions == 5 * len(GRID) and points == decisions and seconds > 0
    assert 0 <= lt <= decisions
    # measured once: the same products again measure nothing more and give the same values bit for bit
    again = ext.gemm_mm(x, w.t(), None, 0)
    assert _measured(ext) == points
    assert torch.equal(again, ext.gemm_mm(x, w.t(), None, 0))


def test_products_outside_tuning_are_atens_bit_for_bit(ext):
    x, w = _rand(512, 256), _rand(768, 256, seed=1)
    ext.gemm_tuning_disable()
    assert torch.equal(ext.gemm_mm(x, w.t(), None, 0), torch.mm(x, w.t()))
    assert _measured(ext) == 0
    ext.gemm_tuning_enable(GRID, 8)
    # shapes tuning does not take (sizes not multiples of 8, fp32, a non-dense operand): ATen, nothing measured
    for a, b in [(_rand(100, 250), _rand(250, 30)), (_rand(64, 64, dtype=torch.float32), _rand(64, 64,
                                                                                                dtype=torch.float32)),
                 (_rand(64, 128)[:, :64], _rand(64, 64))]:
        assert torch.equal(ext.gemm_mm(a, b, None, 0), torch.mm(a, b))
    assert _measured(ext) == 0


def test_choices_are_kept_and_restored(ext):
    x, w = _rand(512, 256), _rand(768, 256, seed=1)
    y = ext.gemm_mm(x, w.t(), None, 0)
    rows = ext.gemm_tuning_state()
    assert len(rows) == len(GRID) and all(len(r) == 22 for r in rows)
    ext.gemm_tuning_clear()
    ext.gemm_tuning_load(rows)
    assert sorted(map(tuple, ext.gemm_tuning_state())) == sorted(map(tuple, rows))
    assert torch.equal(ext.gemm_mm(x, w.t(), None, 0), y)  # the same algorithm: the same bits
    assert _measured(ext) == 0  # loaded, not measured
    with pytest.raises(RuntimeError, match="values"):
        ext.gemm_tuning_load([[1, 2, 3]])


def test_capture_takes_aten_until_measured_then_the_choice(ext):
    x, w = _rand(512, 256), _rand(768, 256, seed=1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.mm(x, w.t())  # cuBLAS's handle and workspace before the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ext.gemm_mm(x, w.t(), None, 0)
    g.replay()
    assert _measured(ext) == 0  # never measured under capture
    assert torch.equal(y, torch.mm(x, w.t()))
    eager = ext.gemm_mm(x, w.t(), None, 0)  # measured now
    assert _measured(ext) == len(GRID)
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2):
        y2 = ext.gemm_mm(x, w.t(), None, 0)
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(y2, eager)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 tensor cores (Ada / Hopper)")
def test_fp8_products_match_aten(ext):
    M, K, N = 512, 256, 768
    xq = _rand(M, K).float().to(torch.float8_e4m3fn)
    wq = _rand(N, K, seed=1).float().to(torch.float8_e4m3fn)
    gq = _rand(M, N, seed=2).float().to(torch.float8_e5m2)
    s1, s2 = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    b = _rand(N, seed=3)
    x_t, w_t, g_t = xq.float().t().contiguous().to(torch.float8_e4m3fn), wq.float().t().contiguous().to(
        torch.float8_e4m3fn), gq.float().t().contiguous().to(torch.float8_e5m2)
    cases = [(xq, wq.t(), b, 0), (gq, w_t.t(), None, 0), (g_t, x_t.t(), None, 1)]
    for a, bb, bias, token in cases:
        ref = torch._scaled_mm(a, bb, s1, s2, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True)
        _close(ext.gemm_scaled(a, bb, s1, s2, bias, torch.bfloat16, token), ref, torch.bfloat16)
    assert ext.gemm_tuning_report()[0] == 3
    # through the FP8 linear layer (its three GEMMs go through the tuner)
    from ls_fairseq.ops.fp8 import Fp8State, fp8_linear

    st = Fp8State(1, 1)
    st.begin_forward(torch.device("cuda"))
    x = _rand(M, K, seed=4).requires_grad_(True)
    w = _rand(N, K, seed=5).requires_grad_(True)
    y = fp8_linear(x, w, None, st.use(0))
    y.backward(_rand(M, N, seed=6))
    ext.gemm_tuning_disable()
    st2 = Fp8State(1, 1)
    st2.begin_forward(torch.device("cuda"))
    x2, w2 = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y2 = fp8_linear(x2, w2, None, st2.use(0))
    y2.backward(_rand(M, N, seed=6))
    _close(y, y2, torch.bfloat16)
    _close(x.grad, x2.grad, torch.bfloat16)
    _close(w.grad, w2.grad, torch.bfloat16)


def _train(corpus, save, cache, *flags, updates=30):
    cmd = [sys.executable, "-m", "ls_fairseq.cli.train", corpus, *SMALL_LS_TRAIN, "--bf16", "--max-tokens", "2048",
           "--max-update", str(updates), "--seed", "1", "--disable-validation", "--log-format", "json",
           "--log-interval", "1", "--num-workers", "1", "--save-dir", str(save), "--ls-graph-buckets", "8", *flags]
    env = dict(os.environ, XDG_CACHE_HOME=str(cache))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    records = train_inner_records(out)
    return [float(records[k]["loss"]) for k in sorted(records)], out


def test_lightseq_train_keeps_its_choices(corpus, tmp_path):
    cache = tmp_path / "cache"
    a, out_a = _train(corpus, tmp_path / "a", cache, "--no-save")
    assert "GEMM tuning on" in out_a and re.search(r"GEMM tuning: \d+ classes of product measured", out_a), out_a[-3000:]
    files = list((cache / "ls_fairseq").glob("gemm-*.json"))
    assert len(files) == 1 and json.load(open(files[0]))["rows"]
    b, out_b = _train(corpus, tmp_path / "b", cache, "--no-save")
    assert "choices loaded from" in out_b and "classes of product measured" not in out_b, out_b[-3000:]
    assert a == b and len(a) >= 25  # the same choices: the same run bit for bit
    # checkpoints carry the choices; a resumed run takes them over the cache file's
    _, out_c = _train(corpus, tmp_path / "c", cache, updates=20)
    ckpt = torch.load(tmp_path / "c" / "checkpoint_last.pt", map_location="cpu", weights_only=False)
    assert ckpt["extra_state"]["ls_gemm_tuning"]["rows"]
    _, out_d = _train(corpus, tmp_path / "c", cache, updates=30)
    assert "choices taken from the checkpoint" in out_d, out_d[-3000:]
    off, out_off = _train(corpus, tmp_path / "e", tmp_path / "cache_off", "--no-save", "--ls-gemm-tuning", "off")
    assert "GEMM tuning" not in out_off and not (tmp_path / "cache_off").exists()
