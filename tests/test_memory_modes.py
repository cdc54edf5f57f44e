"""The memory modes on the CPU (ls_fairseq/fairseq_ext/memory_modes.py): each mode's reference against the
stored path (forward and every gradient), the memory each one actually frees (the bytes autograd keeps for
the backward), zero layer-norm weights, the flags, and whole models with the modes on. The kernels and the
C++ nodes are compared on the GPU in tests/gpu/test_memory_modes_gpu.py."""

import argparse

import pytest
import torch
import torch.nn.functional as F

from _models import build_model, make_dict, random_batch, saved_bytes
from ls_fairseq import ops
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout_reference
from ls_fairseq.ops.bias_act_linear import bias_act_linear_reference
from ls_fairseq.ops.layer_norm import layer_norm_reference


def _grads(out, inputs, gy):
    return torch.autograd.grad((out * gy).sum(), inputs)


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) for t in ts]


# ---------------------------------------------------------------- invertible layer norm
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 1), (2, 13)])
def test_invertible_layer_norm_gradients_equal_the_stored_path(dtype, shape):
    g = torch.Generator().manual_seed(0)
    C = shape[-1]
    x = torch.randn(shape, generator=g, dtype=dtype) * 3 + 1
    w = (1 + 0.3 * torch.randn(C, generator=g)).to(dtype)
    b = (0.2 * torch.randn(C, generator=g)).to(dtype)
    gy = torch.randn(shape, generator=g, dtype=dtype)
    a, r = _leaves(x, w, b), _leaves(x, w, b)
    exact = _leaves(*(t.double() for t in (x, w, b)))
    ya = ops.layer_norm(*a, 1e-5, invertible=True)
    yr = layer_norm_reference(*r, 1e-5)
    torch.testing.assert_close(ya, yr, rtol=0, atol=0)  # the forward is the reference's
    g64 = _grads(layer_norm_reference(*exact, 1e-5), exact, gy.double())
    # the tolerance rule: at most twice the stored path's own error against fp64, plus a small atol
    for i, (ga, gr, ge) in enumerate(zip(_grads(ya, a, gy), _grads(yr, r, gy), g64)):
        err_inv, err_stored = (ga.double() - ge).abs().max(), (gr.double() - ge).abs().max()
        atol = 1e-12 if dtype == torch.float64 else 1e-5 * ge.abs().max().clamp(min=1)
        assert err_inv <= 2 * err_stored + atol, (i, float(err_inv), float(err_stored))


def test_invertible_pre_layer_norm_passes_the_residual_on():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(4, 6, 8, generator=g), 1 + 0.1 * torch.randn(8, generator=g), torch.randn(8, generator=g)
    gy, gr = torch.randn(4, 6, 8, generator=g), torch.randn(4, 6, 8, generator=g)
    res = []
    for inv in (True, False):
        a = _leaves(x, w, b)
        y, xs = ops.pre_layer_norm(*a, 1e-5, invertible=inv)
        res.append(torch.autograd.grad((y * gy).sum() + (xs * gr).sum(), a))
    for ga, gs in zip(*res):
        torch.testing.assert_close(ga, gs, rtol=2e-4, atol=2e-5)


def test_invertible_layer_norm_keeps_its_output_not_its_input():
    """Followed by a linear layer (which keeps the output anyway), the invertible layer norm frees its input."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 32, generator=g, requires_grad=True)
    w, b = torch.ones(32, requires_grad=True), torch.zeros(32, requires_grad=True)
    lin = torch.randn(48, 32, generator=g, requires_grad=True)

    def block(inv):
        return lambda: F.linear(ops.layer_norm(x * 1.0, w, b, 1e-5, invertible=inv), lin)

    _, stored = saved_bytes(block(False), [w, b, lin])
    _, inv = saved_bytes(block(True), [w, b, lin])
    assert stored - inv >= x.numel() * x.element_size()


def test_a_zero_weight_gives_nan_gradients_never_a_finite_wrong_value():
    g = torch.Generator().manual_seed(3)
    x, b = torch.randn(5, 8, generator=g), torch.randn(8, generator=g)
    w = torch.ones(8)
    w[3] = 0.0
    a = _leaves(x, w, b)
    y = ops.layer_norm(*a, 1e-5, invertible=True)
    dx, dw, db = torch.autograd.grad(y.sum() + (y * y).sum(), a)
    assert torch.isnan(dx).all()  # the row's mean terms need the lost column
    assert torch.isnan(dw[3]) and torch.isfinite(dw[torch.arange(8) != 3]).all()
    assert torch.isfinite(db).all()  # dbeta = sum(dy) needs no input


# ---------------------------------------------------------------- recomputed activation
@pytest.mark.parametrize("act", ["gelu", "relu"])
@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("bias", [True, False])
def test_recomputed_activation_equals_the_stored_path_bit_for_bit(act, p, bias):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 9, 24, generator=g)
    bb = torch.randn(24, generator=g) if bias else None
    w = torch.randn(12, 24, generator=g)
    mask = torch.rand(2, 9, 24, generator=g) >= p if p > 0 else None
    gy = torch.randn(2, 9, 12, generator=g)
    ins = [x, w] + ([bb] if bias else [])
    a, r = _leaves(*ins), _leaves(*ins)
    ya = bias_act_linear_reference(a[0], a[2] if bias else None, a[1], act, p, True, mask)
    yr = F.linear(bias_act_dropout_reference(r[0], r[2] if bias else None, act, p, True, mask), r[1])
    assert torch.equal(ya, yr)
    for i, (ga, gr) in enumerate(zip(_grads(ya, a, gy), _grads(yr, r, gy))):
        assert torch.equal(ga, gr), i


def test_recomputed_activation_frees_the_activation_output():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(32, 64, generator=g, requires_grad=True)
    b = torch.randn(64, generator=g, requires_grad=True)
    w = torch.randn(16, 64, generator=g, requires_grad=True)
    _, stored = saved_bytes(lambda: ops.linear(ops.bias_act_dropout(x, b, "gelu", 0.1, True), w), [b, w])
    _, recomputed = saved_bytes(lambda: ops.bias_act_linear(x, b, w, "gelu", 0.1, True), [b, w])
    assert stored - recomputed >= x.numel() * x.element_size()


def test_bias_act_linear_refuses_bad_arguments():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="unsupported activation"):
        ops.bias_act_linear(x, None, w, "tanh")
    with pytest.raises(ValueError, match="probability"):
        ops.bias_act_linear(x, None, w, "gelu", 1.0)
    with pytest.raises(ValueError, match="weight"):
        ops.bias_act_linear(x, None, torch.randn(4, 7), "gelu")


# ---------------------------------------------------------------- whole models and the flags
def _tiny(**kw):
    d = make_dict()
    small = dict(encoder_embed_dim=32, decoder_embed_dim=32, encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64,
                 encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                 dropout=0.0, activation_fn="gelu")
    small.update(kw)
    torch.manual_seed(0)
    return d, build_model("ls_transformer", d, **small)


@pytest.mark.parametrize("pre", [False, True], ids=["post_ln", "pre_ln"])
def test_model_with_all_modes_trains_like_the_stored_model(pre):
    d, stored = _tiny(encoder_normalize_before=pre, decoder_normalize_before=pre)
    _, modes = _tiny(encoder_normalize_before=pre, decoder_normalize_before=pre, ls_invertible_layernorm=True,
                     ls_recompute_activation=True)
    modes.load_state_dict(stored.state_dict())
    stored.double()
    modes.double()
    src, lengths, prev, tgt = random_batch(d)
    rows = torch.nonzero(tgt.reshape(-1).ne(d.pad())).squeeze(1)
    results = []
    for model in (stored, modes):
        model.train()
        logits, _ = model(src, lengths, prev, logit_rows=rows)
        (logits.float().log_softmax(-1).mean()).backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for n, gs in results[0][1].items():
        torch.testing.assert_close(results[1][1][n], gs, rtol=1e-9, atol=1e-11, msg=lambda m: f"{n}: {m}")


def test_flags_reach_every_layer_norm_and_layer():
    from ls_fairseq.modules.encoder_layer import EncoderLayer
    from ls_fairseq.modules.layer_norm import LayerNorm

    _, model = _tiny(ls_invertible_layernorm=True, ls_recompute_activation=True, encoder_normalize_before=True,
                     decoder_normalize_before=True)
    norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
    layers = [m for m in model.modules() if isinstance(m, EncoderLayer)]
    assert len(norms) == 2 * 2 + 3 * 2 + 2 and all(m.invertible for m in norms)  # layers' and the final ones
    assert len(layers) == 4 and all(m.recompute_activation and m.memory_bits() == 3 for m in layers)
    _, relu = _tiny(activation_fn="relu", ls_recompute_activation=True)
    assert all(m.memory_bits() == 0 for m in relu.modules() if isinstance(m, EncoderLayer))  # nothing to drop
    _, plain = _tiny()
    assert not any(m.invertible for m in plain.modules() if isinstance(m, LayerNorm))


def test_memory_flags_in_the_model_parser():
    from fairseq.models import ARCH_MODEL_REGISTRY

    import ls_fairseq.fairseq_ext  # noqa: F401

    parser = argparse.ArgumentParser()
    ARCH_MODEL_REGISTRY["ls_transformer"].add_args(parser)
    args = parser.parse_args([])
    assert args.ls_invertible_layernorm is False and args.ls_recompute_activation is False
    args = parser.parse_args(["--ls-invertible-layernorm", "--ls-recompute-activation"])
    assert args.ls_invertible_layernorm and args.ls_recompute_activation
    text = parser.format_help()
    assert "--ls-invertible-layernorm" in text and "--ls-recompute-activation" in text


def test_a_checkpoint_with_a_zero_layer_norm_weight_is_refused_by_the_invertible_model():
    from ls_fairseq.fairseq_ext.memory_modes import zero_weight_report

    _, plain = _tiny()
    state = plain.state_dict()
    state["encoder.layers.1.final_layer_norm.weight"][5] = 0.0
    _, inv = _tiny(ls_invertible_layernorm=True)
    with pytest.raises(ValueError, match=r"encoder\.layers\.1\.final_layer_norm\.weight \(1 of 32"):
        inv.load_state_dict(state)
    plain.load_state_dict(state)  # without the mode the weight is fine
    assert zero_weight_report(plain) is None
    _, inv2 = _tiny(ls_invertible_layernorm=True)
    assert zero_weight_report(inv2) is None


def test_decoder_selects_the_logit_rows_before_its_final_layer_norm():
    d, model = _tiny(decoder_normalize_before=True, encoder_normalize_before=True)
    model.eval()
    src, lengths, prev, tgt = random_batch(d)
    rows = torch.nonzero(tgt.reshape(-1).ne(d.pad())).squeeze(1)
    with torch.no_grad():
        full, _ = model(src, lengths, prev)
        sel, _ = model(src, lengths, prev, logit_rows=rows)
    torch.testing.assert_close(sel, full.reshape(-1, full.shape[-1])[rows], rtol=0, atol=0)


# ---------------------------------------------------------------- logits recomputed in blocks
@pytest.mark.parametrize("chunk", [1, 3, 4, 10, 64])
def test_linear_cross_entropy_in_blocks_equals_the_stored_path(chunk):
    from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_reference
    from ls_fairseq.ops.linear_cross_entropy import linear_cross_entropy

    g = torch.Generator().manual_seed(6)
    h = torch.randn(10, 16, generator=g, dtype=torch.float64)
    w = torch.randn(37, 16, generator=g, dtype=torch.float64)
    t = torch.randint(0, 37, (10,), generator=g)
    t[[2, 7]] = 1  # ignored rows
    a, r = _leaves(h, w), _leaves(h, w)
    loss, nll, best = linear_cross_entropy(a[0], a[1], t, 0.1, 1, chunk_rows=chunk, argmax=True)
    logits = F.linear(r[0], r[1])
    rl, rn = label_smoothed_cross_entropy_reference(logits, t, 0.1, 1)
    torch.testing.assert_close(loss.double(), rl.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(nll.double(), rn.double(), rtol=1e-6, atol=1e-6)
    assert torch.equal(best, logits.argmax(1))
    ga = torch.autograd.grad(2.0 * loss + 0.5 * nll, a)
    gr = torch.autograd.grad(2.0 * rl + 0.5 * rn, r)
    for x, y in zip(ga, gr):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-9)


def test_linear_cross_entropy_keeps_no_logits():
    from ls_fairseq.ops.linear_cross_entropy import linear_cross_entropy

    g = torch.Generator().manual_seed(7)
    h = torch.randn(256, 32, generator=g, requires_grad=True)
    w = torch.randn(2000, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 2000, (256,), generator=g)
    out, kept = saved_bytes(lambda: linear_cross_entropy(h, w, t, 0.1, chunk_rows=64), [h, w])
    assert out[2] is None  # no argmax unless asked
    assert kept < 256 * 2000 * 4 / 10  # target and logsumexp, not the [256, 2000] logits
    with pytest.raises(ValueError, match="do not match"):
        linear_cross_entropy(h, torch.randn(2000, 31), t)


def test_criterion_with_recomputed_logits_equals_the_stored_criterion():
    from fairseq.tasks.translation import TranslationConfig, TranslationTask  # noqa: F401

    from ls_fairseq.fairseq_ext.criterion import LSLabelSmoothedCrossEntropyCriterion

    d, stored = _tiny()
    _, blocks = _tiny(ls_recompute_logits=True)
    blocks.load_state_dict(stored.state_dict())
    assert blocks.decoder.recompute_logits and not stored.decoder.recompute_logits
    task = type("T", (), {"target_dictionary": d, "source_dictionary": d})()
    crit = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1, report_accuracy=True)
    src, lengths, prev, tgt = random_batch(d)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
              "target": tgt, "ntokens": int(tgt.ne(d.pad()).sum())}
    out = []
    for model in (stored.double(), blocks.double()):
        model.train()
        loss, size, log = crit(model, sample)
        loss.backward()
        out.append((loss.detach(), log, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(out[1][0], out[0][0], rtol=1e-6, atol=1e-6)
    assert out[1][1]["n_correct"] == out[0][1]["n_correct"] and out[1][1]["total"] == out[0][1]["total"]
    for n, gs in out[0][2].items():
        torch.testing.assert_close(out[1][2][n], gs, rtol=1e-6, atol=1e-9, msg=lambda m: f"{n}: {m}")
