"""CPU tests of the FP8 scaling rule, the reference FP8 linear, the --fp8 flags and their errors."""

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from ls_fairseq import ops
from ls_fairseq.ops import fp8
from tests._models import build_model, make_dict, random_batch


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("amax", [1.0, 448.0, 449.0, 0.3, 1e-20, 3.5e4, 57344.0, 1e30, 2.0 ** -140])
def test_scale_is_the_largest_power_of_two_that_fits(fmt, amax):
    top = fp8.FP8_MAX[fmt]
    s = float(fp8.fp8_scale_reference(torch.tensor(amax), fmt))
    m, e = math.frexp(s)
    assert m == 0.5  # a power of two
    k = e - 1
    if -126 < k < 126:  # inside the clamp: the largest power of two with amax * s <= max
        assert amax * s <= top < amax * s * 2
    assert 2.0 ** -126 <= s <= 2.0 ** 126


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_scale_special_values(fmt):
    sc = fp8.fp8_scale_reference
    assert float(sc(torch.tensor(0.0), fmt)) == 1.0
    assert math.isnan(float(sc(torch.tensor(float("inf")), fmt)))
    assert math.isnan(float(sc(torch.tensor(float("nan")), fmt)))
    assert float(sc(torch.tensor(1.0), fp8.E4M3)) == 256.0  # 1 * 256 <= 448 < 512
    assert float(sc(torch.tensor(448.0), fp8.E4M3)) == 1.0
    assert float(sc(torch.tensor(449.0), fp8.E4M3)) == 0.5


@pytest.mark.parametrize("fmt,rel", [(fp8.E4M3, 2.0 ** -4), (fp8.E5M2, 2.0 ** -3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_reference_round_trip(fmt, rel, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 53, generator=g) * 3).to(dtype)
    q, s_inv = fp8.fp8_quantize_reference(x, fmt)
    assert q.dtype == fp8.FP8_DTYPES[fmt] and s_inv.dtype == torch.float32
    back = q.float() * s_inv
    xf = x.float()
    # the largest element lands in the format's top binade, and nothing exceeds the format's maximum
    assert q.float().abs().max() <= fp8.FP8_MAX[fmt]
    assert q.float().abs().max() > fp8.FP8_MAX[fmt] / 2
    # round to nearest: relative error at most half an ulp of the format for values in its normal range
    normal = xf.abs() / s_inv > (2.0 ** -6 if fmt == fp8.E4M3 else 2.0 ** -14)
    err = (back - xf).abs()
    assert torch.all(err[normal] <= rel * xf.abs()[normal] + 1e-12)


def test_quantize_reference_propagates_inf_and_nan():
    x = torch.tensor([1.0, float("inf"), 2.0])
    q, s_inv = fp8.fp8_quantize_reference(x, fp8.E5M2)
    assert math.isnan(float(s_inv)) and torch.isnan(q.float()).all()


@pytest.mark.parametrize("grad_format", [fp8.E4M3, fp8.E5M2])
def test_reference_linear_forward_and_gradients(grad_format):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 32, generator=g, requires_grad=True)
    w = (torch.randn(48, 32, generator=g) * 0.1).requires_grad_()
    b = torch.randn(48, generator=g).requires_grad_()
    y = fp8.fp8_linear_reference(x, w, b, grad_format)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    # the reference computes exactly from the same FP8 codes
    xq, sx = fp8.fp8_quantize_reference(x.detach().reshape(-1, 32), fp8.E4M3)
    wq, sw = fp8.fp8_quantize_reference(w.detach(), fp8.E4M3)
    expect = ((xq.float() * sx) @ (wq.float() * sw).t() + b.detach()).reshape(3, 7, 48)
    torch.testing.assert_close(y.detach(), expect, rtol=0, atol=0)
    gq, sg = fp8.fp8_quantize_reference(dy.reshape(-1, 48), grad_format)
    torch.testing.assert_close(x.grad, ((gq.float() * sg) @ (wq.float() * sw)).reshape(3, 7, 32), rtol=0, atol=0)
    # weight and bias gradients are the exact products of the high-precision tensors
    torch.testing.assert_close(w.grad, dy.reshape(-1, 48).t() @ x.detach().reshape(-1, 32), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(b.grad, dy.reshape(-1, 48).sum(0))
    # and the FP8 result is close to the exact linear layer (a few e4m3 ulps)
    exact = F.linear(x.detach(), w.detach(), b.detach())
    assert (y.detach() - exact).abs().max() < 0.1 * exact.abs().max()


def test_linear_takes_fp8_only_where_sizes_allow():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 24, generator=g)
    w_odd = torch.randn(20, 24, generator=g)  # 20 is not a multiple of 16: plain linear, exactly
    torch.testing.assert_close(ops.linear(x, w_odd, fp8=1), F.linear(x, w_odd), rtol=0, atol=0)
    x = torch.randn(5, 32, generator=g)
    w = torch.randn(16, 32, generator=g)
    torch.testing.assert_close(ops.linear(x, w, fp8=2), fp8.fp8_linear_reference(x, w, None, fp8.E5M2),
                               rtol=0, atol=0)
    assert not torch.equal(ops.linear(x, w, fp8=1), F.linear(x, w))
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8.fp8_linear(x, w_odd)


def test_mode_of():
    assert fp8.mode_of(False, "e4m3") == 0
    assert fp8.mode_of(True, "e4m3") == 1
    assert fp8.mode_of(True, "e5m2") == 2
    with pytest.raises(ValueError, match="--fp8-grad-format"):
        fp8.mode_of(True, "e3m4")


def _tiny(**kw):
    d = make_dict()
    small = dict(encoder_embed_dim=32, decoder_embed_dim=32, encoder_ffn_embed_dim=64, decoder_ffn_embed_dim=64,
                 encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                 dropout=0.0)
    small.update(kw)
    return d, build_model("ls_transformer", d, **small)


def test_model_flags_set_every_projection_and_only_train_uses_fp8():
    d, model = _tiny(fp8=True, fp8_grad_format="e4m3")
    modes = {type(m).__name__: m.fp8 for m in model.modules() if hasattr(m, "fp8") and isinstance(m.fp8, int)}
    assert set(modes.values()) == {1}
    assert {"EncoderLayer", "DecoderLayer", "SelfAttention", "CrossAttention", "BatchedCrossKV"} <= set(modes)
    _, plain = _tiny()
    assert all(m.fp8 == 0 for m in plain.modules() if hasattr(m, "fp8") and isinstance(m.fp8, int))
    plain.load_state_dict(model.state_dict())
    src, lengths, prev, _ = random_batch(d)
    model.eval()
    plain.eval()
    with torch.no_grad():  # evaluation runs the model's own precision: identical outputs
        torch.testing.assert_close(model(src, lengths, prev)[0], plain(src, lengths, prev)[0], rtol=0, atol=0)
    model.train()
    with pytest.raises(RuntimeError, match="--fp8 needs an NVIDIA GPU with FP8 tensor cores"):
        model(src, lengths, prev)


def test_fp8_flag_in_the_model_parser_defaults():
    from fairseq.models import ARCH_MODEL_REGISTRY

    import ls_fairseq.fairseq_ext  # noqa: F401
    from ls_fairseq.fairseq_ext.fp8_mode import DEFAULT_GRAD_FORMAT

    parser = argparse.ArgumentParser()
    ARCH_MODEL_REGISTRY["ls_transformer"].add_args(parser)
    args = parser.parse_args([])
    assert args.fp8 is False and args.fp8_grad_format == DEFAULT_GRAD_FORMAT
    args = parser.parse_args(["--fp8", "--fp8-grad-format", "e4m3"])
    assert args.fp8 is True and args.fp8_grad_format == "e4m3"
    with pytest.raises(SystemExit):
        parser.parse_args(["--fp8-grad-format", "e3m4"])


def test_lightseq_train_refuses_fp8_on_cpu_before_training():
    from ls_fairseq.cli.train import check_device_args

    args = argparse.Namespace(fp8=True, cpu=True, bf16=True, fp16=False)
    with pytest.raises(SystemExit, match="--fp8 needs an NVIDIA GPU"):
        check_device_args(args)
    check_device_args(argparse.Namespace(fp8=False, cpu=True))  # no --fp8: nothing to refuse


def test_unavailable_reasons():
    assert "on cpu" in fp8.fp8_unavailable_reason(torch.device("cpu"), torch.bfloat16)
