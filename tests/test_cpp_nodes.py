"""The C++ autograd nodes (csrc/torch/autograd.cpp) built on this machine over CPU stand-ins for their
CUDA adapters (tests/cpp/stand_in_adapters.cpp): every node, with and without its optional inputs,
against torch's own autograd. This checks the wiring (which input gets which gradient, absent biases
and residuals, outputs nobody used, frozen inputs) where no GPU is needed; the kernels and the nodes
over them are compared on the GPU in tests/gpu/test_cpp_nodes_gpu.py."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from _cpu_builds import cached_cpu_extension
from _models import saved_bytes


@pytest.fixture(scope="module")
def nodes(cpu_builds):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler to build the nodes with")
    # built once (at -O0: the wiring is what is tested), then cached while the sources stay the same
    module, _ = cached_cpu_extension("ls_fairseq_cpp_nodes_test")
    return module


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


def _same_as_autograd(fn, ref, inputs):
    """fn and ref on copies of inputs: the same outputs and the same gradient for every input."""
    a, b = _leaves(*inputs), _leaves(*inputs)
    oa, ob = fn(*a), ref(*b)
    oa = list(oa) if isinstance(oa, (list, tuple)) else [oa]
    ob = list(ob) if isinstance(ob, (list, tuple)) else [ob]
    assert len(oa) >= len(ob)
    gen = torch.Generator().manual_seed(3)
    gys = [torch.randn(o.shape, generator=gen) for o in ob]
    for x, y in zip(oa, ob):
        torch.testing.assert_close(x, y)
    ga = torch.autograd.grad(sum((o * g).sum() for o, g in zip(oa, gys)), a)
    gb = torch.autograd.grad(sum((o * g).sum() for o, g in zip(ob, gys)), b)
    for i, (x, y) in enumerate(zip(ga, gb)):
        torch.testing.assert_close(x, y, msg=lambda m: f"gradient of input {i}: {m}")
    return oa


def _ln(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


X = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0))
R = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
W = 1 + 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(2))
B = 0.1 * torch.randn(16, generator=torch.Generator().manual_seed(4))


def test_layer_norm_nodes(nodes):
    out = _same_as_autograd(lambda x, w, b: nodes.ag_layer_norm(x, None, w, b, 1e-5), _ln, [X, W, B])
    assert len(out) == 1 and "LayerNormNode" in out[0].grad_fn.name()
    _same_as_autograd(lambda x, r, w, b: nodes.ag_layer_norm(x, r, w, b, 1e-5),
                      lambda x, r, w, b: (_ln(x + r, w, b), x + r), [X, R, W, B])
    out = _same_as_autograd(lambda x, w, b: nodes.ag_pre_layer_norm(x, w, b, 1e-5),
                            lambda x, w, b: (_ln(x, w, b), x * 1), [X, W, B])
    assert "PreLayerNormNode" in out[0].grad_fn.name()


def test_invertible_layer_norm_nodes(nodes):
    """--ls-invertible-layernorm: the same gradients, from the output instead of the input."""
    _same_as_autograd(lambda x, w, b: nodes.ag_layer_norm(x, None, w, b, 1e-5, True), _ln, [X, W, B])
    _same_as_autograd(lambda x, r, w, b: nodes.ag_layer_norm(x, r, w, b, 1e-5, True),
                      lambda x, r, w, b: (_ln(x + r, w, b), x + r), [X, R, W, B])
    _same_as_autograd(lambda x, w, b: nodes.ag_pre_layer_norm(x, w, b, 1e-5, True),
                      lambda x, w, b: (_ln(x, w, b), x * 1), [X, W, B])
    x, w, b = _leaves(X, W, B)
    lin = torch.randn(8, 16)
    for pre in (False, True):  # followed by a linear layer, which keeps the output: the input is freed
        norm = (lambda t: nodes.ag_pre_layer_norm(t, w, b, 1e-5, inv)[0]) if pre else \
            (lambda t: nodes.ag_layer_norm(t, None, w, b, 1e-5, inv)[0])
        sizes = []
        for inv in (False, True):
            _, n = saved_bytes(lambda: nodes.ag_linear(norm(x * 1.0), lin), [w, b, lin])
            sizes.append(n)
        assert sizes[0] - sizes[1] >= X.numel() * X.element_size(), (pre, sizes)


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_bias_act_linear_node(nodes, act):
    """--ls-recompute-activation's node: dropout(act(x + b)) W^T with every gradient of the stored pair."""
    f = F.relu if act == "relu" else F.gelu
    w = torch.randn(10, 16, generator=torch.Generator().manual_seed(7))
    out = _same_as_autograd(lambda x, b, w: nodes.ag_bias_act_linear(x, b, w, act, 0.0)[0],
                            lambda x, b, w: F.linear(f(x + b), w), [X, B, w])
    assert "BiasActLinearNode" in out[0].grad_fn.name()
    _same_as_autograd(lambda x, w: nodes.ag_bias_act_linear(x, None, w, act, 0.0)[0],
                      lambda x, w: F.linear(f(x), w), [X, w])
    x, bl = _leaves(X, B)  # frozen weight: the input's and the bias's gradients only
    gx, gb = torch.autograd.grad(nodes.ag_bias_act_linear(x, bl, w, act, 0.0)[0].sum(), [x, bl])
    xr, br = _leaves(X, B)
    want = torch.autograd.grad(F.linear(f(xr + br), w).sum(), [xr, br])
    torch.testing.assert_close(gx, want[0])
    torch.testing.assert_close(gb, want[1])
    x, b, wl = _leaves(X, B, w)
    _, recomputed = saved_bytes(lambda: nodes.ag_bias_act_linear(x, b, wl, act, 0.0), [b, wl])
    _, stored = saved_bytes(lambda: nodes.ag_linear(nodes.ag_bias_act_dropout(x, b, act, 0.0)[0], wl), [b, wl])
    if act == "gelu":  # stored: the input and the output; recomputed: the input only
        assert stored - recomputed >= X.numel() * X.element_size()
    with pytest.raises(Exception, match="does not match weight"):
        nodes.ag_bias_act_linear(X, None, torch.randn(4, 15), act, 0.0)


def test_layer_norm_nodes_with_one_output_used(nodes):
    x, r = _leaves(X, R)
    _, s = nodes.ag_layer_norm(x, r, W, B, 1e-5)  # only x + residual used
    gx, gr = torch.autograd.grad((2 * s).sum(), [x, r])
    assert torch.equal(gx, torch.full_like(x, 2.0)) and torch.equal(gr, gx)
    (x,) = _leaves(X)
    _, xs = nodes.ag_pre_layer_norm(x, W, B, 1e-5)  # only the passed-on input used
    (gx,) = torch.autograd.grad((3 * xs).sum(), [x])
    assert torch.equal(gx, torch.full_like(x, 3.0))


def test_bias_dropout_residual_node(nodes):
    out = _same_as_autograd(lambda x, b, r: nodes.ag_bias_dropout_residual(x, b, r, 0.0)[0],
                            lambda x, b, r: x + b + r, [X, B, R])
    assert "BiasDropoutResidualNode" in out[0].grad_fn.name()
    _same_as_autograd(lambda x, r: nodes.ag_bias_dropout_residual(x, None, r, 0.0)[0], lambda x, r: x + r, [X, R])
    # a frozen bias: no gradient asked for it, the others still right
    x, r = _leaves(X, R)
    out, mask = nodes.ag_bias_dropout_residual(x, B, r, 0.0)
    assert not mask.requires_grad
    gx, gr = torch.autograd.grad(out.sum(), [x, r])
    assert torch.equal(gx, torch.ones_like(x)) and torch.equal(gr, torch.ones_like(r))


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_bias_act_dropout_node(nodes, act):
    f = F.relu if act == "relu" else F.gelu
    out = _same_as_autograd(lambda x, b: nodes.ag_bias_act_dropout(x, b, act, 0.0)[0], lambda x, b: f(x + b), [X, B])
    assert "BiasActDropoutNode" in out[0].grad_fn.name()
    _same_as_autograd(lambda x: nodes.ag_bias_act_dropout(x, None, act, 0.0)[0], f, [X])


def _split_ref(x, b, n, heads):
    y = x + b if b is not None else x
    bsz, t, width = x.shape
    return tuple(y.view(bsz, t, n, heads, width // n // heads).permute(2, 0, 3, 1, 4).unbind(0))


def test_split_heads_node(nodes):
    x3 = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(5))
    b3 = torch.randn(48, generator=torch.Generator().manual_seed(6))
    out = _same_as_autograd(lambda x, b: nodes.ag_split_heads(x, b, 3, 4), lambda x, b: _split_ref(x, b, 3, 4),
                            [x3, b3])
    assert len(out) == 3 and "SplitHeadsNode" in out[0].grad_fn.name()
    _same_as_autograd(lambda x: nodes.ag_split_heads(x, None, 3, 4), lambda x: _split_ref(x, None, 3, 4), [x3])
    _same_as_autograd(lambda x, b: nodes.ag_split_heads(x, b, 2, 4), lambda x, b: _split_ref(x, b, 2, 4),
                      [x3[..., :32], b3[:32]])
    # k unused: its gradient arrives undefined and counts as zero
    (x,) = _leaves(x3)
    q, k, v = nodes.ag_split_heads(x, None, 3, 4)
    (gx,) = torch.autograd.grad(q.sum() + 2 * v.sum(), [x])
    want = torch.cat([torch.ones(16), torch.zeros(16), torch.full((16,), 2.0)]).expand(2, 5, -1)
    assert torch.equal(gx, want)
    # any number of parts: one (a query), six (layer-batched keys and values), some unused
    _same_as_autograd(lambda x, b: nodes.ag_split_heads(x, b, 1, 4), lambda x, b: _split_ref(x, b, 1, 4),
                      [x3[..., :16], b3[:16]])
    x6 = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(9))
    out = _same_as_autograd(lambda x, b: nodes.ag_split_heads(x, b, 6, 2), lambda x, b: _split_ref(x, b, 6, 2),
                            [x6, b3])
    assert len(out) == 6
    (x,) = _leaves(x6)
    parts = nodes.ag_split_heads(x, None, 6, 2)
    (gx,) = torch.autograd.grad(parts[1].sum() + 3 * parts[4].sum(), [x])
    want = torch.zeros(48)
    want[8:16], want[32:40] = 1.0, 3.0
    assert torch.equal(gx, want.expand(2, 5, -1))
    with pytest.raises(Exception, match="n must be >= 1"):
        nodes.ag_split_heads(torch.randn(2, 3, 64), None, 0, 2)


def test_linear_split_node(nodes):
    """x W^T + b as n parts of heads that are views of one product: the values and gradients of F.linear followed
    by the split, for 1, 3 and 12 parts, with and without a bias, some parts unused."""
    w = torch.randn(48, 16, generator=torch.Generator().manual_seed(12))
    b = torch.randn(48, generator=torch.Generator().manual_seed(13))

    def ref(n, heads):
        return lambda x, w, b=None: _split_ref(F.linear(x, w), b, n, heads)

    out = _same_as_autograd(lambda x, w, b: nodes.ag_linear_split(x, w, b, 3, 4), ref(3, 4), [X, w, b])
    assert len(out) == 3 and "LinearSplitNode" in out[0].grad_fn.name()
    # the parts are views of one [B * T, 48] product: part i starts i * 16 values in, rows 48 apart
    assert out[1].data_ptr() - out[0].data_ptr() == 16 * out[0].element_size()
    assert out[0].stride() == (5 * 48, 4, 48, 1)
    _same_as_autograd(lambda x, w: nodes.ag_linear_split(x, w, None, 3, 4), ref(3, 4), [X, w])
    _same_as_autograd(lambda x, w, b: nodes.ag_linear_split(x, w, b, 1, 4), ref(1, 4), [X, w[:16], b[:16]])
    _same_as_autograd(lambda x, w, b: nodes.ag_linear_split(x, w, b, 12, 2), ref(12, 2), [X, w, b])
    # k unused, the input frozen: the weight's and the bias's gradients from q and v alone
    wl, bl = _leaves(w, b)
    q, k, v = nodes.ag_linear_split(X, wl, bl, 3, 4)
    gw, gb = torch.autograd.grad(q.sum() + 2 * v.sum(), [wl, bl])
    scale = torch.cat([torch.ones(16), torch.zeros(16), torch.full((16,), 2.0)])
    torch.testing.assert_close(gb, 10 * scale)
    torch.testing.assert_close(gw, scale[:, None] * X.reshape(-1, 16).sum(0)[None, :])
    with torch.no_grad():
        assert nodes.ag_linear_split(X, w, b, 3, 4)[0].grad_fn is None
    with pytest.raises(Exception, match="do not split into"):
        nodes.ag_linear_split(X, w, b, 5, 4)
    with pytest.raises(Exception, match="does not match weight"):
        nodes.ag_linear_split(X, torch.randn(48, 15), None, 3, 4)
    with pytest.raises(Exception, match="bias must be"):
        nodes.ag_linear_split(X, w, b[:47], 3, 4)


def test_linear_node(nodes):
    w = torch.randn(24, 16, generator=torch.Generator().manual_seed(7))
    b = torch.randn(24, generator=torch.Generator().manual_seed(8))
    out = _same_as_autograd(lambda x, w: nodes.ag_linear(x, w), F.linear, [X, w])
    assert "LinearNode" in out[0].grad_fn.name()
    assert not out[0]._is_view()  # like F.linear's folded product: no view bookkeeping downstream
    _same_as_autograd(lambda x, w, b: nodes.ag_linear(x, w, b), F.linear, [X, w, b])
    _same_as_autograd(lambda x, w, b: nodes.ag_linear(x, w, b), F.linear, [X[0], w, b])  # 2-d input
    # frozen input: only the weight's gradient; frozen weight: the input's and the bias's
    (wl,) = _leaves(w)
    (gw,) = torch.autograd.grad(nodes.ag_linear(X, wl).sum(), [wl])
    torch.testing.assert_close(gw, torch.ones(10, 24).t() @ X.reshape(-1, 16))
    x, bl = _leaves(X, b)
    gx, gb = torch.autograd.grad(nodes.ag_linear(x, w, bl).sum(), [x, bl])
    torch.testing.assert_close(gb, torch.full((24,), 10.0))
    torch.testing.assert_close(gx, torch.ones(2, 5, 24) @ w)
    with torch.no_grad():
        assert nodes.ag_linear(X, w, b).grad_fn is None
    with pytest.raises(Exception, match="does not match weight"):
        nodes.ag_linear(X, torch.randn(8, 15))


def test_weight_gradient_sinks(nodes):
    """While sinks are set (the CUDA-graph step's captured backward), the linear nodes write the weight gradient
    into the named place (overwrite, or add in accumulate mode; a weight used twice is added to the second time)
    and hand autograd none; the input's and the bias's gradients are unchanged; take_weight_grad_sinks names the
    parameters written so and turns the sinks off."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(24, 16, generator=gen, dtype=torch.float64).requires_grad_(True)
    w2 = torch.randn(16, 24, generator=gen, dtype=torch.float64).requires_grad_(True)
    b = torch.randn(24, generator=gen, dtype=torch.float64).requires_grad_(True)
    x = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64).requires_grad_(True)
    gy = torch.randn(2, 5, 16, generator=gen, dtype=torch.float64)

    def net(lin):
        return lin(torch.relu(lin(x, w, b)), w2, None)

    ref = torch.autograd.grad((net(lambda a, m, c: F.linear(a, m, c)) * gy).sum(), [x, w, w2, b])
    flat = torch.full((24 * 16 + 16 * 24,), 7.0, dtype=torch.float64)
    dw, dw2 = flat[:384].view(24, 16), flat[384:].view(16, 24)
    nodes.set_weight_grad_sinks([w, w2], [dw, dw2], False)
    (net(nodes.ag_linear) * gy).sum().backward()
    assert sorted(nodes.take_weight_grad_sinks()) == sorted([w.data_ptr(), w2.data_ptr()])
    assert w.grad is None and w2.grad is None  # written into the sinks, not handed to autograd
    torch.testing.assert_close(dw, ref[1])
    torch.testing.assert_close(dw2, ref[2])
    torch.testing.assert_close(x.grad, ref[0])
    torch.testing.assert_close(b.grad, ref[3])
    # accumulate: added to what the sink holds; only the weights named get sinks
    x.grad = b.grad = None
    nodes.set_weight_grad_sinks([w], [dw], True)
    (net(nodes.ag_linear) * gy).sum().backward()
    assert nodes.take_weight_grad_sinks() == [w.data_ptr()]
    torch.testing.assert_close(dw, 2 * ref[1])
    torch.testing.assert_close(w2.grad, ref[2])
    # a weight used twice, overwrite mode: the first use overwrites, the second adds
    wt = torch.randn(16, 16, generator=gen, dtype=torch.float64).requires_grad_(True)
    (want,) = torch.autograd.grad((F.linear(F.linear(x, wt), wt) * gy).sum(), [wt])
    dwt = torch.full((16, 16), 5.0, dtype=torch.float64)
    nodes.set_weight_grad_sinks([wt], [dwt], False)
    (nodes.ag_linear(nodes.ag_linear(x, wt), wt) * gy).sum().backward()
    assert nodes.take_weight_grad_sinks() == [wt.data_ptr()]
    torch.testing.assert_close(dwt, want)
    # the activation + linear node (its weight) too
    wa = torch.randn(16, 16, generator=gen, dtype=torch.float64).requires_grad_(True)
    (want,) = torch.autograd.grad((F.linear(torch.relu(x + 0.5), wa) * gy).sum(), [wa])
    dwa = torch.zeros(16, 16, dtype=torch.float64)
    nodes.set_weight_grad_sinks([wa], [dwa], False)
    (nodes.ag_bias_act_linear(x, torch.full((16,), 0.5, dtype=torch.float64), wa, "relu", 0.0)[0] * gy).sum().backward()
    assert nodes.take_weight_grad_sinks() == [wa.data_ptr()]
    torch.testing.assert_close(dwa, want)
    # add_weight_grad_sinks (the head's weights, whose slices already hold the head's part): always added to, in
    # overwrite mode too, beside the overwritten ones
    dwh = torch.full((16, 16), 3.0, dtype=torch.float64)
    dwa.fill_(9.0)
    nodes.set_weight_grad_sinks([wa], [dwa], False)
    nodes.add_weight_grad_sinks([wt], [dwh])
    (nodes.ag_linear(nodes.ag_linear(x, wa), wt) * gy).sum().backward()
    assert sorted(nodes.take_weight_grad_sinks()) == sorted([wa.data_ptr(), wt.data_ptr()])
    want_a, want_t = torch.autograd.grad((F.linear(F.linear(x, wa), wt) * gy).sum(), [wa, wt])
    torch.testing.assert_close(dwa, want_a)
    torch.testing.assert_close(dwh, 3.0 + want_t)
    # no sinks any more: autograd gets the gradient again
    (nodes.ag_linear(x, wa) * gy).sum().backward()
    assert wa.grad is not None and nodes.take_weight_grad_sinks() == []
    # a sink that cannot take the product (another dtype) is refused when it is named
    with pytest.raises(Exception, match="does not match parameter"):
        nodes.set_weight_grad_sinks([w], [dw.float()], False)
    with pytest.raises(Exception, match="2 parameters but 1 destinations"):
        nodes.set_weight_grad_sinks([w, w2], [dw], False)
    assert nodes.take_weight_grad_sinks() == []


# ---- whole layers (csrc/torch/layers.cpp) against the Python layers of ls_fairseq/modules ---------------------
# On the CPU the Python layers run the PyTorch references, so this checks that the C++ layer strings the same
# computation together (blocks, residuals, layer-norm placement, masks, the cross-attention inputs) and that
# every weight gets its gradient. tests/gpu/test_cpp_nodes_gpu.py compares the two on the GPU bit for bit.

def _layer_inputs(layer, *tensors):
    leaves = _leaves(*tensors)
    return leaves, leaves + [p for p in layer.parameters()]


def _same_layer(layer, python_forward, cpp_forward, tensors):
    (a, grads_of_a), (b, grads_of_b) = _layer_inputs(layer, *tensors), _layer_inputs(layer, *tensors)
    ya, yb = python_forward(*a), cpp_forward(*b)
    torch.testing.assert_close(yb, ya)
    gy = torch.randn(ya.shape, dtype=ya.dtype, generator=torch.Generator().manual_seed(11))
    ga = torch.autograd.grad((ya * gy).sum(), grads_of_a, allow_unused=True)
    gb = torch.autograd.grad((yb * gy).sum(), grads_of_b, allow_unused=True)
    for i, (x, y) in enumerate(zip(gb, ga)):
        assert x is not None and y is not None, i
        torch.testing.assert_close(x, y, msg=lambda m: f"gradient {i}: {m}")
    return yb


def _pad_mask(batch, length, lengths, left=False):
    m = torch.zeros(batch, length, dtype=torch.bool)
    for i, n in enumerate(lengths):
        if left:
            m[i, :length - n] = True
        else:
            m[i, n:] = True
    return m


@pytest.fixture
def layer_path(nodes, monkeypatch):
    """route(cpp): the layer modules' forward takes the C++ layer call over the stand-ins (cpp=True) or
    their Python ops (cpp=False), as ls_fairseq.ops._dispatch.cpp_layers would choose on CUDA."""
    from ls_fairseq.modules import encoder_layer  # both layers' choice (the decoder layer inherits it)

    def route(cpp: bool):
        monkeypatch.setattr(encoder_layer, "cpp_layers", (lambda x: nodes) if cpp else (lambda x: None))

    return route


@pytest.mark.parametrize("pre", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("padded", [False, True], ids=["no_pad", "pad"])
def test_encoder_layer_call_matches_the_python_layer(layer_path, pre, act, padded):
    from ls_fairseq.modules.encoder_layer import EncoderLayer

    torch.manual_seed(0)
    layer = EncoderLayer(16, 32, 4, dropout=0.0, activation=act, normalize_before=pre).double()
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    kpm = _pad_mask(3, 7, [7, 4, 2]) if padded else None

    def forward(cpp):
        def f(x, *params):
            layer_path(cpp)
            return layer(x, kpm)
        return f

    _same_layer(layer, forward(False), forward(True), [x])
    assert len(layer.cpp_weights()) == len(list(layer.parameters())) == 12


@pytest.mark.parametrize("pre", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("masks", ["none", "encoder", "both"])
def test_decoder_layer_call_matches_the_python_layer(layer_path, pre, masks):
    from ls_fairseq.modules.decoder_layer import DecoderLayer

    torch.manual_seed(1)
    layer = DecoderLayer(16, 32, 4, dropout=0.0, activation="relu", normalize_before=pre).double()
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    k = torch.randn(3, 4, 9, 4, dtype=torch.float64)
    v = torch.randn(3, 4, 9, 4, dtype=torch.float64)
    enc_pad = _pad_mask(3, 9, [9, 5, 3]) if masks != "none" else None
    self_pad = _pad_mask(3, 6, [6, 4, 2], left=True) if masks == "both" else None

    def forward(cpp):
        def f(x, k, v, *params):
            layer_path(cpp)
            return layer(x, k, v, enc_pad, self_pad)
        return f

    _same_layer(layer, forward(False), forward(True), [x, k, v])
    assert len(layer.cpp_weights()) == len(list(layer.parameters())) == 18


@pytest.mark.parametrize("pre", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
def test_layer_calls_with_the_memory_modes(layer_path, pre, decoder):
    """Both memory modes on: the C++ call equals the Python layer with the modes, and both equal the layer
    without them."""
    from ls_fairseq.modules.decoder_layer import DecoderLayer
    from ls_fairseq.modules.encoder_layer import EncoderLayer
    from ls_fairseq.modules.layer_norm import LayerNorm

    torch.manual_seed(2)
    cls = DecoderLayer if decoder else EncoderLayer
    layer = cls(16, 32, 4, dropout=0.0, activation="gelu", normalize_before=pre).double()
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    kv = [torch.randn(3, 4, 9, 4, dtype=torch.float64) for _ in range(2)] if decoder else []

    def set_modes(on):
        layer.recompute_activation = on
        for m in layer.modules():
            if isinstance(m, LayerNorm):
                m.invertible = on

    def forward(cpp, modes):
        def f(x, *rest):
            layer_path(cpp)
            set_modes(modes)
            return layer(x, *rest[:len(kv)])
        return f

    assert layer.memory_bits() == 0
    _same_layer(layer, forward(False, True), forward(True, True), [x] + kv)
    _same_layer(layer, forward(False, False), forward(True, True), [x] + kv)
    set_modes(True)
    assert layer.memory_bits() == 3


def test_layer_call_under_activation_checkpointing(layer_path):
    """--checkpoint-activations: torch's saved-tensor hooks (Python) run inside the C++ call, whose GIL is
    released, and the recomputation runs it again from the backward; the same output and gradients."""
    from torch.utils.checkpoint import checkpoint

    from ls_fairseq.modules.encoder_layer import EncoderLayer

    torch.manual_seed(2)
    layer = EncoderLayer(16, 32, 4, dropout=0.0, normalize_before=True).double()
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    kpm = _pad_mask(3, 7, [7, 5, 3])

    def plain(x, *params):
        layer_path(False)
        return layer(x, kpm)

    def checkpointed(x, *params):
        layer_path(True)
        return checkpoint(layer, x, kpm, use_reentrant=False)

    _same_layer(layer, plain, checkpointed, [x])


def test_layer_dropouts_follow_each_block_and_its_training_flag():
    """The C++ call gets each dropout as the Python layer's ops apply it: the layer's own flag for the
    residual and activation dropouts, each attention block's flag and probability for its attention."""
    from ls_fairseq.modules.decoder_layer import DecoderLayer

    layer = DecoderLayer(16, 32, 4, dropout=0.1, attention_dropout=0.2, activation_dropout=0.3).train()
    layer.encoder_attn.attention_dropout = 0.4
    assert layer.cpp_dropouts() == (0.1, 0.3, 0.2, 0.4)
    layer.encoder_attn.eval()
    assert layer.cpp_dropouts() == (0.1, 0.3, 0.2, 0.0)
    layer.eval()
    assert layer.cpp_dropouts() == (0.0, 0.0, 0.0, 0.0)
    assert layer.cpp_args()[3:7] == (0.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("cross_p", [0.0, 0.3])
def test_decoder_layer_call_applies_each_attention_dropout(layer_path, cross_p):
    """Attention dropout (SDPA's own, which runs on the CPU too) in the self- and the cross-attention with
    different probabilities: the same draws in the same order as the Python layer, so the same output."""
    from ls_fairseq.modules.decoder_layer import DecoderLayer

    torch.manual_seed(3)
    layer = DecoderLayer(16, 32, 4, dropout=0.0, attention_dropout=0.2).double().train()
    layer.encoder_attn.attention_dropout = cross_p
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    k = torch.randn(3, 4, 9, 4, dtype=torch.float64)
    enc_pad = _pad_mask(3, 9, [9, 5, 3])
    self_pad = _pad_mask(3, 6, [6, 4, 2], left=True)  # explicit masks: both paths take SDPA's masked kernel
    out = {}
    for cpp in (False, True):
        layer_path(cpp)
        torch.manual_seed(4)
        out[cpp] = layer(x, k, k, enc_pad, self_pad)
    torch.testing.assert_close(out[True], out[False], rtol=1e-12, atol=1e-12)
    torch.manual_seed(5)
    assert not torch.allclose(layer(x, k, k, enc_pad, self_pad), out[True])  # dropout did act


def test_incremental_decoding_keeps_the_python_layer(layer_path):
    """A decoder layer with a cache (beam search) never takes the C++ call."""
    from ls_fairseq.modules.decoder_layer import DecoderLayer

    layer = DecoderLayer(16, 32, 4, dropout=0.0).double().eval()
    layer_path(True)
    layer.cpp_weights = None  # the C++ call would need it
    k = torch.randn(2, 4, 9, 4, dtype=torch.float64)
    cache = {}
    layer(torch.randn(2, 1, 16, dtype=torch.float64), k, k, None, None, cache=cache)
    assert cache["prev_key"].shape == (2, 4, 1, 4)


def test_layer_calls_leave_the_attention_backends_as_they_were(nodes):
    from ls_fairseq.modules.encoder_layer import EncoderLayer

    layer = EncoderLayer(16, 32, 4, dropout=0.0).double()
    flags = (torch.backends.cuda.flash_sdp_enabled, torch.backends.cuda.mem_efficient_sdp_enabled,
             torch.backends.cuda.math_sdp_enabled, torch.backends.cuda.cudnn_sdp_enabled)
    before = [f() for f in flags]
    order = list(torch._C._get_sdp_priority_order())
    for short_len in (64, 0):  # a short and a long sequence: the short one reorders the backends for its call
        nodes.encoder_layer_fwd(torch.randn(2, 5, 16, dtype=torch.float64), None, layer.cpp_weights(),
                                layer.cpp_eps(), 4, 0.0, 0.0, 0.0, "relu", False, short_len)
        assert [f() for f in flags] == before
        assert list(torch._C._get_sdp_priority_order()) == order


def test_layer_calls_refuse_bad_arguments_with_clear_errors(nodes):
    from ls_fairseq.modules.decoder_layer import DecoderLayer
    from ls_fairseq.modules.encoder_layer import EncoderLayer

    enc = EncoderLayer(16, 32, 4, dropout=0.0).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    w, eps = enc.cpp_weights(), enc.cpp_eps()
    with pytest.raises(Exception, match="expected 12 weights, got 11"):
        nodes.encoder_layer_fwd(x, None, w[:-1], eps, 4, 0.0, 0.0, 0.0, "relu", False, 64)
    with pytest.raises(Exception, match=r"does not match embed_dim 16"):
        nodes.encoder_layer_fwd(x[..., :8], None, w, eps, 4, 0.0, 0.0, 0.0, "relu", False, 64)
    with pytest.raises(Exception, match="not divisible by num_heads 5"):
        nodes.encoder_layer_fwd(x, None, w, eps, 5, 0.0, 0.0, 0.0, "relu", False, 64)
    with pytest.raises(Exception, match="key_padding_mask .* != \\(batch, length\\) \\(2, 5\\)"):
        nodes.encoder_layer_fwd(x, torch.zeros(2, 4, dtype=torch.bool), w, eps, 4, 0.0, 0.0, 0.0, "relu", False, 64)
    with pytest.raises(Exception, match="weight 8 is Float"):
        nodes.encoder_layer_fwd(x, None, w[:8] + [w[8].float()] + w[9:], eps, 4, 0.0, 0.0, 0.0, "relu", False, 64)
    with pytest.raises(Exception, match="unsupported activation 'tanh'"):
        nodes.encoder_layer_fwd(x, None, w, eps, 4, 0.0, 0.0, 0.0, "tanh", False, 64)
    with pytest.raises(Exception, match=r"dropout probability must be in \[0, 1\), got 1"):
        nodes.encoder_layer_fwd(x, None, w, eps, 4, 1.0, 0.0, 0.0, "relu", False, 64)
    dec = DecoderLayer(16, 32, 4, dropout=0.0).double()
    k = torch.randn(2, 4, 9, 4, dtype=torch.float64)
    with pytest.raises(Exception, match="encoder keys/values must be \\[2, 4, source length, 4\\]"):
        nodes.decoder_layer_fwd(x, k[:1], k, None, None, dec.cpp_weights(), dec.cpp_eps(), 4, 0.0, 0.0, 0.0, 0.0,
                                "relu", False, 64)
    with pytest.raises(Exception, match="encoder_padding_mask .* \\(2, 9\\)"):
        nodes.decoder_layer_fwd(x, k, k, torch.zeros(2, 5, dtype=torch.bool), None, dec.cpp_weights(),
                                dec.cpp_eps(), 4, 0.0, 0.0, 0.0, 0.0, "relu", False, 64)
    with pytest.raises(Exception, match="expected 3 layer-norm eps values"):
        nodes.decoder_layer_fwd(x, k, k, None, None, dec.cpp_weights(), eps, 4, 0.0, 0.0, 0.0, 0.0, "relu", False,
                                64)
    with pytest.raises(Exception, match=r"dropout probability must be in \[0, 1\), got 1"):  # the cross-attention's
        nodes.decoder_layer_fwd(x, k, k, None, None, dec.cpp_weights(), dec.cpp_eps(), 4, 0.0, 0.0, 0.0, 1.0,
                                "relu", False, 64)


def _packed_rows(pad_mask):
    """[1, N] packing of a [B, T] batch: (index of the real rows in the flattened batch, Varlen pieces)."""
    real = ~pad_mask
    lengths = real.sum(1)
    cu = torch.zeros(real.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(lengths, 0, out=cu[1:])
    return real.reshape(-1).nonzero().squeeze(1), cu, int(lengths.max())


@pytest.mark.parametrize("cpp", [False, True], ids=["python", "cpp"])
@pytest.mark.parametrize("pre", [False, True], ids=["post_ln", "pre_ln"])
def test_packed_encoder_layer_equals_the_padded_layer(layer_path, cpp, pre):
    """Packed sentences ([1, tokens, C], attention within each sentence's rows) give the padded layer's
    outputs at the real positions, and the same weight gradients, through the Python layer and the C++ call."""
    from ls_fairseq.modules.encoder_layer import EncoderLayer
    from ls_fairseq.ops.attention import Varlen

    torch.manual_seed(3)
    layer = EncoderLayer(16, 32, 4, dropout=0.0, activation="relu", normalize_before=pre).double()
    kpm = _pad_mask(3, 7, [7, 4, 2], left=True)
    x = torch.randn(3, 7, 16, dtype=torch.float64)
    idx, cu, m = _packed_rows(kpm)
    layer_path(cpp)
    y = layer(x, kpm).reshape(-1, 16).index_select(0, idx)
    yp = layer(x.reshape(-1, 16).index_select(0, idx).unsqueeze(0), None, Varlen(cu, cu, m, m))
    assert yp.shape == (1, idx.numel(), 16)
    torch.testing.assert_close(yp[0], y)
    gy = torch.randn(y.shape, dtype=y.dtype)
    params = list(layer.parameters())
    for a, b in zip(torch.autograd.grad((yp[0] * gy).sum(), params), torch.autograd.grad((y * gy).sum(), params)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("cpp", [False, True], ids=["python", "cpp"])
def test_packed_decoder_layer_equals_the_padded_layer(layer_path, cpp):
    """The decoder layer over packed sentences: causal self-attention within each target sentence,
    cross-attention from its rows to its own source sentence's rows."""
    from ls_fairseq.modules.decoder_layer import DecoderLayer
    from ls_fairseq.ops.attention import Varlen

    torch.manual_seed(4)
    layer = DecoderLayer(16, 32, 4, dropout=0.0, activation="relu", normalize_before=True).double()
    tgt_pad, src_pad = _pad_mask(3, 6, [6, 4, 1]), _pad_mask(3, 9, [9, 5, 3], left=True)
    x = torch.randn(3, 6, 16, dtype=torch.float64)
    k = torch.randn(3, 4, 9, 4, dtype=torch.float64)
    v = torch.randn(3, 4, 9, 4, dtype=torch.float64)
    ti, cu_t, mt = _packed_rows(tgt_pad)
    si, cu_s, ms = _packed_rows(src_pad)

    def pack_heads(t):  # [B, H, S, D] -> [1, H, Ns, D]
        return t.transpose(1, 2).reshape(-1, 4, 4).index_select(0, si).transpose(0, 1).unsqueeze(0)

    layer_path(cpp)
    y = layer(x, k, v, src_pad, None).reshape(-1, 16).index_select(0, ti)
    yp = layer(x.reshape(-1, 16).index_select(0, ti).unsqueeze(0), pack_heads(k), pack_heads(v), None, None,
               varlen=Varlen(cu_t, cu_s, mt, ms))
    torch.testing.assert_close(yp[0], y)
    gy = torch.randn(y.shape, dtype=y.dtype)
    params = list(layer.parameters())
    for a, b in zip(torch.autograd.grad((yp[0] * gy).sum(), params), torch.autograd.grad((y * gy).sum(), params)):
        torch.testing.assert_close(a, b)


def test_packed_layer_calls_refuse_bad_arguments(nodes):
    from ls_fairseq.modules.decoder_layer import DecoderLayer
    from ls_fairseq.modules.encoder_layer import EncoderLayer

    enc = EncoderLayer(16, 32, 4, dropout=0.0).double()
    args = (enc.cpp_weights(), enc.cpp_eps(), 4, 0.0, 0.0, 0.0, "relu", False, 64, 0, None, 0, 0)
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(Exception, match="cu_seqlens must be int32"):
        nodes.encoder_layer_fwd(x, None, *args, cu.long(), 3)
    with pytest.raises(Exception, match="one row \\[1, tokens, embed_dim\\]"):
        nodes.encoder_layer_fwd(torch.randn(2, 5, 16, dtype=torch.float64), None, *args, cu, 3)
    with pytest.raises(Exception, match="take no padding mask"):
        nodes.encoder_layer_fwd(x, torch.zeros(1, 5, dtype=torch.bool), *args, cu, 3)
    with pytest.raises(Exception, match="longest packed sentence"):
        nodes.encoder_layer_fwd(x, None, *args, cu, 0)
    dec = DecoderLayer(16, 32, 4, dropout=0.0).double()
    k = torch.randn(1, 4, 9, 4, dtype=torch.float64)
    dargs = (dec.cpp_weights(), dec.cpp_eps(), 4, 0.0, 0.0, 0.0, 0.0, "relu", False, 64, 0, None, 0, 0)
    with pytest.raises(Exception, match="need both cu_tgt and cu_src"):
        nodes.decoder_layer_fwd(x, k, k, None, None, *dargs, cu, 3, None, 0)
    with pytest.raises(Exception, match="count the same sentences"):
        nodes.decoder_layer_fwd(x, k, k, None, None, *dargs, cu, 3, torch.tensor([0, 9], dtype=torch.int32), 9)
