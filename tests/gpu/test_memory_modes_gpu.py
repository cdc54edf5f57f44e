"""The memory modes' kernels and nodes on the GPU: the invertible layer-norm backward against the fp64 reference
(the tolerance rule) and against zero weights, the dropout replay bit for bit, the recomputing FFN node bit for
bit against the stored pair (also with FP8), the in-place cross-entropy backward, whole layers with the modes,
and the memory each saves in a training step."""

import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from ls_fairseq import _ext
from ls_fairseq.ops.layer_norm import layer_norm_reference
from tests._models import saved_bytes
from ._tols import DTYPES, assert_close_to_gold

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _mod():
    return _ext.get()


def _peak_bytes_of(step):
    """GPU memory ``step()`` allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _leaf(t, dtype=None):
    return (t.to(dtype) if dtype is not None else t).detach().clone().requires_grad_(True)


# ---------------------------------------------------------------- invertible layer norm
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", [1, 7, 63, 1024, 1031, 8192])
@pytest.mark.parametrize("rows", [1, 13, 4099])
@pytest.mark.parametrize("pre", [False, True], ids=["plain", "pre_ln"])
def test_invertible_layer_norm_against_the_reference(dtype, C, rows, pre):
    g = torch.Generator(device="cuda").manual_seed(C * 7 + rows)
    x = torch.randn(rows, C, device="cuda", generator=g) * 2 + 0.5
    # weights of either sign with |w| in [0.5, 1.5]: the recovered input carries y's rounding divided by |w|
    # (ls_fairseq/ops/layer_norm.py), so much smaller weights amplify it beyond the stored path's error
    w = (0.5 + torch.rand(C, device="cuda", generator=g)) * torch.sign(torch.randn(C, device="cuda", generator=g))
    b = 0.2 * torch.randn(C, device="cuda", generator=g)
    gy = torch.randn(rows, C, device="cuda", generator=g)
    gx = torch.randn(rows, C, device="cuda", generator=g)  # pre-LN: the residual branch's gradient
    nodes = _mod()

    def grads(fn, dt, inv):
        ins = [_leaf(t, dt) for t in (x, w, b)]
        if pre:
            y, xs = fn(*ins, inv)
            loss = (y.double() * gy.double()).sum() + (xs.double() * gx.double()).sum()
        else:
            y = fn(*ins, inv)
            loss = (y.double() * gy.double()).sum()
        return y, torch.autograd.grad(loss, ins)

    if pre:
        fused = lambda x, w, b, inv: tuple(nodes.ag_pre_layer_norm(x, w, b, 1e-5, inv))  # noqa: E731
        ref = lambda x, w, b, inv: (layer_norm_reference(x, w, b), x * 1)  # noqa: E731
    else:
        fused = lambda x, w, b, inv: nodes.ag_layer_norm(x, None, w, b, 1e-5, inv)[0]  # noqa: E731
        ref = lambda x, w, b, inv: F.layer_norm(x, (C,), w, b, 1e-5)  # noqa: E731
    y_inv, g_inv = grads(fused, dtype, True)
    y_st, g_st = grads(fused, dtype, False)
    _, g_lowp = grads(ref, dtype, False)
    _, g_gold = grads(ref, torch.float64, False)
    assert torch.equal(y_inv[0] if pre else y_inv, y_st[0] if pre else y_st)  # the same forward
    for name, a, lo, gold in zip(("dx", "dweight", "dbias"), g_inv, g_lowp, g_gold):
        assert_close_to_gold(a, lo, gold, dtype, f"invertible {name}")
    assert torch.equal(g_inv[2], g_st[2])  # dbias = sum(dy) does not depend on the input


def test_invertible_layer_norm_zero_weight_gives_nan_not_a_wrong_value():
    x = torch.randn(64, 1024, device="cuda", dtype=torch.float16)
    w = torch.ones(1024, device="cuda", dtype=torch.float16)
    w[17] = 0
    b = torch.randn(1024, device="cuda", dtype=torch.float16)
    xs, ws, bs = _leaf(x), _leaf(w), _leaf(b)
    y = _mod().ag_layer_norm(xs, None, ws, bs, 1e-5, True)[0]
    dx, dw, db = torch.autograd.grad((y.float() ** 2).sum(), [xs, ws, bs])
    assert torch.isnan(dx).all() and torch.isnan(dw[17])
    assert torch.isfinite(db).all()


# ---------------------------------------------------------------- dropout replay and the recomputing FFN node
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("shape", [(3, 7, 4096), (5, 13), (1, 1031)])
def test_dropout_replay_is_the_forward_bit_for_bit(dtype, act, p, shape):
    x = torch.randn(shape, device="cuda", dtype=dtype)
    b = torch.randn(shape[-1], device="cuda", dtype=dtype)
    out, mask = _mod().bias_act_dropout_fwd(x, b, act, p)
    again = _mod().bias_act_dropout_replay(x, b, mask if p > 0 else None, act, p)
    assert torch.equal(again, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["relu", "gelu"])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("fp8", [0, 2], ids=["plain", "fp8"])
def test_recomputing_node_equals_the_stored_pair_bit_for_bit(dtype, act, p, fp8):
    if fp8 and (dtype == torch.float32 or torch.cuda.get_device_capability() < (8, 9)):
        pytest.skip("FP8 needs bf16/fp16 and FP8 tensor cores")
    nodes = _mod()
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4, 37, 1024, device="cuda", generator=g).to(dtype)
    b = (0.1 * torch.randn(1024, device="cuda", generator=g)).to(dtype)
    w = (0.05 * torch.randn(256, 1024, device="cuda", generator=g)).to(dtype)
    gy = torch.randn(4, 37, 256, device="cuda", generator=g).to(dtype)

    def run(recompute, mode, state):
        ins = [_leaf(t) for t in (x, b, w)]
        torch.manual_seed(11)
        if recompute:
            y = nodes.ag_bias_act_linear(ins[0], ins[1], ins[2], act, p, mode, state, 0)[0]
        else:
            a = nodes.ag_bias_act_dropout(ins[0], ins[1], act, p)[0]
            y = nodes.ag_fp8_linear(a, ins[2], None, mode, state, 0) if mode else nodes.ag_linear(a, ins[2], None)
        return y, torch.autograd.grad(y, ins, gy)

    for current in ([True, False] if fp8 else [True]):  # FP8: the first (current) pass, then a delayed one
        states = []
        for _ in range(2):  # one state for each path
            st = torch.zeros(3, 20, device="cuda")
            if not current:  # a history from one pass of the same tensors
                st[:, 2] = torch.tensor([3.0, 0.2, 0.01], device="cuda")  # the recorded maxima
                nodes.fp8_roll(st, fp8 - 1)
            states.append(st)
        mode = fp8 + (2 if current and fp8 else 0)
        y_r, g_r = run(True, mode, states[0])
        y_s, g_s = run(False, mode, states[1])
        assert torch.equal(y_r, y_s)
        for name, a, s in zip(("dx", "dbias", "dweight"), g_r, g_s):
            assert torch.equal(a, s), name
        assert torch.equal(states[0], states[1])  # the same maxima recorded


# ---------------------------------------------------------------- the in-place cross-entropy backward
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_backward_in_place_equals_out_of_place(dtype):
    from ls_fairseq import ops

    torch.manual_seed(0)
    logits = torch.randn(333, 32000, device="cuda").to(dtype)
    target = torch.randint(0, 32000, (333,), device="cuda")
    target[::7] = 1
    m = _mod()
    loss, nll, lse = m.ls_cross_entropy_fwd(logits, target, 0.1, 1)
    g1, g2 = torch.ones((), device="cuda"), torch.full((), 0.5, device="cuda")
    apart = m.ls_cross_entropy_bwd(logits, target, lse, g1, g2, 0.1, 1, False)
    work = logits.clone()
    same = m.ls_cross_entropy_bwd(work, target, lse, g1, g2, 0.1, 1, True)
    assert same.data_ptr() == work.data_ptr() and torch.equal(same, apart)
    # through the op: with reuse_logits the gradient takes the logits' memory, and a second backward is refused
    x = _leaf(logits)
    y = x * 1
    out = ops.label_smoothed_cross_entropy(y, target, 0.1, ignore_index=1, reuse_logits=True)
    (gx,) = torch.autograd.grad(out[0] + 0.5 * out[1], [x], retain_graph=True)
    assert torch.equal(gx, apart) and torch.equal(y, apart)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(out[0], [x])
    # a leaf, and any logits without reuse_logits, are never overwritten
    for leaf, reuse in ((True, True), (False, False)):
        x = _leaf(logits)
        y = x if leaf else x * 1
        keep = y.detach().clone()
        out = ops.label_smoothed_cross_entropy(y, target, 0.1, ignore_index=1, reuse_logits=reuse)
        (gx,) = torch.autograd.grad(out[0] + 0.5 * out[1], [x])
        assert torch.equal(gx, apart) and torch.equal(y.detach(), keep)


def test_cross_entropy_backward_peak_is_one_vocabulary_tensor_lower():
    from ls_fairseq import ops

    N, V = 8192, 32768
    w = torch.randn(V, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    h = torch.randn(N, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    target = torch.randint(0, V, (N,), device="cuda")
    extra = _peak_bytes_of(
        lambda: ops.label_smoothed_cross_entropy(ops.linear(h, w), target, 0.1, reuse_logits=True)[0].backward())
    logits_bytes = N * V * 2
    # logits (= their gradient) plus the small gradients; out of place it would be two vocabulary tensors
    assert extra < 1.5 * logits_bytes, (extra, logits_bytes)


# ---------------------------------------------------------------- whole layers and a training step
def _layer(decoder, dtype, act="gelu", pre=True):
    from ls_fairseq.modules.decoder_layer import DecoderLayer
    from ls_fairseq.modules.encoder_layer import EncoderLayer

    torch.manual_seed(3)
    cls = DecoderLayer if decoder else EncoderLayer
    return cls(1024, 4096, 16, dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, activation=act,
               normalize_before=pre).to("cuda", dtype)


def _set_modes(layer, invertible, recompute):
    from ls_fairseq.modules.layer_norm import LayerNorm

    layer.recompute_activation = recompute
    for m in layer.modules():
        if isinstance(m, LayerNorm):
            m.invertible = invertible


@pytest.mark.parametrize("decoder", [False, True], ids=["encoder", "decoder"])
@pytest.mark.parametrize("pre", [False, True], ids=["post_ln", "pre_ln"])
def test_layers_with_the_modes(decoder, pre):
    """fp16, dropout on: recompute alone is bit for bit; with the invertible layer norms too the forward is
    bit for bit and every gradient within the fp16 tolerance of the stored path."""
    dtype = torch.float16
    layer = _layer(decoder, dtype, pre=pre)
    torch.manual_seed(1)
    x = torch.randn(8, 40, 1024, device="cuda", dtype=dtype)
    kv = [torch.randn(8, 16, 33, 64, device="cuda", dtype=dtype) for _ in range(2)] if decoder else []
    gy = torch.randn(8, 40, 1024, device="cuda", dtype=dtype)

    def run(inv, rec):
        _set_modes(layer, inv, rec)
        layer.zero_grad(set_to_none=True)
        xs = _leaf(x)
        torch.manual_seed(7)
        y = layer(xs, *kv)
        y.backward(gy)
        return y.detach(), [xs.grad] + [p.grad for p in layer.parameters()]

    run(False, False)  # a first call of these shapes (kernel selection) before the compared ones
    y0, g0 = run(False, False)
    y1, g1 = run(False, True)
    y2, g2 = run(True, True)
    assert torch.equal(y0, y1) and torch.equal(y0, y2)
    for i, (a, b) in enumerate(zip(g1, g0)):
        assert torch.equal(a, b), i
    for i, (a, b) in enumerate(zip(g2, g0)):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * max(1.0, b.abs().max().item()),
                                   msg=lambda m: f"gradient {i}: {m}")


def test_modes_lower_a_layers_saved_activations():
    """The bytes a gelu pre-LN encoder layer keeps for its backward (fp16, 8192 tokens): the modes free one
    [tokens, C] per layer norm and one [tokens, ffn] for the activation."""
    dtype = torch.float16
    layer = _layer(False, dtype)
    x = torch.randn(64, 128, 1024, device="cuda", dtype=dtype, requires_grad=True)

    def kept(inv, rec):
        _set_modes(layer, inv, rec)
        return saved_bytes(lambda: layer(x * 1), list(layer.parameters()))[1]

    stored, inv, both = kept(False, False), kept(True, False), kept(True, True)
    tok = 64 * 128
    assert stored - inv >= 2 * tok * 1024 * 2  # two layer norms' inputs
    assert inv - both >= tok * 4096 * 2  # the gelu output


# ---------------------------------------------------------------- logits recomputed in blocks
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [333, 4096, 9001])
def test_linear_cross_entropy_in_blocks_against_the_stored_path(dtype, rows):
    from ls_fairseq import ops
    from ls_fairseq.ops.linear_cross_entropy import linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.randn(rows, 512, device="cuda", generator=g)
    w = 0.05 * torch.randn(32000, 512, device="cuda", generator=g)
    t = torch.randint(0, 32000, (rows,), device="cuda", generator=g)
    t[::5] = 1

    def stored(dt):
        a = [_leaf(x, dt) for x in (h, w)]
        loss, nll = ops.label_smoothed_cross_entropy(ops.linear(a[0], a[1]), t, 0.1, ignore_index=1)
        return loss, torch.autograd.grad(loss * 64 + nll, a)

    a = [_leaf(x, dtype) for x in (h, w)]
    loss, nll, best = linear_cross_entropy(a[0], a[1], t, 0.1, 1, chunk_rows=4096, argmax=True)
    grads = torch.autograd.grad(loss * 64 + nll, a)
    ref_loss, ref = stored(dtype)
    gold_loss, gold = stored(torch.float64)
    torch.testing.assert_close(loss.double(), gold_loss, rtol=1e-3, atol=0)
    assert abs(loss.double() - gold_loss) <= 2 * abs(ref_loss.double() - gold_loss) + 1e-5 * abs(gold_loss)
    for name, x, lo, gd in zip(("dh", "dweight"), grads, ref, gold):
        assert_close_to_gold(x, lo, gd, dtype, name)
    assert torch.equal(best, ops.linear(a[0], a[1]).argmax(1))


def test_linear_cross_entropy_peak_holds_no_logits():
    from ls_fairseq.ops.linear_cross_entropy import linear_cross_entropy

    N, V = 32768, 32768
    h = torch.randn(N, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    w = torch.randn(V, 256, device="cuda", dtype=torch.float16, requires_grad=True)
    t = torch.randint(0, V, (N,), device="cuda")
    extra = _peak_bytes_of(lambda: linear_cross_entropy(h, w, t, 0.1, chunk_rows=4096)[0].backward())
    assert extra < N * V * 2 / 4, extra  # one 4096-row block of logits and the gradients, not [N, V]


# ---------------------------------------------------------------- lightseq-train with every mode
_FP8 = ["--bf16", "--fp8", "--fp8-projections", "all"]


@pytest.mark.parametrize("precision", [["--fp16"], _FP8,
                                       _FP8 + ["--encoder-normalize-before", "--decoder-normalize-before"]],
                         ids=["fp16", "bf16_fp8", "bf16_fp8_pre_ln"])
def test_lightseq_train_with_all_modes_and_graph_step(corpus, tmp_path, precision):
    """All three modes with the CUDA-graph step (and FP8): the same loss curve as without them, within the noise
    of their different rounding (dropout 0, so the curves are comparable step by step). In pre-LN FP8 the run without
    modes writes the layer norms before the FP8 projections only as their codes (fp8.cpp: pre_ln_codes) and the run
    with them (the invertible layer norm) stores them: the two paths against each other."""
    from tests._models import SMALL_LS_TRAIN, train_inner_records

    def train(modes, name):
        cmd = [sys.executable, "-m", "ls_fairseq.cli.train", corpus, *SMALL_LS_TRAIN, "--max-tokens", "2048",
               "--max-update", "100", "--seed", "1", "--dropout", "0", "--activation-fn", "gelu",
               "--log-format", "json", "--log-interval", "1", "--num-workers", "1", "--save-dir",
               str(tmp_path / name), "--ls-graph-buckets", "12", *precision, *modes]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
        out = res.stdout + res.stderr
        assert res.returncode == 0, out[-5000:]
        assert re.search(r"CUDA-graph step: [1-9]\d* micro-batches from [1-9]\d* captured buckets", out), out[-3000:]
        return [float(r["loss"]) for _, r in sorted(train_inner_records(out).items())]

    base = train([], "base")
    modes = train(["--ls-invertible-layernorm", "--ls-recompute-activation", "--ls-recompute-logits"], "modes")
    assert len(modes) == len(base) >= 100
    assert modes[-1] < modes[0] - 1.0  # it learns
    for a, b in zip(modes, base):
        assert abs(a - b) <= 0.02 * abs(b), (a, b)
