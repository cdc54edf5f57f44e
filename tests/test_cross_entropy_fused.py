"""label_smoothed_cross_entropy_with_grad on CPU (its reference path): the loss sums of the reference, and the
gradient of grad_scale * loss written over the logits, against autograd and the closed form
d loss / d x_v = p_v * (1 - eps - eps_i + V * eps_i) - eps_i - [v == t] * (1 - eps - eps_i)."""

import pytest
import torch

from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_reference as reference
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_with_grad as ce_with_grad

PAD = 1


def _inputs(N, V, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(N, V, generator=g, dtype=torch.float64) * 3).to(dtype)
    target = torch.randint(0, V, (N,), generator=g)
    target[::3] = PAD  # rows 0, 3, 6, ... ignored
    return logits, target


def _closed_form(logits, target, eps, scale):
    V = logits.shape[1]
    eps_i = eps / (V - 1) if V > 1 else 0.0
    p = torch.softmax(logits.double(), -1)
    onehot = torch.zeros_like(p)
    keep = target != PAD
    onehot[keep, target[keep]] = 1.0
    g = p * (1 - eps - eps_i + V * eps_i) - eps_i - onehot * (1 - eps - eps_i)
    return (g * keep.unsqueeze(1)) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("N,V", [(9, 37), (5, 4099), (7, 1), (2, 8)])
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("scale", [None, 128.0])
def test_loss_and_gradient_match_the_reference_and_autograd(dtype, N, V, eps, scale):
    logits, target = _inputs(N, V, dtype, seed=N * V)
    x = logits.clone().requires_grad_(True)
    ref_loss, ref_nll = reference(x, target, eps, PAD)
    s = 1.0 if scale is None else scale
    (ref_grad,) = torch.autograd.grad(ref_loss * s, x)

    buf = logits.clone()
    ptr, version = buf.data_ptr(), buf._version
    gs = None if scale is None else torch.tensor([scale], dtype=torch.float32)
    loss, nll = ce_with_grad(buf, target, eps, PAD, gs)

    assert loss.dtype == ref_loss.dtype and loss.dim() == 0 and not loss.requires_grad
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(nll, ref_nll.detach())
    assert buf.data_ptr() == ptr and buf.dtype == dtype and buf._version > version  # written in place
    torch.testing.assert_close(buf, ref_grad)
    tol = dict(rtol=1e-5, atol=1e-5 * s) if dtype == torch.float32 else {}
    torch.testing.assert_close(buf.double(), _closed_form(logits, target, eps, s), **tol)
    ignored = target == PAD
    assert buf[ignored].abs().max().item() == 0.0
    if V > 1:
        assert buf[~ignored].abs().max().item() > 0.0  # (V == 1: the gradient is 0 everywhere)
    if V == 1:
        assert loss.item() == 0.0 and nll.item() == 0.0 and buf.abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_logits_get_the_fp32_gradient_rounded_once(dtype):
    logits, target = _inputs(6, 37, dtype, seed=3)
    x = logits.float().requires_grad_(True)
    ref_loss, ref_nll = reference(x, target, 0.1, PAD)
    (g32,) = torch.autograd.grad(ref_loss * 128.0, x)
    buf = logits.clone()
    loss, nll = ce_with_grad(buf, target, 0.1, PAD, torch.tensor([128.0]))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss.detach())
    torch.testing.assert_close(nll, ref_nll.detach())
    assert torch.equal(buf, g32.to(dtype))


def test_grad_scale_as_a_number_or_a_0_dim_tensor():
    logits, target = _inputs(4, 11, torch.float64, seed=5)
    outs = []
    for gs in (2.5, torch.tensor(2.5), torch.tensor([2.5], dtype=torch.float64)):
        buf = logits.clone()
        loss, _ = ce_with_grad(buf, target, 0.1, PAD, gs)
        outs.append((loss, buf))
    base = logits.clone()
    loss1, _ = ce_with_grad(base, target, 0.1, PAD)
    for loss, buf in outs:
        torch.testing.assert_close(loss, loss1)  # the scale does not change the loss
        torch.testing.assert_close(buf, base * 2.5)


def test_all_ignored_and_leaf_requiring_grad():
    logits = torch.randn(3, 5, requires_grad=True)
    with torch.no_grad():
        before = logits.clone()
    loss, nll = ce_with_grad(logits, torch.full((3,), PAD), 0.1, PAD)  # no autograd error on the leaf
    assert loss.item() == 0.0 and nll.item() == 0.0
    assert logits.abs().max().item() == 0.0 and before.abs().max().item() > 0.0
    assert logits.grad is None and not loss.requires_grad


@pytest.mark.parametrize("call,msg", [
    (lambda: ce_with_grad(torch.zeros(2, 3, 8), torch.zeros(2, 3, dtype=torch.long)), "must be 2-D"),
    (lambda: ce_with_grad(torch.zeros(8), torch.zeros((), dtype=torch.long)), "must be 2-D"),
    (lambda: ce_with_grad(torch.zeros(4, 8), torch.zeros(3, dtype=torch.long)), "do not match target"),
    (lambda: ce_with_grad(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long), 1.0), "must be in \\[0, 1\\)"),
    (lambda: ce_with_grad(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long), -0.1), "must be in \\[0, 1\\)"),
    (lambda: ce_with_grad(torch.zeros(8, 4).t(), torch.zeros(4, dtype=torch.long)), "must be contiguous"),
    (lambda: ce_with_grad(torch.zeros(4, 0), torch.zeros(4, dtype=torch.long)), "vocabulary must not be empty"),
    (lambda: ce_with_grad(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long), 0.1, -100, torch.ones(2)),
     "grad_scale must have 1 element"),
])
def test_bad_inputs_raise_value_error(call, msg):
    with pytest.raises(ValueError, match=msg):
        call()
