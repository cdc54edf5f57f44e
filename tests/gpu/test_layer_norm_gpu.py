import pytest
import torch
import torch.nn.functional as F

from ls_fairseq.ops import add_layer_norm, layer_norm, pre_layer_norm
from ls_fairseq.ops.layer_norm import add_layer_norm_reference, layer_norm_reference
from ._tols import DTYPES, assert_close_to_gold

pytestmark = pytest.mark.gpu

CS = [1, 7, 63, 1024, 1031, 4096, 8192]
ROWS = [1, 13, 4099]


def _leaf(t, dtype):
    return t.to(dtype).detach().requires_grad_(True)


def _gold_ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


def _gold_add_ln(x, r, w, b):
    s = x + r
    return _gold_ln(s, w, b), s


def _run(fn, inputs, gy, gs=None):
    out = fn(*inputs)
    if isinstance(out, tuple):
        loss = (out[0].double() * gy.double()).sum() + (out[1].double() * gs.double()).sum()
    else:
        loss = (out.double() * gy.double()).sum()
    grads = torch.autograd.grad(loss, inputs)
    return out, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", CS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_matches_reference(dtype, C, rows, residual):
    torch.manual_seed(rows * 10007 + C)
    dev = "cuda"
    x = torch.randn(rows, C, device=dev) * 2 + 0.5
    r = torch.randn(rows, C, device=dev)
    w = torch.rand(C, device=dev) + 0.5
    b = torch.randn(C, device=dev) * 0.1
    gy = torch.randn(rows, C, device=dev)
    gs = torch.randn(rows, C, device=dev)
    results = {}
    # gold: fp64 math on the same (dtype-rounded) inputs; lowp: PyTorch's reference run in dtype
    for name, dt, fns in (("fused", dtype, (add_layer_norm, layer_norm)),
                          ("lowp", dtype, (add_layer_norm_reference, layer_norm_reference)),
                          ("gold", torch.float64, (_gold_add_ln, _gold_ln))):
        cast = (lambda t: t.to(dtype).double()) if dt == torch.float64 else (lambda t: t.to(dt))
        if residual:
            inputs = [_leaf(cast(x), dt), _leaf(cast(r), dt), _leaf(cast(w), dt), _leaf(cast(b), dt)]
            results[name] = _run(fns[0], inputs, cast(gy), cast(gs))
        else:
            inputs = [_leaf(cast(x), dt), _leaf(cast(w), dt), _leaf(cast(b), dt)]
            results[name] = _run(fns[1], inputs, cast(gy))
    fo, fg = results["fused"]
    lo, lg = results["lowp"]
    go, gg = results["gold"]
    outs = (fo, lo, go) if not residual else None
    if residual:
        for k in range(2):
            assert fo[k].dtype == dtype
            assert_close_to_gold(fo[k], lo[k], go[k], dtype, f"out{k}")
    else:
        assert fo.dtype == dtype and fo.shape == x.shape
        assert_close_to_gold(*outs, dtype, "out")
    for k, (a, l, g) in enumerate(zip(fg, lg, gg)):
        assert_close_to_gold(a, l, g, dtype, f"grad{k}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", [7, 1024])
def test_pre_layer_norm_adds_the_residual_gradient(dtype, C):
    """(ln(x), x): the input's gradient is the layer norm's plus the pass-through's, in one kernel."""
    torch.manual_seed(C)
    x0 = torch.randn(3, 37, C, device="cuda") * 2 + 0.5
    w0, b0 = torch.rand(C, device="cuda") + 0.5, torch.randn(C, device="cuda") * 0.1
    gy, gr = torch.randn(3, 37, C, device="cuda"), torch.randn(3, 37, C, device="cuda")
    results = {}
    for name, dt in (("fused", dtype), ("lowp", dtype), ("gold", torch.float64)):
        cast = (lambda t: t.to(dtype).double()) if dt == torch.float64 else (lambda t: t.to(dt))
        x, w, b = _leaf(cast(x0), dt), _leaf(cast(w0), dt), _leaf(cast(b0), dt)
        if name == "fused":
            y, r = pre_layer_norm(x, w, b)
            assert r.data_ptr() == x.data_ptr()
        else:
            y, r = (_gold_ln(x, w, b) if name == "gold" else layer_norm_reference(x, w, b)), x
        loss = (y.double() * cast(gy).double()).sum() + (r.double() * cast(gr).double()).sum()
        results[name] = (y, torch.autograd.grad(loss, [x, w, b]))
    (fo, fg), (lo, lg), (go, gg) = results["fused"], results["lowp"], results["gold"]
    assert_close_to_gold(fo, lo, go, dtype, "out")
    for k in range(3):
        assert_close_to_gold(fg[k], lg[k], gg[k], dtype, f"grad{k}")
    # only the pass-through used: the layer norm's backward is skipped, dx is that gradient
    x = _leaf(x0.to(dtype), dtype)
    y, r = pre_layer_norm(x, _leaf(w0.to(dtype), dtype), _leaf(b0.to(dtype), dtype))
    (dx,) = torch.autograd.grad((r.float() * gr).sum(), [x])
    torch.testing.assert_close(dx, gr.to(dtype))


def test_layer_norm_3d_and_mixed_param_dtype():
    x = torch.randn(3, 5, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    w = torch.rand(64, device="cuda", requires_grad=True)  # fp32 params with fp16 activations
    b = torch.randn(64, device="cuda", requires_grad=True)
    y = layer_norm(x, w, b)
    assert y.dtype == torch.float16 and y.shape == x.shape
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32 and b.grad.dtype == torch.float32
    ref = layer_norm_reference(x.detach(), w.detach().half(), b.detach().half())
    torch.testing.assert_close(y.detach(), ref, atol=2e-3, rtol=2e-3)


def test_layer_norm_wider_than_kernel_falls_back_to_reference():
    x = torch.randn(2, 8200, device="cuda")
    w, b = torch.ones(8200, device="cuda"), torch.zeros(8200, device="cuda")
    torch.testing.assert_close(layer_norm(x, w, b), layer_norm_reference(x, w, b))


def test_kernel_argument_errors_raise_python_errors():
    # In a subprocess: a C++ exception that crashed the interpreter must fail this test, not the session.
    # The raw extension is called with arguments the Python ops would never pass; every check must raise
    # RuntimeError with its full message, and the interpreter must stay usable afterwards.
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from ls_fairseq import _ext\n"
        "C = _ext.get()\n"
        "assert C is not None, _ext.reason()\n"
        "cuda = lambda *s, dt=torch.float32: torch.randn(*s, device='cuda', dtype=dt)\n"
        "ln = C.layer_norm_fwd\n"
        "cases = [\n"
        "    (ln, (cuda(2, 8200), None, cuda(8200), cuda(8200), 1e-5),\n"
        "     'layer_norm_fwd: hidden size 8200 is outside the supported range [1, 8192]'),\n"
        "    (ln, (cuda(2, 8), cuda(3, 8), cuda(8), cuda(8), 1e-5),\n"
        "     'layer_norm_fwd: residual shape [3, 8] != x shape [2, 8]'),\n"
        "    (ln, (cuda(2, 8), cuda(2, 8, dt=torch.float16), cuda(8), cuda(8), 1e-5),\n"
        "     'layer_norm_fwd: *residual must be Float, got Half'),\n"
        "    (ln, (torch.randn(2, 8), None, cuda(8), cuda(8), 1e-5),\n"
        "     'layer_norm_fwd: x must be a CUDA tensor, got cpu'),\n"
        "    (ln, (cuda(2, 8), None, cuda(7), cuda(8), 1e-5),\n"
        "     'layer_norm_fwd: weight must have shape [8], got [7]'),\n"
        "    (ln, (cuda(2, 8, dt=torch.float64), None, cuda(8), cuda(8), 1e-5),\n"
        "     'layer_norm_fwd: unsupported dtype Double (float32, float16, bfloat16 only)'),\n"
        "    (C.bias_act_dropout_fwd, (cuda(2, 8), None, 'tanh', 0.5),\n"
        "     \"bias_act_dropout_fwd: unknown activation 'tanh' (relu, gelu, none)\"),\n"
        "    (C.bias_act_dropout_fwd, (cuda(2, 8), None, 'relu', 1.5),\n"
        "     'bias_act_dropout_fwd: dropout probability must be in [0, 1), got 1.5'),\n"
        "]\n"
        "for fn, args, msg in cases:\n"
        "    try:\n"
        "        fn(*args)\n"
        "    except RuntimeError as e:\n"
        "        assert msg in str(e), (msg, str(e))\n"
        "    else:\n"
        "        raise AssertionError('no error for: ' + msg)\n"
        "y = C.layer_norm_fwd(cuda(2, 8), None, torch.ones(8, device='cuda'), torch.zeros(8, device='cuda'), 1e-5)[0]\n"
        "assert torch.isfinite(y).all()\n"
        "print('raised')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "raised" in r.stdout, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
