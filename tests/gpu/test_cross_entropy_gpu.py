import pytest
import torch

from ls_fairseq.ops import label_smoothed_cross_entropy
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_reference as ref
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_with_grad as ce_with_grad
from ._tols import DTYPES, assert_close_to_gold

pytestmark = pytest.mark.gpu


def _assert_sums_and_grad(fused, low, gold, dtype, N):
    """(loss, nll, gradient) of the kernel against torch in the low precision and the fp32 gold; every third row
    ignored. Loss sums: the fp32 sum over rows of per-row values; allow fp32 summation-order error."""
    (fl, fn_, fg), (ll, ln, lg), (gl_, gn, gg) = fused, low, gold
    tol = 1e-5 * max(1.0, abs(gl_.item())) * max(1, N) ** 0.5
    for a, l, g in ((fl, ll, gl_), (fn_, ln, gn)):
        assert abs(a.item() - g.item()) <= 2 * abs(l.item() - g.item()) + tol + 1e-4 * abs(g.item())
    assert_close_to_gold(fg, lg, gg, dtype, "grad")
    if N > 1:
        assert fg[::3].abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1, 7, 31999, 32000])
@pytest.mark.parametrize("N", [1, 13, 1031])
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_matches_reference(dtype, V, N, eps):
    torch.manual_seed(V + N)
    logits = torch.randn(N, V, device="cuda") * 3
    target = torch.randint(0, V, (N,), device="cuda")
    if N > 1:
        target[::3] = -100  # ignored rows
    g_loss, g_nll = 0.7, 0.3
    res = []
    for dt, fn in ((dtype, label_smoothed_cross_entropy), (dtype, ref), (torch.float32, ref)):
        li = logits.to(dt).requires_grad_(True)
        loss, nll = fn(li, target, eps, -100)
        (gl,) = torch.autograd.grad(loss * g_loss + nll * g_nll, [li])
        res.append((loss, nll, gl))
    (fl, fn_, fg), (ll, ln, lg), (gl_, gn, gg) = res
    assert fl.dtype == torch.float32 and fl.dim() == 0
    assert fg.dtype == dtype
    _assert_sums_and_grad((fl, fn_, fg), (ll, ln, lg), (gl_, gn, gg), dtype, N)


def test_cross_entropy_3d_and_all_ignored():
    logits = torch.randn(2, 5, 11, device="cuda", requires_grad=True)
    target = torch.full((2, 5), 1, device="cuda")
    loss, nll = label_smoothed_cross_entropy(logits, target, 0.1, ignore_index=1)
    assert loss.item() == 0.0 and nll.item() == 0.0
    loss.backward()
    assert logits.grad.abs().max().item() == 0.0


def test_cross_entropy_extreme_logits_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0, 3.0]], device="cuda", dtype=torch.float16)
    loss, nll = label_smoothed_cross_entropy(logits.float(), torch.tensor([0], device="cuda"), 0.1)
    l2, n2 = ref(logits.float(), torch.tensor([0], device="cuda"), 0.1)
    torch.testing.assert_close(loss, l2, rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(nll, n2, rtol=1e-5, atol=1e-3)


# ------------------------------------------------------------------ loss and gradient in one kernel
# (N, V): V <= 2048 fits one group of 8 per thread of either kernel (see test_with_grad_equals_fwd_then_bwd)
WITH_GRAD_SHAPES = [(1, 1), (7, 8), (64, 37), (7, 2048), (7, 4099), (64, 32000)]


def _ce_inputs(N, V, seed):
    torch.manual_seed(seed)
    logits = torch.randn(N, V, device="cuda") * 3
    target = torch.randint(0, V, (N,), device="cuda")
    if N > 1:
        target[::3] = -100  # ignored rows
    return logits, target


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,V", WITH_GRAD_SHAPES)
@pytest.mark.parametrize("scale", [None, 128.0])
def test_with_grad_matches_reference(dtype, N, V, scale):
    logits, target = _ce_inputs(N, V, N * V)
    eps, s = 0.1, (1.0 if scale is None else scale)
    buf = logits.clone().to(dtype)  # (a copy: in fp32 .to would return logits itself, which the call overwrites)
    version = buf._version
    gs = None if scale is None else torch.tensor([scale], device="cuda")
    fl, fn_ = ce_with_grad(buf, target, eps, -100, gs)
    assert fl.dtype == torch.float32 and fl.dim() == 0 and buf.dtype == dtype and buf._version > version
    res = []
    for li in (logits.to(dtype), logits.clone()):  # torch in the low precision, and the fp32 gold
        li.requires_grad_(True)
        loss, nll = ref(li, target, eps, -100)
        (g,) = torch.autograd.grad(loss * s, [li])
        res.append((loss, nll, g))
    (ll, ln, lg), (gl_, gn, gg) = res
    _assert_sums_and_grad((fl, fn_, buf), (ll, ln, lg), (gl_, gn, gg), dtype, N)
    if V > 1:
        assert buf.abs().max().item() > 0.0


def _fwd_then_bwd(l2, target, eps, scale):
    """The gradient of scale * loss and the sums from ls_cross_entropy_fwd then ls_cross_entropy_bwd(g_nll = 0)."""
    from ls_fairseq import _ext

    mod = _ext.get()
    loss, nll, lse = mod.ls_cross_entropy_fwd(l2, target, eps, -100)
    g_loss, g_nll = torch.tensor(scale, device="cuda"), torch.zeros((), device="cuda")
    return loss, nll, mod.ls_cross_entropy_bwd(l2, target, lse, g_loss, g_nll, eps, -100, False)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N,V", WITH_GRAD_SHAPES)
@pytest.mark.parametrize("scale", [None, 128.0])
def test_with_grad_equals_fwd_then_bwd(dtype, N, V, scale):
    """Given lse the fused kernel's arithmetic is the forward's and the backward's, but it reduces a row over 512
    threads and the forward over 256. Up to V = 2048 (256 groups of 8) every thread of both holds the same group
    and the extra warps are empty, so the losses and the gradient are bitwise equal; above it the reduction order
    differs and lse (hence p) may differ in its last bits: the gradient within about an ulp of its dtype."""
    logits, target = _ce_inputs(N, V, N * V + 1)
    eps, s = 0.1, (1.0 if scale is None else scale)
    l2 = logits.to(dtype)
    loss_a, nll_a, grad_a = _fwd_then_bwd(l2, target, eps, s)
    buf = l2.clone()
    gs = None if scale is None else torch.tensor([scale], device="cuda")
    loss_b, nll_b = ce_with_grad(buf, target, eps, -100, gs)
    if V <= 2048:
        assert torch.equal(buf, grad_a)
        assert torch.equal(loss_b, loss_a) and torch.equal(nll_b, nll_a)
    else:
        rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        torch.testing.assert_close(buf.float(), grad_a.float(), rtol=rtol, atol=3e-5 * s)
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(nll_b, nll_a, rtol=1e-5, atol=1e-5)
    if N > 1:
        assert buf[::3].abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [37, 4099])
def test_with_grad_target_out_of_range_gives_nan(dtype, V):
    logits, target = _ce_inputs(7, V, V)
    target[1], target[2] = V, -5  # outside [0, V), not ignore_index
    l2 = logits.to(dtype)
    loss_a, nll_a, grad_a = _fwd_then_bwd(l2, target, 0.1, 1.0)
    buf = l2.clone()
    loss, nll = ce_with_grad(buf, target, 0.1, -100)
    assert loss.isnan().item() and nll.isnan().item() and loss_a.isnan().item() and nll_a.isnan().item()
    # the gradient is the backward's: finite, without the target term in those rows
    assert buf.isfinite().all().item() and buf[::3].abs().max().item() == 0.0
    rtol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(buf.float(), grad_a.float(), rtol=rtol, atol=3e-5)


def test_with_grad_checks_its_arguments():
    from ls_fairseq import _ext

    mod = _ext.get()
    logits, target = torch.randn(4, 16, device="cuda"), torch.zeros(4, dtype=torch.long, device="cuda")
    for gs, msg in ((torch.ones(2, device="cuda"), "1-element float32"),
                    (torch.ones(1, device="cuda", dtype=torch.float16), "1-element float32"),
                    (torch.ones(1), "grad_scale must be on")):
        with pytest.raises(RuntimeError, match=msg):
            mod.ls_cross_entropy_fwd_bwd(logits, target, 0.1, -100, gs)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        mod.ls_cross_entropy_fwd_bwd(torch.randn(16, 4, device="cuda").t(), target, 0.1, -100, None)
    # the public op moves a host or fp64 scale to the device as fp32
    a, b = logits.clone(), logits.clone()
    la, _ = ce_with_grad(a, target, 0.1, -100, torch.tensor(4.0, dtype=torch.float64))
    lb, _ = ce_with_grad(b, target, 0.1, -100, torch.tensor([4.0], device="cuda"))
    assert torch.equal(a, b) and torch.equal(la, lb) and a.abs().max().item() > 0
