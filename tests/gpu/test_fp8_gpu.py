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


def _mod():
    return fp8._ext.get()


def _state_with_history(rows, amaxes, grad_format):
    """A state whose rows have rolled once with the given maxima (a delayed-scaling state)."""
    st = torch.zeros(rows, fp8.WIDTH, device="cuda")
    st[:, fp8.AMAX] = torch.as_tensor(amaxes, dtype=torch.float32, device="cuda")
    _mod().fp8_roll(st, grad_format)
    return st


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,K", [(1, 16), (7, 32), (13, 48), (64, 64), (100, 1040), (4099, 256), (1000, 1024)])
@pytest.mark.parametrize("current", [True, False], ids=["current", "delayed"])
def test_quantize_kernel_is_the_reference_bit_for_bit(fmt, dtype, M, K, current):
    g = torch.Generator(device="cuda").manual_seed(M * K)
    x = (torch.randn(M, K, device="cuda", generator=g) * 7).to(dtype)
    # delayed: a history whose maximum is below this tensor's, so some codes saturate
    st = _state_with_history(3, [0.0, 0.0, 0.0] if current else [5.0, 5.0, 5.0], fmt)
    ref = st.clone()
    q, q_t = _mod().fp8_quantize(x, st, 2, fmt, current, True, True)
    q_ref, q_t_ref = fp8.fp8_quantize_reference(x, ref, 2, fmt, current)
    assert q.dtype == fp8.FP8_DTYPES[fmt] and q_t.shape == (K, (M + 15) // 16 * 16)
    assert torch.equal(_codes(q), _codes(q_ref))
    assert torch.equal(_codes(q_t), _codes(q_t_ref))
    assert torch.equal(st, ref)  # the recorded maximum, the scale and 1/s
    # one output alone gives the same codes
    st2 = _state_with_history(3, [0.0, 0.0, 0.0] if current else [5.0, 5.0, 5.0], fmt)
    only_t = _mod().fp8_quantize(x, st2, 2, fmt, current, False, True)[1]
    assert torch.equal(_codes(only_t), _codes(q_t)) and torch.equal(st2, st)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_quantize_kernel_unaligned_and_special_values(fmt):
    base = torch.randn(4099 * 16 + 3, device="cuda", dtype=torch.bfloat16)
    x = base[3:].view(4099, 16)  # 6 bytes past an aligned start
    for current in (True, False):
        st = _state_with_history(3, [2.0] * 3, fmt)
        ref = st.clone()
        q, q_t = _mod().fp8_quantize(x, st, 0, fmt, current, True, True)
        q_ref, q_t_ref = fp8.fp8_quantize_reference(x, ref, 0, fmt, current)
        assert torch.equal(_codes(q), _codes(q_ref)) and torch.equal(_codes(q_t), _codes(q_t_ref))
        assert torch.equal(st, ref)
    z = torch.zeros(5, 32, device="cuda", dtype=torch.float16)
    st = torch.zeros(3, fp8.WIDTH, device="cuda")
    q, _ = _mod().fp8_quantize(z, st, 1, fmt, True, True, False)
    assert float(st[1, fp8.SCALE]) == 1.0 and torch.equal(_codes(q), torch.zeros_like(_codes(q)))
    for bad in (float("inf"), float("nan")):
        y = torch.ones(4, 16, device="cuda", dtype=torch.float16)
        y[1, 7] = bad
        st = torch.zeros(3, fp8.WIDTH, device="cuda")
        q, _ = _mod().fp8_quantize(y, st, 0, fmt, True, True, False)
        assert torch.isnan(st[0, fp8.SCALE_INV]) and torch.isnan(q.float()).all()
        st = _state_with_history(3, [1.0] * 3, fmt)  # delayed: 1/s turns NaN, the history stays clean
        _mod().fp8_quantize(y, st, 0, fmt, False, True, False)
        assert torch.isnan(st[0, fp8.SCALE_INV])
        _mod().fp8_roll(st, fmt)
        assert float(st[0, fp8.HIST]) == 1.0 and float(st[0, fp8.SCALE_INV]) == 1.0 / float(st[0, fp8.SCALE])


def test_roll_kernel_is_the_reference():
    g = torch.Generator(device="cuda").manual_seed(9)
    st = torch.zeros(30, fp8.WIDTH, device="cuda")
    for step in range(fp8.HISTORY + 3):
        amax = torch.rand(30, device="cuda", generator=g) * 10.0 ** torch.randint(-6, 6, (30,), device="cuda",
                                                                               generator=g)
        amax[step % 30] = 0.0
        amax[(step + 7) % 30] = float("inf") if step % 2 else float("nan")
        st[:, fp8.AMAX] = amax
        ref = st.cpu()
        _mod().fp8_roll(st, fp8.E5M2)
        fp8.fp8_roll_reference(ref, fp8.E5M2)
        assert torch.equal(st.cpu(), ref), step


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
@pytest.mark.parametrize("current", [True, False], ids=["current", "delayed"])
def test_fp8_linear_against_the_reference(grad_format, dtype, rows, K, N, bias, current):
    g = torch.Generator(device="cuda").manual_seed(rows + K)
    x = torch.randn(rows, K, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(N, device="cuda", generator=g).to(dtype).requires_grad_() if bias else None
    dy = torch.randn(rows, N, device="cuda", generator=g).to(dtype)
    hist = [0.0] * 3 if current else [3.0, 0.1, 2.5]
    st = _state_with_history(3, hist, grad_format)
    mode = 1 + grad_format + (2 if current else 0)
    y = _mod().ag_fp8_linear(x, w, b, mode, st, 0)
    y.backward(dy)
    ref = _state_with_history(3, hist, grad_format)
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    br = b.detach().clone().requires_grad_() if bias else None
    yr = fp8.fp8_linear_reference(xr, wr, br, fp8.Fp8Use(mode, ref, 0))
    yr.backward(dy)
    assert torch.equal(st, ref)  # the same maxima recorded and scales used
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    # forward: the same FP8 codes; the GPU accumulates (fast accumulation, as in both backward GEMMs) and rounds once
    codes = _state_with_history(3, hist, grad_format)
    xq, _ = fp8.fp8_quantize_reference(x.detach(), codes, 0, fp8.E4M3, current)
    wq, _ = fp8.fp8_quantize_reference(w.detach(), codes, 1, fp8.E4M3, current)
    gq, _ = fp8.fp8_quantize_reference(dy, codes, 2, grad_format, current)
    xd, wd, gd = (q.float() * codes[r, fp8.SCALE_INV] for q, r in ((xq, 0), (wq, 1), (gq, 2)))
    gold = xd @ wd.t() + (b.detach().float() if bias else 0)
    tol = ulp * gold.abs() + ACC * _bound(xd, wd) + 1e-6
    assert torch.all((y.float() - gold).abs() <= tol), (y.float() - gold).abs().max()
    assert torch.all((y.float() - yr.float()).abs() <= 2 * tol)
    # input gradient: FP8 codes of dy in the gradient format against the e4m3 W
    gold_dx = gd @ wd
    tol = ulp * gold_dx.abs() + ACC * _bound(gd, wd.t()) + 1e-6
    assert torch.all((x.grad.float() - gold_dx).abs() <= tol), (x.grad.float() - gold_dx).abs().max()
    # weight gradient: the same codes of dy and x, transposed (the tokens summed in the tensor cores)
    gold_dw = gd.t() @ xd
    tol = ulp * gold_dw.abs() + ACC * _bound(gd.t(), xd.t()) + 1e-6
    assert torch.all((w.grad.float() - gold_dw).abs() <= tol), (w.grad.float() - gold_dw).abs().max()
    # and it stays close to the exact weight gradient
    exact_dw = dy.float().t() @ x.detach().float()
    assert (w.grad.float() - exact_dw).norm() <= 0.15 * exact_dw.norm()
    if bias:
        torch.testing.assert_close(b.grad.float(), dy.float().sum(0), rtol=ulp, atol=ulp * rows ** 0.5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_cast_ahead_equal_their_own_casts(dtype):
    """The forward's weights cast in one launch (fp8_cast_weights; over 32 of them: two launches) give each
    projection the codes its own cast makes, bit for bit, and record the same maxima; each is taken once, the
    leftovers are counted and dropped, and codes made for another state row are refused."""
    mod = _mod()
    g = torch.Generator(device="cuda").manual_seed(5)
    shapes = [(16, 16), (48, 80), (1040, 272), (64, 4096), (3072, 1024)]
    shapes += [(16 * (k % 5 + 1), 32 * (k % 3 + 1)) for k in range(31)]
    ws = [(torch.randn(*s, device="cuda", generator=g) * (k + 1) / 8).to(dtype) for k, s in enumerate(shapes)]
    xs = [torch.randn(37, s[1], device="cuda", generator=g).to(dtype) for s in shapes]
    base = _state_with_history(3 * len(ws), [0.5 * (k % 7 + 1) for k in range(3 * len(ws))], fp8.E5M2)
    mode = 1 + fp8.E5M2

    def run(ahead):
        st = base.clone()
        if ahead:
            mod.fp8_cast_weights(ws, st, [3 * k + 1 for k in range(len(ws))])
        out = [mod.fp8_linear_forward_codes(x, w, mode, st, k, False) for k, (x, w) in enumerate(zip(xs, ws))]
        return [(o[0], o[2].view(torch.uint8)) for o in out], st, mod.fp8_forget_weights()

    got, st_got, left = run(True)
    want, st_want, _ = run(False)
    assert left == 0
    for k, ((y, wq_t), (y_ref, wq_t_ref)) in enumerate(zip(got, want)):
        assert torch.equal(y, y_ref) and torch.equal(wq_t, wq_t_ref), k
    assert torch.equal(st_got, st_want) and (st_got[1::3, fp8.AMAX] > 0).all()
    # codes nobody takes are dropped and counted; codes made for one row are not taken for another
    st = base.clone()
    mod.fp8_cast_weights(ws[:3], st, [1, 4, 7])
    assert mod.fp8_forget_weights() == 3
    mod.fp8_cast_weights(ws[:1], st, [4])
    with pytest.raises(RuntimeError, match="belong to state row 4, this projection uses row 1"):
        mod.fp8_linear_forward_codes(xs[0], ws[0], mode, st, 0, False)
    with pytest.raises(RuntimeError, match="listed twice"):
        mod.fp8_cast_weights([ws[0], ws[0]], st, [1, 4])
    with pytest.raises(RuntimeError, match="multiples of 16"):
        mod.fp8_cast_weights([torch.zeros(8, 16, device="cuda", dtype=dtype)], st, [1])
    assert mod.fp8_forget_weights() == 0


@pytest.mark.parametrize("grad_format", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("rows,V,C", [(37, 2048, 256), (1031, 32000, 1024)])
@pytest.mark.parametrize("current", [True, False], ids=["current", "delayed"])
def test_head_equals_the_fp8_linear_node(grad_format, rows, V, C, current):
    """The vocabulary projection of the CUDA-graph step's head (outside autograd) is the FP8 linear node's
    arithmetic: the same logits, input and weight gradients bit for bit, the same state."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, C, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(V, C, device="cuda", generator=g) / C ** 0.5).to(torch.bfloat16)
    dy = (torch.randn(rows, V, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    hist = [0.0] * 3 if current else [3.0, 0.1, 2.5e-3]
    mode = 1 + grad_format + (2 if current else 0)
    st = _state_with_history(3, hist, grad_format)
    logits, saved = fp8.fp8_head_forward(x, w, fp8.Fp8Use(mode, st, 0))
    dx, dw = fp8.fp8_head_backward(dy, saved, fp8.Fp8Use(mode, st, 0))
    ref = _state_with_history(3, hist, grad_format)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = _mod().ag_fp8_linear(xr, wr, None, mode, ref, 0)
    y.backward(dy)
    assert torch.equal(logits, y) and torch.equal(dx, xr.grad) and torch.equal(dw, wr.grad)
    assert torch.equal(st, ref)


@pytest.mark.parametrize("grad_format", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("rows,V,C", [(37, 2048, 256), (1031, 32000, 1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [None, 1024.0])
def test_head_loss_writes_the_codes_of_the_gradient(grad_format, rows, V, C, dtype, scale):
    """Under delayed scaling the head's loss kernel writes the logits' gradient only as FP8 codes: the same loss,
    nll, input and weight gradients bit for bit as the loss kernel writing the gradient over the logits followed by
    its quantisation, the same recorded maximum; the logits are left as they were; ignored rows give nothing; the
    weight gradient written into a given buffer equals the returned one."""
    from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_with_grad

    g = torch.Generator(device="cuda").manual_seed(rows + V)
    x = torch.randn(rows, C, device="cuda", generator=g).to(dtype)
    w = (torch.randn(V, C, device="cuda", generator=g) * 2 / C ** 0.5).to(dtype)
    target = torch.randint(0, V, (rows,), device="cuda", generator=g)
    target[::7] = 1  # the padding index: ignored rows
    gs = None if scale is None else torch.tensor([scale], device="cuda")
    mode = 1 + grad_format
    st = _state_with_history(3, [3.0, 0.1, 2.5e-3 * (scale or 1.0)], grad_format)
    logits, saved = fp8.fp8_head_forward(x, w, fp8.Fp8Use(mode, st, 0))
    kept = logits.clone()
    st_a, st_b = st.clone(), st.clone()
    out = torch.full((V, C), float("nan"), device="cuda", dtype=dtype)
    loss, nll, dx, dw = fp8.fp8_head_loss_backward(logits, target, 0.1, 1, gs, saved, fp8.Fp8Use(mode, st_a, 0),
                                                   dw_out=out)
    assert torch.equal(logits, kept)
    ref_logits = logits.clone()
    ref_loss, ref_nll = label_smoothed_cross_entropy_with_grad(ref_logits, target, 0.1, 1, gs)
    ref_dx, ref_dw = fp8.fp8_head_backward(ref_logits, saved, fp8.Fp8Use(mode, st_b, 0))
    assert torch.equal(loss, ref_loss) and torch.equal(nll, ref_nll)
    assert torch.equal(dx, ref_dx) and torch.equal(dw, ref_dw) and dw.data_ptr() == out.data_ptr()
    assert torch.equal(st_a, st_b) and st_a[2, fp8.AMAX] > 0
    assert torch.all(dx[::7] == 0)


def _node_equals_chain(run, state_rows, dtype, names, bias_sum_reordered=True):
    """run(kind, state, mode, step) -> (values..., bias gradient) of the fused node (kind "node", twice) and of the
    chain it replaces ("chain"), each with its own FP8 state, over a current-scaling step and two delayed ones: the
    values and the states are equal bit for bit, and the node gives the same results run to run. The bias gradient
    is equal bit for bit too, unless the node sums it in another order (bias_sum_reordered: equal under current
    scaling, within one rounding after). Returns the node's results of the last step."""
    gf = fp8.E5M2
    states = [torch.zeros(state_rows, fp8.WIDTH, device="cuda") for _ in range(3)]
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    for step in range(3):
        mode = 1 + gf + (2 if step == 0 else 0)
        results = []
        for kind, st in zip(("node", "node", "chain"), states):
            if step > 0:
                _mod().fp8_roll(st, gf)
            *values, db = run(kind, st, mode, step)
            results.append((*values, st.clone(), db))
        node, again, chain = results
        for got, want, what in zip(node[:-1], chain[:-1], (*names, "state")):
            assert torch.equal(got, want), f"step {step}: {what} differs"
        assert all(torch.equal(a, b) for a, b in zip(node, again)), f"step {step}: not the same run to run"
        if step == 0 or not bias_sum_reordered:
            assert torch.equal(node[-1], chain[-1]), f"step {step}: bias gradient differs"
        else:
            torch.testing.assert_close(node[-1].float(), chain[-1].float(), rtol=ulp,
                                       atol=ulp * chain[-1].float().abs().max().item())
        assert node[-1].abs().sum() > 0
    return node


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("keep", [True, False], ids=["keep_codes", "recompute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 61, 256), (2, 8, 4096)])
def test_activation_written_as_codes_equals_the_stored_pair(activation, p, keep, dtype, shape):
    """The FP8 FFN (ag_bias_act_linear under FP8) writes dropout(act(x + b)) only as e4m3 codes, from one pass
    over x; relu with the codes kept keeps only the bits of a > 0 (in place of the keep mask), otherwise relu' comes
    from x. Output, mask, every gradient and the FP8 state equal those of the stored pair (bias_act_dropout, then
    the FP8 linear node) bit for bit (_node_equals_chain), with the transposed codes kept or made again in the
    backward."""
    mod = _mod()
    F = shape[-1]
    g = torch.Generator(device="cuda").manual_seed(F)
    x = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    b = torch.randn(F, device="cuda", generator=g).to(dtype)
    w = (torch.randn(48, F, device="cuda", generator=g) / F ** 0.5).to(dtype)
    dy = torch.randn(*shape[:-1], 48, device="cuda", generator=g).to(dtype)

    def run(kind, st, mode, step):
        xi, bi, wi = (t.clone().requires_grad_() for t in (x, b, w))
        torch.manual_seed(7 + step)
        if kind == "node":
            y, mask = mod.ag_bias_act_linear(xi, bi, wi, activation, p, mode, st, 0, keep)
        else:
            a, mask = mod.ag_bias_act_dropout(xi, bi, activation, p)
            y = mod.ag_fp8_linear(a, wi, None, mode, st, 0)
            if activation == "relu" and keep:  # the fused node keeps the bits of a > 0 instead of the keep bits
                bit = (a.detach().reshape(-1, 8) > 0).to(torch.uint8)
                mask = (bit << torch.arange(8, device="cuda", dtype=torch.uint8)).sum(1).to(torch.uint8)
        y.backward(dy)
        return y, mask, xi.grad, wi.grad, bi.grad

    node = _node_equals_chain(run, 3, dtype, ("output", "mask", "dx", "dW"), bias_sum_reordered=False)
    if p > 0 or (activation == "relu" and keep):
        assert not bool(node[1].eq(255).all())  # something was dropped (or is not positive)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("keep", [True, False], ids=["keep_codes", "recompute"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
# (8, 500, ...): 4,000 rows, enough that the gradient casts walk work items of several tiles (cast_chunk)
@pytest.mark.parametrize("shape", [(3, 61, 64, 256), (2, 100, 128, 4096), (8, 500, 128, 4096)])
def test_ffn_node_equals_the_chain(activation, p, keep, dtype, shape):
    """The FFN block as one FP8 node (ag_fp8_ffn) writes the gradients reaching its projections straight as codes,
    with the bias gradients summed on the way: output, masks, dx, both weight gradients, the residual's gradient and
    the FP8 state equal those of the chain it replaces (the FP8 linear node, ag_bias_act_linear, then
    ag_bias_dropout_residual) bit for bit (_node_equals_chain)."""
    mod = _mod()
    *lead, C, F = shape
    g = torch.Generator(device="cuda").manual_seed(F + C)
    x = torch.randn(*lead, C, device="cuda", generator=g).to(dtype)
    w1 = (torch.randn(F, C, device="cuda", generator=g) / C ** 0.5).to(dtype)
    b1 = (0.5 * torch.randn(F, device="cuda", generator=g)).to(dtype)
    w2 = (torch.randn(C, F, device="cuda", generator=g) / F ** 0.5).to(dtype)
    b2 = (0.5 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    res = torch.randn(*lead, C, device="cuda", generator=g).to(dtype)
    dy = torch.randn(*lead, C, device="cuda", generator=g).to(dtype)
    p_out = p / 3

    def run(kind, st, mode, step):
        xi, w1i, b1i, w2i, b2i, ri = (t.clone().requires_grad_() for t in (x, w1, b1, w2, b2, res))
        torch.manual_seed(11 + step)
        if kind == "chain":
            h = mod.ag_fp8_linear(xi, w1i, None, mode, st, 0)
            y, mask = mod.ag_bias_act_linear(h, b1i, w2i, activation, p, mode, st, 1, keep)
            out, mask_out = mod.ag_bias_dropout_residual(y, b2i, ri, p_out)
        else:
            out, mask, mask_out = mod.ag_fp8_ffn(xi, w1i, b1i, w2i, b2i, ri, activation, p, p_out, mode, st, 0, 1,
                                                 keep)
        out.backward(dy)
        assert xi.grad.abs().sum() > 0
        return out, mask, mask_out, xi.grad, w1i.grad, w2i.grad, ri.grad, torch.cat([b1i.grad, b2i.grad])

    _node_equals_chain(run, 6, dtype, ("output", "mask", "output mask", "dx", "dW1", "dW2", "d residual"))


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 61, 64, 256), (2, 100, 1024, 1024), (1, 7, 48, 32), (4, 1000, 256, 1024)])
def test_linear_residual_node_equals_the_chain(p, dtype, shape):
    """An attention block's output projection and residual dropout as one FP8 node (ag_fp8_linear_residual) write
    the projection's output gradient straight as codes, with the bias gradient summed on the way: output, mask, dx,
    dW, the residual's gradient and the FP8 state equal those of the chain it replaces (the FP8 linear node, then
    ag_bias_dropout_residual) bit for bit (_node_equals_chain)."""
    mod = _mod()
    *lead, K, N = shape
    g = torch.Generator(device="cuda").manual_seed(K + N)
    x = torch.randn(*lead, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    b = (0.5 * torch.randn(N, device="cuda", generator=g)).to(dtype)
    res = torch.randn(*lead, N, device="cuda", generator=g).to(dtype)
    dy = torch.randn(*lead, N, device="cuda", generator=g).to(dtype)

    def run(kind, st, mode, step):
        xi, wi, bi, ri = (t.clone().requires_grad_() for t in (x, w, b, res))
        torch.manual_seed(5 + step)
        if kind == "chain":
            out, mask = mod.ag_bias_dropout_residual(mod.ag_fp8_linear(xi, wi, None, mode, st, 0), bi, ri, p)
        else:
            out, mask = mod.ag_fp8_linear_residual(xi, wi, bi, ri, p, mode, st, 0)
        out.backward(dy)
        assert xi.grad.abs().sum() > 0
        return out, mask, xi.grad, wi.grad, ri.grad, bi.grad

    node = _node_equals_chain(run, 5, dtype, ("output", "mask", "dx", "dW", "d residual"))
    if p > 0:
        assert not bool(node[1].eq(255).all())  # something was dropped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T,C,H", [(3, 29, 64, 4), (2, 100, 256, 4), (5, 7, 32, 4)])  # head dims 16, 64, 8
@pytest.mark.parametrize("n", [3, 2, 1, 12])  # 1: a cross-attention query; 12: six layers' keys and values
@pytest.mark.parametrize("grads", ["token_major", "plain", "some"])
def test_linear_split_node_equals_the_chain(dtype, B, T, C, H, n, grads):
    """The attention's input projection and head split as one FP8 node (ag_fp8_linear_split): the parts are views of
    the GEMM's output (the bias in its epilogue) and the output gradient is quantised straight from the heads'
    gradients, with the bias gradient summed on the way: the parts, dx, dW and the FP8 state equal those of the chain
    (the FP8 linear node with the bias, then its output's heads as views) bit for bit (_node_equals_chain), for head
    gradients stored token-major (as SDPA's kernels give them), plain [B, H, T, D] ones, and some parts without a
    gradient. A head dim that is not a multiple of 16 merges in the gradient's precision first (the same values)."""
    mod = _mod()
    g = torch.Generator(device="cuda").manual_seed(T * C + n)
    x = torch.randn(B, T, C, device="cuda", generator=g).to(dtype)
    w = (torch.randn(n * C, C, device="cuda", generator=g) / C ** 0.5).to(dtype)
    b = (0.5 * torch.randn(n * C, device="cuda", generator=g)).to(dtype)
    douts = [torch.randn(B, H, T, C // H, device="cuda", generator=g).to(dtype) for _ in range(n)]

    def run(kind, st, mode, step):
        xi, wi, bi = (t.clone().requires_grad_() for t in (x, w, b))
        if kind == "chain":
            y = mod.ag_fp8_linear(xi, wi, bi, mode, st, 0)
            parts = y.view(B, T, n, H, C // H).permute(2, 0, 3, 1, 4).unbind(0)
        else:
            parts = mod.ag_fp8_linear_split(xi, wi, bi, n, H, mode, st, 0)
            if n > 1:  # views of one product
                assert parts[1].data_ptr() - parts[0].data_ptr() == C * parts[0].element_size()
        if grads == "token_major":  # [B, H, T, D] gradients stored [B, T, H, D]
            gs = [d.transpose(1, 2).contiguous().transpose(1, 2) for d in douts]
        elif grads == "plain":
            gs = list(douts)
        else:  # only the last part has a gradient
            gs = [None] * (n - 1) + [douts[-1]]
        torch.autograd.backward([p for p, d in zip(parts, gs) if d is not None], [d for d in gs if d is not None])
        assert xi.grad.abs().sum() > 0
        # the chain's bias gradient as the heads' merge sums it (the linear node sums its [rows, N] gradient in
        # another order)
        db = bi.grad if kind == "node" else mod.split_heads_bwd(gs, True)[1]
        return torch.stack(list(parts)).detach(), xi.grad, wi.grad, db

    _node_equals_chain(run, 3, dtype, ("parts", "dx", "dW"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T,C,H", [(3, 61, 1024, 16), (2, 37, 512, 8), (1, 9, 256, 4), (2, 29, 64, 4)])
def test_ln_linear_split_node_equals_the_chain(dtype, B, T, C, H):
    """A pre-LN block's layer norm inside its FP8 input projection's node (ag_fp8_ln_linear_split): under delayed
    scaling the layer norm is written only as the projection's input codes (layer_norm_codes, one pass) and its
    backward runs in the node's, with the residual's gradient added. The parts, the residual, dx, the layer norm's
    weight and bias gradients, dW, db and the FP8 state equal those of the chain (ag_pre_layer_norm, then
    ag_fp8_linear_split) bit for bit (_node_equals_chain), for the hidden sizes the one-pass kernel takes (256, 512,
    1024; row counts that are not multiples of 16) and one it does not (64: the chain's kernels in the node)."""
    mod = _mod()
    g = torch.Generator(device="cuda").manual_seed(T * C + H)
    x = (2 * torch.randn(B, T, C, device="cuda", generator=g) + 0.5).to(dtype)
    lw = (1 + 0.3 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    lb = (0.2 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    w = (torch.randn(3 * C, C, device="cuda", generator=g) / C ** 0.5).to(dtype)
    b = (0.5 * torch.randn(3 * C, device="cuda", generator=g)).to(dtype)
    douts = [torch.randn(B, H, T, C // H, device="cuda", generator=g).to(dtype) for _ in range(3)]
    dres = torch.randn(B, T, C, device="cuda", generator=g).to(dtype)

    def run(kind, st, mode, step):
        xi, lwi, lbi, wi, bi = (t.clone().requires_grad_() for t in (x, lw, lb, w, b))
        if kind == "chain":
            h, res = mod.ag_pre_layer_norm(xi, lwi, lbi, 1e-5, False)
            parts = mod.ag_fp8_linear_split(h, wi, bi, 3, H, mode, st, 0)
        else:
            *parts, res = mod.ag_fp8_ln_linear_split(xi, lwi, lbi, 1e-5, wi, bi, 3, H, mode, st, 0)
            assert res.data_ptr() == xi.data_ptr()
        torch.autograd.backward(list(parts) + [res], douts + [dres])
        assert xi.grad.abs().sum() > 0 and lwi.grad.abs().sum() > 0 and lbi.grad.abs().sum() > 0
        return torch.stack(list(parts)).detach(), xi.grad, lwi.grad, lbi.grad, wi.grad, bi.grad

    _node_equals_chain(run, 3, dtype, ("parts", "dx", "d ln weight", "d ln bias", "dW"), bias_sum_reordered=False)


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(3, 61, 1024, 4096), (2, 37, 256, 1024), (1, 9, 64, 256)])
def test_ln_ffn_node_equals_the_chain(p, dtype, shape):
    """A pre-LN FFN block with its layer norm inside the FP8 FFN node (ag_fp8_ln_ffn, x also the residual): output,
    masks, dx (the layer norm's backward plus the residual's gradient), the layer norm's weight and bias gradients,
    both weight gradients, both bias gradients and the FP8 state equal those of the chain (ag_pre_layer_norm, then
    ag_fp8_ffn) bit for bit (_node_equals_chain); C = 64 takes the chain's kernels in the node."""
    mod = _mod()
    *lead, C, F = shape
    g = torch.Generator(device="cuda").manual_seed(F + C + 1)
    x = (2 * torch.randn(*lead, C, device="cuda", generator=g) - 0.3).to(dtype)
    lw = (1 + 0.3 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    lb = (0.2 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    w1 = (torch.randn(F, C, device="cuda", generator=g) / C ** 0.5).to(dtype)
    b1 = (0.5 * torch.randn(F, device="cuda", generator=g)).to(dtype)
    w2 = (torch.randn(C, F, device="cuda", generator=g) / F ** 0.5).to(dtype)
    b2 = (0.5 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    dy = torch.randn(*lead, C, device="cuda", generator=g).to(dtype)

    def run(kind, st, mode, step):
        xi, lwi, lbi, w1i, b1i, w2i, b2i = (t.clone().requires_grad_() for t in (x, lw, lb, w1, b1, w2, b2))
        torch.manual_seed(17 + step)
        if kind == "chain":
            h, res = mod.ag_pre_layer_norm(xi, lwi, lbi, 1e-5, False)
            out, mask, mask_out = mod.ag_fp8_ffn(h, w1i, b1i, w2i, b2i, res, "relu", p, p / 3, mode, st, 0, 1, True)
        else:
            out, mask, mask_out = mod.ag_fp8_ln_ffn(xi, lwi, lbi, 1e-5, w1i, b1i, w2i, b2i, "relu", p, p / 3, mode,
                                                    st, 0, 1, True)
        out.backward(dy)
        assert xi.grad.abs().sum() > 0 and lwi.grad.abs().sum() > 0
        return (out, mask, mask_out, xi.grad, lwi.grad, lbi.grad, w1i.grad, w2i.grad,
                torch.cat([b1i.grad, b2i.grad]))

    _node_equals_chain(run, 6, dtype, ("output", "mask", "output mask", "dx", "d ln weight", "d ln bias", "dW1",
                                       "dW2"), bias_sum_reordered=False)


def test_fp8_ffn_node_errors():
    mod = _mod()
    st = torch.zeros(6, fp8.WIDTH, device="cuda")
    x = torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)
    w1 = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="do not chain"):
        mod.ag_fp8_ffn(x, w1, None, w2.t().contiguous(), None, x, "relu", 0.0, 0.0, 2, st, 0, 1)
    with pytest.raises(RuntimeError, match="both be bfloat16 or float16"):
        mod.ag_fp8_ffn(x, w1.half(), None, w2, None, x, "relu", 0.0, 0.0, 2, st, 0, 1)
    with pytest.raises(RuntimeError, match="not a multiple of 16"):
        mod.ag_fp8_ffn(x, w1[:40], None, w2[:, :40], None, x, "relu", 0.0, 0.0, 2, st, 0, 1)
    with pytest.raises(RuntimeError, match="bias must be"):
        mod.ag_fp8_ffn(x, w1, torch.zeros(63, device="cuda", dtype=torch.bfloat16), w2, None, x, "relu", 0.0, 0.0, 2,
                       st, 0, 1)
    with pytest.raises(RuntimeError, match="this layer needs 9"):
        mod.ag_fp8_ffn(x, w1, None, w2, None, x, "relu", 0.0, 0.0, 2, st, 0, 2)
    with pytest.raises(RuntimeError, match="activation"):
        mod.ag_fp8_ffn(x, w1, None, w2, None, x, "tanh", 0.0, 0.0, 2, st, 0, 1)
    with pytest.raises(RuntimeError, match="residual must be"):
        mod.ag_fp8_ffn(x, w1, None, w2, None, x[:3], "relu", 0.0, 0.0, 2, st, 0, 1)
    wsq = torch.randn(32, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="residual must be"):
        mod.ag_fp8_linear_residual(x, wsq, None, x[:3], 0.1, 2, st, 0)
    with pytest.raises(RuntimeError, match="does not match weight"):
        mod.ag_fp8_linear_residual(x, w2, None, x, 0.1, 2, st, 0)
    with pytest.raises(RuntimeError, match="dropout probability"):
        mod.ag_fp8_linear_residual(x, wsq, None, x, 1.0, 2, st, 0)
    with pytest.raises(RuntimeError, match="this layer needs 9"):
        mod.ag_fp8_linear_residual(x, wsq, None, x, 0.1, 2, st, 2)
    x3 = x.view(2, 2, 32)
    w3 = torch.randn(96, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="does not split into 3 parts of 5 heads"):
        mod.ag_fp8_linear_split(x3, w3, None, 3, 5, 2, st, 0)
    with pytest.raises(RuntimeError, match="n must be >= 1"):
        mod.ag_fp8_linear_split(x3, w3, None, 0, 2, 2, st, 0)
    with pytest.raises(RuntimeError, match="expected \\[batch, length, 32\\]"):
        mod.ag_fp8_linear_split(x, w3, None, 3, 2, 2, st, 0)
    with pytest.raises(RuntimeError, match="bias must be"):
        mod.ag_fp8_linear_split(x3, w3, torch.zeros(95, device="cuda", dtype=torch.bfloat16), 3, 2, 2, st, 0)


def test_fp8_linear_errors():
    mod = _mod()
    x = torch.randn(4, 32, device="cuda", dtype=torch.bfloat16)
    st = torch.zeros(3, fp8.WIDTH, device="cuda")
    w16 = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        mod.ag_fp8_linear(x, torch.randn(20, 32, device="cuda", dtype=torch.bfloat16), None, 1, st, 0)
    with pytest.raises(RuntimeError, match="bfloat16 or float16"):
        mod.ag_fp8_linear(x.float(), torch.randn(16, 32, device="cuda"), None, 1, st, 0)
    with pytest.raises(RuntimeError, match="mode must be 1 to 4"):
        mod.ag_fp8_linear(x, w16, None, 5, st, 0)
    with pytest.raises(RuntimeError, match="state has 3 rows, this layer needs 6"):
        mod.ag_fp8_linear(x, w16, None, 1, st, 1)
    with pytest.raises(RuntimeError, match="float32"):
        mod.ag_fp8_linear(x, w16, None, 1, st.half(), 0)
    with pytest.raises(RuntimeError, match="scaling state"):
        mod.ag_fp8_linear(x, w16, None, 1, None, 0)
    with pytest.raises(RuntimeError, match="multiple of 16 long"):
        mod.fp8_quantize(torch.randn(4, 20, device="cuda"), st, 0, 0, True)


def _layers(grad_format, dtype=torch.bfloat16, seed=0, select=lambda w: True, pre=False):
    from ls_fairseq.fairseq_ext.fp8_mode import attach_fp8
    from ls_fairseq.modules.decoder_layer import BatchedCrossKV, DecoderLayer
    from ls_fairseq.modules.encoder_layer import EncoderLayer

    torch.manual_seed(seed)
    enc = EncoderLayer(256, 1024, 4, dropout=0.0, normalize_before=pre).cuda().to(dtype)
    dec = DecoderLayer(256, 1024, 4, dropout=0.0, normalize_before=pre).cuda().to(dtype)
    kv = BatchedCrossKV(256, 4, 1).cuda().to(dtype)
    state = attach_fp8([enc, kv, dec], grad_format, select) if grad_format is not None else None
    return enc, dec, kv, state


@pytest.mark.parametrize("grad_format", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("pre", [False, True], ids=["post_ln", "pre_ln"])
def test_layers_fp8_close_to_bf16_and_cpp_equals_python(grad_format, pre, monkeypatch):
    """The C++ layer call equals the Python layers bit for bit under FP8, post-LN and pre-LN (transformer_*_t2t),
    over a current-scaling step and later delayed ones, and stays close to bf16."""
    from ls_fairseq.ops import _dispatch

    x = torch.randn(6, 29, 256, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(6, 31, 256, device="cuda", dtype=torch.bfloat16)
    probe = torch.randn(6, 29, 256, device="cuda")

    def run(gf, cpp=True, steps=1, ahead=True):
        monkeypatch.setattr(_dispatch, "_CPP_LAYERS", cpp)
        enc, dec, kv, state = _layers(gf, pre=pre)
        if state is not None and not ahead:
            state.ahead = []  # every projection casts its own weight
        for _ in range(steps):  # the first step scales by current maxima, the later ones by the history
            if state is not None:
                state.begin_forward(x.device)
            for m in (enc, dec, kv):
                m.zero_grad()
            xi, si = x.clone().requires_grad_(), src.clone().requires_grad_()
            e = enc(si)
            k, v = kv(e)
            out = dec(xi, k, v)
            if state is not None:  # the projections took every weight's codes made ahead
                assert state.end_body() == 0
            (out.float() * probe).sum().backward()  # a random direction (a post-LN output's mean square is ~1)
        grads = [p.grad for m in (enc, dec, kv) for p in m.parameters()]
        return out.detach(), xi.grad, si.grad, grads, state

    ref = run(None)
    for steps in (1, 3):
        got = run(grad_format, steps=steps)
        py = run(grad_format, cpp=False, steps=steps)
        own = run(grad_format, steps=steps, ahead=False)
        assert got[4].current == (steps == 1) and len(got[4].ahead) == 11
        # the C++ layer call records the same nodes as the Python layers, and the weights cast ahead in one launch
        # are those each projection casts: identical results and states
        for other in (py, own):
            assert torch.equal(got[0], other[0]) and torch.equal(got[1], other[1]) and torch.equal(got[2], other[2])
            assert all(torch.equal(a, b) for a, b in zip(got[3], other[3]))
            assert torch.equal(got[4].tensor, other[4].tensor)
        # and FP8 stays close to bf16: a few per cent where e4m3 / e5m2 round
        rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()  # noqa: E731
        assert rel(got[0], ref[0]) < 0.05
        assert rel(got[1], ref[1]) < 0.15 and rel(got[2], ref[2]) < 0.15
        flat = lambda grads: torch.cat([g.float().flatten() for g in grads])  # noqa: E731
        assert rel(flat(got[3]), flat(ref[3])) < 0.15  # all parameter gradients together (some are ~0 alone)
    # in eval mode FP8 is off
    enc, _, _, state = _layers(grad_format)
    enc0, _, _, _ = _layers(None)
    enc.eval()
    enc0.eval()
    with torch.no_grad():
        assert torch.equal(enc(x), enc0(x))
    assert state.tensor is None


def test_skipped_projections_stay_bf16_in_cpp_and_python_layers(monkeypatch):
    """--fp8-projections auto leaves some projections of a layer in bf16: the C++ layer call honours the skip
    bits exactly as the Python layers do, and the skipped slots stay unused."""
    from ls_fairseq.ops import _dispatch

    x = torch.randn(4, 21, 256, device="cuda", dtype=torch.bfloat16)
    src = torch.randn(4, 19, 256, device="cuda", dtype=torch.bfloat16)
    square = lambda w: w.shape[0] != w.shape[1]  # noqa: E731  (skips the attention output and cross query/output)

    def run(cpp, select):
        monkeypatch.setattr(_dispatch, "_CPP_LAYERS", cpp)
        enc, dec, kv, state = _layers(fp8.E5M2, select=select)
        for _ in range(2):
            state.begin_forward(x.device)
            for m in (enc, dec, kv):
                m.zero_grad()
            xi, si = x.clone().requires_grad_(), src.clone().requires_grad_()
            k, v = kv(enc(si))
            out = dec(xi, k, v)
            out.float().square().mean().backward()
        return out.detach(), xi.grad, si.grad, [p.grad for m in (enc, dec, kv) for p in m.parameters()], state, enc, dec

    got, py, every = run(True, square), run(False, square), run(True, lambda w: True)
    assert torch.equal(got[0], py[0]) and torch.equal(got[1], py[1]) and torch.equal(got[2], py[2])
    assert all(torch.equal(a, b) for a, b in zip(got[3], py[3]))
    assert torch.equal(got[4].tensor, py[4].tensor)
    assert not torch.equal(got[0], every[0])  # the skip bits changed what ran
    st, enc, dec = got[4].tensor, got[5], got[6]
    unused = [enc.fp8.slot + 1, dec.fp8.slot + 1, dec.fp8.slot + 4, dec.fp8.slot + 5]
    used = [enc.fp8.slot, enc.fp8.slot + 2, enc.fp8.slot + 3, dec.fp8.slot, dec.fp8.slot + 2, dec.fp8.slot + 3]
    for s in unused:  # no maximum ever recorded (the roll still sets their scales to 1)
        assert not st[3 * s:3 * s + 3, fp8.AMAX:].any(), s
    for s in used:
        assert (st[3 * s:3 * s + 3, fp8.HIST] > 0).all(), s
    with pytest.raises(RuntimeError, match="fp8 mode must be 0 to 4"):
        _mod().encoder_layer_fwd(x, None, enc.cpp_weights(), enc.cpp_eps(), 4, 0.0, 0.0, 0.0, "relu", False, 0,
                              2 + (64 << fp8.SKIP_SHIFT), st, 0, 0)


def test_lightseq_train_fp8_with_graph_step(corpus, tmp_path):
    from tests._models import SMALL_LS_TRAIN, train_inner_records

    cmd = [sys.executable, "-m", "ls_fairseq.cli.train", corpus, *SMALL_LS_TRAIN, "--max-tokens", "2048", "--max-update", "150", "--seed", "1",
           "--log-format", "json", "--log-interval", "1", "--num-workers", "1", "--save-dir", str(tmp_path / "ck"),
           "--ls-graph-buckets", "12", "--bf16", "--fp8", "--fp8-projections", "all"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    # 21 projections in the layers and the vocabulary projection, in FP8 where its size is a multiple of 16
    from fairseq.data import Dictionary

    vocab = len(Dictionary.load(os.path.join(corpus, "dict.tgt.txt")))
    assert f"--fp8: {21 + (vocab % 16 == 0)} of 22 projections run as FP8 GEMMs" in out, out[-3000:]
    assert re.search(r"CUDA-graph step: [1-9]\d* micro-batches from [1-9]\d* captured buckets", out), out[-3000:]
    losses = [float(r["loss"]) for _, r in sorted(train_inner_records(out).items())]
    assert len(losses) >= 100 and all(l == l for l in losses)
    assert losses[-1] < losses[0] - 1.0  # it learns
    # the checkpoint holds plain weights: it loads and validates without --fp8 machinery
    sd = torch.load(tmp_path / "ck" / "checkpoint_last.pt", map_location="cpu", weights_only=False)["model"]
    assert all(t.dtype in (torch.float32, torch.float16, torch.bfloat16) for t in sd.values() if t.is_floating_point())
