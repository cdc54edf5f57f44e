import numpy as np
import pytest
import torch

from ls_fairseq.ops import bias_act_dropout, bias_dropout_residual
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout_reference
from ls_fairseq.ops.bias_dropout_residual import bias_dropout_residual_reference
from ._tols import DTYPES, assert_close_to_gold, keep_rate_ok
from _philox import keep_mask

pytestmark = pytest.mark.gpu

CS = [1, 7, 63, 1024, 1031, 4096]
ROWS = [1, 13, 4099]


def _leaf(t, dt):
    return None if t is None else t.to(dt).detach().requires_grad_(True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", CS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_bias_dropout_residual(dtype, C, rows, p, with_bias):
    torch.manual_seed(C * 31 + rows)
    x = torch.randn(rows, C, device="cuda")
    bias = torch.randn(C, device="cuda") if with_bias else None
    res = torch.randn(rows, C, device="cuda")
    g = torch.randn(rows, C, device="cuda")
    xf, bf, rf = _leaf(x, dtype), _leaf(bias, dtype), _leaf(res, dtype)
    out, mask = bias_dropout_residual(xf, bf, rf, p=p, training=True, return_mask=True)
    if p == 0:
        assert mask is None
    else:
        assert mask.dtype == torch.bool and mask.shape == x.shape
        if rows * C > 10000:
            assert keep_rate_ok(mask, p)
    inputs_f = [t for t in (xf, bf, rf) if t is not None]
    grads_f = torch.autograd.grad((out.float() * g).sum(), inputs_f)
    res_all = []
    for dt in (dtype, torch.float32):
        xi, bi, ri = _leaf(x, dt), _leaf(bias, dt), _leaf(res, dt)
        o = bias_dropout_residual_reference(xi, bi, ri, p=p, training=True, mask=mask)
        ins = [t for t in (xi, bi, ri) if t is not None]
        res_all.append((o, torch.autograd.grad((o.float() * g).sum(), ins)))
    (lo, lg), (go, gg) = res_all
    assert out.dtype == dtype
    assert_close_to_gold(out, lo, go, dtype, "out")
    for k, (a, l, gd) in enumerate(zip(grads_f, lg, gg)):
        assert_close_to_gold(a, l, gd, dtype, f"grad{k}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", CS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_bias_act_dropout(dtype, C, rows, activation, p):
    torch.manual_seed(C * 17 + rows)
    x = torch.randn(rows, C, device="cuda")
    bias = torch.randn(C, device="cuda")
    g = torch.randn(rows, C, device="cuda")
    xf, bf = _leaf(x, dtype), _leaf(bias, dtype)
    out, mask = bias_act_dropout(xf, bf, activation, p=p, training=True, return_mask=True)
    if p > 0 and rows * C > 10000:
        assert keep_rate_ok(mask, p)
    grads_f = torch.autograd.grad((out.float() * g).sum(), [xf, bf])
    res_all = []
    for dt in (dtype, torch.float32):
        xi, bi = _leaf(x, dt), _leaf(bias, dt)
        o = bias_act_dropout_reference(xi, bi, activation, p=p, training=True, mask=mask)
        res_all.append((o, torch.autograd.grad((o.float() * g).sum(), [xi, bi])))
    (lo, lg), (go, gg) = res_all
    assert_close_to_gold(out, lo, go, dtype, "out")
    for k, (a, l, gd) in enumerate(zip(grads_f, lg, gg)):
        assert_close_to_gold(a, l, gd, dtype, f"grad{k}")


def test_eval_mode_is_deterministic_identity_dropout():
    x = torch.randn(5, 64, device="cuda")
    r = torch.randn(5, 64, device="cuda")
    out = bias_dropout_residual(x, None, r, p=0.5, training=False)
    torch.testing.assert_close(out, x + r)


@pytest.mark.parametrize("op", ["bdr", "bad"])
def test_manual_seed_reproduces_mask_and_seeds_differ(op):
    x = torch.randn(257, 1031, device="cuda", dtype=torch.float16)

    def run(seed):
        torch.manual_seed(seed)
        if op == "bdr":
            return bias_dropout_residual(x, None, x, p=0.25, return_mask=True)[1]
        return bias_act_dropout(x, None, "relu", p=0.25, return_mask=True)[1]

    a, b, c = run(1234), run(1234), run(1235)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    torch.manual_seed(7)
    m1 = bias_dropout_residual(x, None, x, p=0.25, return_mask=True)[1]
    m2 = bias_dropout_residual(x, None, x, p=0.25, return_mask=True)[1]
    assert not torch.equal(m1, m2), "consecutive calls must draw fresh masks"
    assert keep_rate_ok(a, 0.25)


@pytest.mark.parametrize("op", ["bdr", "bad"])
@pytest.mark.parametrize("p", [0.1, 0.5, 1 - 2**-16, 1 - 2**-22])
@pytest.mark.parametrize("shape", [(13, 1031), (64, 1024)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_masks_are_the_philox_draws_against_the_threshold(op, p, shape, dtype):
    """The keep masks bit for bit tests/_philox.py's: Philox4x32-10 over the 8-element groups (counter: the group and
    the generator's offset, key: its seed), 16 bits an element against round(p * 65536), for two launches after
    manual_seed (offsets 0 and 4); p = 1 - 2^-16 keeps only the draws of 65535, 1 - 2^-22 rounds to 65536 and keeps
    nothing. The vectorised and the element-wise launches (C a multiple of 8 or not) alike."""
    x = torch.randn(*shape, device="cuda").to(dtype)
    seed = 20241128

    def call():
        if op == "bdr":
            return bias_dropout_residual(x, None, x, p=p, return_mask=True)[1]
        return bias_act_dropout(x, None, "relu", p=p, return_mask=True)[1]

    torch.manual_seed(seed)
    masks = [call(), call()]
    for k, m in enumerate(masks):
        ref = keep_mask(x.numel(), p, seed, 4 * k).reshape(shape)
        got = m.cpu().numpy()
        assert got.dtype == np.bool_ and got.shape == shape
        assert np.array_equal(got, ref), f"launch {k}: {(got != ref).sum()} of {got.size} keep bits differ"


def test_saved_state_is_compact():
    # relu saves only its output; gelu saves x, bias and a bitmask (1 bit per element), never a
    # full-size mask in the activation dtype.
    # (the saved-tensor hooks see what a node saves, C++ autograd node or Python Function alike)
    x = torch.randn(64, 1024, device="cuda", dtype=torch.float16, requires_grad=True)
    for act in ("gelu", "relu"):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = bias_act_dropout(x, None, act, p=0.1)
        masks = [t for t in saved if t.dtype == torch.uint8]
        full = [t for t in saved if t.numel() == x.numel()]
        if act == "gelu":
            assert len(masks) == 1 and masks[0].numel() == x.numel() // 8 and len(full) == 1
        else:
            assert not masks and len(full) == 1 and full[0].data_ptr() == out.data_ptr()
