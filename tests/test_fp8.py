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


def _state(rows=3, grad_format=fp8.E5M2):
    return fp8.Fp8State(rows // 3, grad_format)


def _fresh(rows=3):
    return torch.zeros(rows, fp8.WIDTH)


@pytest.mark.parametrize("fmt,rel", [(fp8.E4M3, 2.0 ** -4), (fp8.E5M2, 2.0 ** -3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_reference_round_trip(fmt, rel, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 48, generator=g) * 3).to(dtype)
    st = _fresh()
    q, q_t = fp8.fp8_quantize_reference(x, st, 2, fmt, current=True)
    s_inv = st[2, fp8.SCALE_INV]
    assert q.dtype == fp8.FP8_DTYPES[fmt] and q.shape == (37, 48)
    # the transposed codes: the same bytes, tokens padded with zeros to a multiple of 16
    assert q_t.shape == (48, 48) and torch.equal(q_t[:, :37].t().float(), q.float())
    assert torch.all(q_t[:, 37:].float() == 0)
    back = q.float() * s_inv
    xf = x.float()
    assert float(st[2, fp8.AMAX]) == float(xf.abs().max())  # recorded for the next roll
    # the largest element lands in the format's top binade, and nothing exceeds the format's maximum
    assert q.float().abs().max() <= fp8.FP8_MAX[fmt]
    assert q.float().abs().max() > fp8.FP8_MAX[fmt] / 2
    # round to nearest: relative error at most half an ulp of the format for values in its normal range
    normal = xf.abs() / s_inv > (2.0 ** -6 if fmt == fp8.E4M3 else 2.0 ** -14)
    err = (back - xf).abs()
    assert torch.all(err[normal] <= rel * xf.abs()[normal] + 1e-12)


def test_quantize_reference_propagates_inf_and_nan():
    x = torch.tensor([[1.0, float("inf"), 2.0] + [0.0] * 13])
    st = _fresh()
    q, _ = fp8.fp8_quantize_reference(x, st, 2, fp8.E5M2, current=True)
    assert math.isnan(float(st[2, fp8.SCALE_INV])) and torch.isnan(q.float()).all()
    # delayed: the codes saturate, but 1/s becomes NaN, so the GEMM's product is NaN
    st = _fresh()
    st[2, fp8.SCALE], st[2, fp8.SCALE_INV] = 1.0, 1.0
    q, _ = fp8.fp8_quantize_reference(x, st, 2, fp8.E5M2, current=False)
    assert float(q.float()[0, 1]) == fp8.FP8_MAX[fp8.E5M2] and math.isnan(float(st[2, fp8.SCALE_INV]))


def test_delayed_scaling_history_and_roll():
    st = _fresh(6)
    fmt_of = [fp8.E4M3, fp8.E4M3, fp8.E5M2] * 2
    for r, amax in enumerate([1.0, 3.0, 0.001, 448.0, 0.0, 2.0 ** -20]):
        st[r, fp8.AMAX] = amax
    fp8.fp8_roll_reference(st, fp8.E5M2)
    for r in range(6):
        m = float(st[r, fp8.HIST])
        assert float(st[r, fp8.AMAX]) == 0.0
        assert float(st[r, fp8.SCALE]) == float(fp8.fp8_scale_reference(torch.tensor(m), fmt_of[r]))
        assert float(st[r, fp8.SCALE_INV]) * float(st[r, fp8.SCALE]) == 1.0
    # the scale follows the largest of the last HISTORY maxima: a spike keeps it low until it leaves the window
    st = _fresh()
    seen = [5.0] + [0.5] * (fp8.HISTORY + 2)
    scales = []
    for a in seen:
        st[0, fp8.AMAX] = a
        fp8.fp8_roll_reference(st, fp8.E4M3)
        scales.append(float(st[0, fp8.SCALE]))
    big, small = (float(fp8.fp8_scale_reference(torch.tensor(v), fp8.E4M3)) for v in (5.0, 0.5))
    assert scales[:fp8.HISTORY] == [big] * fp8.HISTORY and scales[fp8.HISTORY:] == [small] * 3
    # a non-finite maximum (an fp16 overflow) stays out of the history
    st[0, fp8.AMAX] = float("inf")
    fp8.fp8_roll_reference(st, fp8.E4M3)
    assert float(st[0, fp8.SCALE]) == small and float(st[0, fp8.HIST]) == 0.5


def test_delayed_quantize_uses_the_rolled_scale_and_records_amax():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, 32, generator=g)
    st = _fresh()
    fp8.fp8_quantize_reference(x, st, 0, fp8.E4M3, current=True)
    fp8.fp8_roll_reference(st, fp8.E5M2)
    s = float(st[0, fp8.SCALE])
    y = x * 4  # grew: the delayed scale saturates what no longer fits
    q, _ = fp8.fp8_quantize_reference(y, st, 0, fp8.E4M3, current=False)
    assert float(st[0, fp8.SCALE]) == s and float(st[0, fp8.AMAX]) == float(y.abs().max())
    expect = (y * s).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), expect.view(torch.uint8))
    fp8.fp8_roll_reference(st, fp8.E5M2)  # and the next scale makes room
    assert float(st[0, fp8.SCALE]) == s / 4


def _use(grad_format, slots=1, current=True):
    st = fp8.Fp8State(slots, grad_format)
    st.begin_forward(torch.device("cpu"))
    if not current:
        st.begin_forward(torch.device("cpu"))
    return st, st.use(0)


@pytest.mark.parametrize("grad_format", [fp8.E4M3, fp8.E5M2])
def test_reference_linear_forward_and_gradients(grad_format):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 32, generator=g, requires_grad=True)
    w = (torch.randn(48, 32, generator=g) * 0.1).requires_grad_()
    b = torch.randn(48, generator=g).requires_grad_()
    st, use = _use(grad_format)
    assert use.current and use.mode == 3 + grad_format
    y = fp8.fp8_linear_reference(x, w, b, use)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    # the reference computes exactly from the same FP8 codes
    ref = _fresh()
    xq, _ = fp8.fp8_quantize_reference(x.detach().reshape(-1, 32), ref, 0, fp8.E4M3, True)
    wq, _ = fp8.fp8_quantize_reference(w.detach(), ref, 1, fp8.E4M3, True)
    gq, _ = fp8.fp8_quantize_reference(dy.reshape(-1, 48), ref, 2, grad_format, True)
    assert torch.equal(st.tensor, ref)  # the same maxima recorded, the same scales
    xd, wd, gd = (q.float() * ref[r, fp8.SCALE_INV] for q, r in ((xq, 0), (wq, 1), (gq, 2)))
    torch.testing.assert_close(y.detach(), (xd @ wd.t() + b.detach()).reshape(3, 7, 48), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, (gd @ wd).reshape(3, 7, 32), rtol=0, atol=0)
    # the weight gradient from the same codes of dY and x
    torch.testing.assert_close(w.grad, gd.t() @ xd, rtol=0, atol=0)
    torch.testing.assert_close(b.grad, dy.reshape(-1, 48).sum(0))
    # and the FP8 result is close to the exact linear layer (a few e4m3 ulps)
    exact = F.linear(x.detach(), w.detach(), b.detach())
    assert (y.detach() - exact).abs().max() < 0.1 * exact.abs().max()
    exact_dw = dy.reshape(-1, 48).t() @ x.detach().reshape(-1, 32)
    assert (w.grad - exact_dw).norm() < 0.1 * exact_dw.norm()


def test_reference_linear_delayed_scales_from_the_history():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32, generator=g)
    w = (torch.randn(16, 32, generator=g) * 0.1).requires_grad_()
    st, use = _use(fp8.E5M2)
    fp8.fp8_linear_reference(x, w, None, use).sum().backward()
    st.begin_forward(torch.device("cpu"))  # the roll: history from the first (current) pass
    assert not st.current
    use = st.use(0)
    before = st.tensor.clone()
    y = fp8.fp8_linear_reference(x * 2, w, None, use).detach()
    w = w.detach()
    sx, sw = before[0, fp8.SCALE_INV], before[1, fp8.SCALE_INV]
    xq = (x * 2 * before[0, fp8.SCALE]).clamp(-448, 448).to(torch.float8_e4m3fn)
    wq = (w * before[1, fp8.SCALE]).to(torch.float8_e4m3fn)
    torch.testing.assert_close(y, (xq.float() * sx) @ (wq.float() * sw).t(), rtol=0, atol=0)
    assert float(st.tensor[0, fp8.AMAX]) == float((x * 2).abs().max())


def test_linear_takes_fp8_only_where_sizes_allow():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 24, generator=g)
    w_odd = torch.randn(20, 24, generator=g)  # 20 is not a multiple of 16: plain linear, exactly
    _, use = _use(fp8.E4M3)
    torch.testing.assert_close(ops.linear(x, w_odd, fp8=use), F.linear(x, w_odd), rtol=0, atol=0)
    x = torch.randn(5, 32, generator=g)
    w = torch.randn(16, 32, generator=g)
    _, use = _use(fp8.E5M2)
    _, use2 = _use(fp8.E5M2)
    torch.testing.assert_close(ops.linear(x, w, fp8=use), fp8.fp8_linear_reference(x, w, None, use2),
                               rtol=0, atol=0)
    assert not torch.equal(ops.linear(x, w, fp8=use), F.linear(x, w))
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8.fp8_linear(x, w_odd, None, use)


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
    d, model = _tiny(fp8=True, fp8_grad_format="e4m3", fp8_projections="all")
    refs = {m: m.fp8 for m in model.modules() if hasattr(m, "fp8")}
    assert all(isinstance(r, fp8.Fp8Ref) for r in refs.values())
    assert {"EncoderLayer", "DecoderLayer", "SelfAttention", "CrossAttention", "BatchedCrossKV"} <= {
        type(m).__name__ for m in refs}
    state = model.encoder.fp8_state
    assert all(r.state is state for r in refs.values()) and state.grad_format == fp8.E4M3
    # one encoder layer, one decoder layer, the batched cross K/V, the vocabulary projection
    assert state.linears == 4 + 6 + 1 + 1
    # the vocabulary (54 words) is not a multiple of 16: its projection keeps its slot but stays in bf16/fp16
    head = model.decoder.output_projection
    assert head.fp8 == fp8.Fp8Ref(state, 11, 1) and state.in_fp8 == 11
    # every linear has its own slot: the layers' slots (csrc/torch/layers.cpp order) never overlap
    dec = model.decoder.layers[0]
    slots = [model.encoder.layers[0].fp8.slot + k for k in range(4)] + [dec.fp8.slot + k for k in range(6)]
    slots.append(model.decoder.cross_kv.fp8.slot if hasattr(model.decoder, "cross_kv") else
                 next(m.fp8.slot for m in model.modules() if type(m).__name__ == "BatchedCrossKV"))
    slots.append(head.fp8.slot)
    assert sorted(slots) == list(range(12))
    assert dec.self_attn.fp8.slot == dec.fp8.slot and dec.encoder_attn.fp8.slot == dec.fp8.slot + 4
    _, plain = _tiny()
    assert all(m.fp8 is None for m in plain.modules() if hasattr(m, "fp8"))
    assert plain.encoder.fp8_state is None
    plain.load_state_dict(model.state_dict())
    src, lengths, prev, _ = random_batch(d)
    model.eval()
    plain.eval()
    with torch.no_grad():  # evaluation runs the model's own precision: identical outputs
        torch.testing.assert_close(model(src, lengths, prev)[0], plain(src, lengths, prev)[0], rtol=0, atol=0)
    assert state.tensor is None  # no training forward yet: no state made
    model.train()
    with pytest.raises(RuntimeError, match="--fp8 needs an NVIDIA GPU with FP8 tensor cores"):
        model(src, lengths, prev)


def test_fp8_state_first_forward_is_current_then_delayed():
    st = fp8.Fp8State(2, fp8.E5M2)
    with pytest.raises(RuntimeError, match="before its first training forward"):
        st.use(0)
    st.begin_forward(torch.device("cpu"))
    assert st.current and st.tensor.shape == (6, fp8.WIDTH) and st.use(1) == (4, st.tensor, 1)
    st.tensor[5, fp8.AMAX] = 3.0
    st.begin_forward(torch.device("cpu"))  # rolls
    assert not st.current and st.use(1).mode == 2
    assert float(st.tensor[5, fp8.HIST]) == 3.0 and float(st.tensor[5, fp8.AMAX]) == 0.0
    assert float(st.tensor[5, fp8.SCALE]) == float(fp8.fp8_scale_reference(torch.tensor(3.0), fp8.E5M2))


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
    from omegaconf import OmegaConf

    from ls_fairseq.fairseq_ext.step.run_checks import check_device
    from ls_fairseq.fairseq_ext.step.takeover import FlatConfig

    args = argparse.Namespace(fp8=True, cpu=True, bf16=True, fp16=False)
    with pytest.raises(SystemExit, match="lightseq-train: --fp8 needs an NVIDIA GPU"):
        check_device(args)
    check_device(argparse.Namespace(fp8=False, cpu=True))  # no --fp8: nothing to refuse
    cfg = OmegaConf.create({"common": {"cpu": True, "bf16": True, "fp16": False}, "optimizer": None,
                            "model": {"fp8": True}})  # fairseq-train's config, as the trainer choice reads it
    with pytest.raises(SystemExit, match="fairseq-train: --fp8 needs an NVIDIA GPU"):
        check_device(FlatConfig(cfg), prog="fairseq-train")


def test_unavailable_reasons():
    assert "on cpu" in fp8.fp8_unavailable_reason(torch.device("cpu"), torch.bfloat16)


def test_auto_projections_take_fp8_where_it_pays():
    from ls_fairseq.fairseq_ext.fp8_mode import attach_fp8, fp8_pays
    from ls_fairseq.modules.decoder_layer import BatchedCrossKV, DecoderLayer
    from ls_fairseq.modules.encoder_layer import EncoderLayer

    # transformer-big's shapes: QKV, FFN and the batched K/V pay, the square 1024 -> 1024 projections do not
    assert fp8_pays(torch.empty(3072, 1024)) and fp8_pays(torch.empty(4096, 1024))
    assert fp8_pays(torch.empty(1024, 4096)) and fp8_pays(torch.empty(12288, 1024))
    assert not fp8_pays(torch.empty(1024, 1024)) and not fp8_pays(torch.empty(2048, 512))
    enc, dec, kv = EncoderLayer(1024, 4096, 16), DecoderLayer(1024, 4096, 16), BatchedCrossKV(1024, 16, 1)
    state = attach_fp8([enc, kv, dec], fp8.E5M2)
    assert state.linears == 4 + 1 + 6 and state.in_fp8 == 3 + 1 + 3
    assert enc.fp8.skip == 0b10 and enc.self_attn.fp8.skip == 0b10
    assert dec.fp8.skip == 0b110010 and dec.encoder_attn.fp8 == fp8.Fp8Ref(state, dec.fp8.slot + 4, 0b11)
    assert kv.fp8.skip == 0
    # the weights a training forward casts ahead in one launch: the FP8 projections of the body, with their slots
    want = [(enc.self_attn.in_proj_weight, 0), (enc.fc1.weight, 2), (enc.fc2.weight, 3), (kv.weight, 4),
            (dec.self_attn.in_proj_weight, 5), (dec.fc1.weight, 7), (dec.fc2.weight, 8)]
    assert len(state.ahead) == len(want)
    assert all(w is v and slot == s for (w, slot), (v, s) in zip(state.ahead, want))
    # the vocabulary projection (last slot) pays at 32000 x 1024; not below the rule, nor off the 16-grid
    heads = [torch.nn.Linear(1024, v, bias=False) for v in (32000, 32008)] + [torch.nn.Linear(512, 32000)]
    for h, skip in zip(heads, (0, 1, 1)):
        st = attach_fp8([EncoderLayer(1024, 4096, 16)], fp8.E5M2, head=h)
        assert st.linears == 5 and st.in_fp8 == 3 + (1 - skip) and h.fp8 == fp8.Fp8Ref(st, 4, skip)
    state.begin_forward(torch.device("cpu"))
    for m in (enc, dec, kv):
        m.train()
    assert fp8.fp8_now(enc.self_attn, 0).slot == enc.fp8.slot and fp8.fp8_now(enc.self_attn, 1) is None
    assert fp8.fp8_now(dec, 2).slot == dec.fp8.slot + 2 and fp8.fp8_now(dec.encoder_attn, 0) is None
    # the C++ layer call gets the skip bits above the mode (csrc/torch/ops.h Fp8Args)
    mode, st, slot = fp8.layer_fp8_args(dec)
    assert mode == 3 + fp8.E5M2 + (0b110010 << fp8.SKIP_SHIFT) and st is state.tensor and slot == dec.fp8.slot
    dec.eval()
    assert fp8.layer_fp8_args(dec) == (0, None, 0)
    # a model too small to gain: no state at all, and the user is told
    assert attach_fp8([EncoderLayer(256, 1024, 4)], fp8.E5M2) is None


def test_small_model_with_fp8_warns_and_trains_in_its_own_precision(caplog):
    with caplog.at_level("WARNING"):
        _, model = _tiny(fp8=True)
    assert model.encoder.fp8_state is None and all(m.fp8 is None for m in model.modules() if hasattr(m, "fp8"))
    assert "no projection of this model is large enough" in caplog.text and "--fp8-projections all" in caplog.text


@pytest.mark.parametrize("grad_format", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("current", [True, False])
def test_head_forward_and_backward_equal_the_linear_reference(grad_format, current):
    """The vocabulary projection outside autograd (the CUDA-graph step's head) computes what the FP8 linear
    computes: the same logits, input and weight gradients and the same recorded maxima, from the same codes."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(37, 32, generator=g)
    w = torch.randn(64, 32, generator=g) * 0.2
    dy = torch.randn(37, 64, generator=g)
    st_a, use_a = _use(grad_format, current=current)
    st_b, use_b = _use(grad_format, current=current)
    if not current:  # a history to scale from, the same in both
        for st in (st_a, st_b):
            st.tensor[:, fp8.HIST] = torch.tensor([3.0, 1.5, 4.0])
            fp8.fp8_roll_reference(st.tensor, grad_format)
    logits, saved = fp8.fp8_head_forward(x, w, use_a)
    dx, dw = fp8.fp8_head_backward(dy, saved, use_a)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.fp8_linear_reference(xl, wl, None, use_b)
    y.backward(dy)
    assert torch.equal(logits, y.detach()) and torch.equal(dx, xl.grad) and torch.equal(dw, wl.grad)
    assert torch.equal(st_a.tensor, st_b.tensor)
    assert not torch.equal(logits, x @ w.t())  # it did quantise
    _, no_dw = fp8.fp8_head_backward(dy, fp8.fp8_head_forward(x, w, use_a, keep_x=False)[1], use_a)
    assert no_dw is None


@pytest.mark.parametrize("own_backward,first_writer", [(False, False), (True, False), (True, True)])
def test_graph_steps_head_takes_fp8_for_the_vocabulary(own_backward, first_writer):
    """The CUDA-graph step's head under --fp8: the head's own backward (one cross-entropy pass, then FP8 GEMMs;
    first_writer: the weight gradient written into the zeroed .grad instead of added to it) and autograd through
    the decoder's output layer give the same loss and gradients; both differ from the head in the model's
    precision; evaluation mode leaves FP8 out."""
    import types

    from ls_fairseq.fairseq_ext.graph.split_step import head_step
    from tests.test_graph_step import _ScaledBackward, _model_and_criterion

    d = make_dict(60)  # 64 symbols: a multiple of 16
    m, crit = _model_and_criterion(d)
    proj = m.decoder.output_projection
    gen = torch.Generator().manual_seed(6)
    feats = torch.randn(1, 12, proj.weight.shape[1], generator=gen, dtype=torch.float64)
    rows = torch.tensor([0, 1, 2, 5, 6, 7, 9, 0])
    target_rows = torch.randint(4, len(d), (8,), generator=gen)
    target_rows[-1] = d.pad()

    def run(fp8_on, own):
        if fp8_on:
            st = fp8.Fp8State(1, fp8.E5M2)
            st.begin_forward(torch.device("cpu"))
            proj.fp8 = fp8.Fp8Ref(st, 0, 0)
        else:
            proj.fp8 = None
        proj.weight.grad = torch.zeros_like(proj.weight) if own else None
        opt = _ScaledBackward(torch.tensor(2.0, dtype=torch.float64)) if own else \
            types.SimpleNamespace(backward=lambda loss: (2.0 * loss).backward())
        leaf = feats.clone().requires_grad_(True)
        loss, nll, grad = head_step(m, crit, leaf, rows, target_rows, opt, first_writer=own and first_writer)
        return loss.detach(), nll.detach(), grad.clone(), proj.weight.grad.clone()

    got, other, plain = run(True, own_backward), run(True, not own_backward), run(False, own_backward)
    for a, b in zip(got, other):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, plain):
        assert not torch.equal(a, b)
        torch.testing.assert_close(a, b, rtol=0.1, atol=0.05 * float(b.abs().max()))
    m.eval()
    proj.fp8 = fp8.Fp8Ref(fp8.Fp8State(1, fp8.E5M2), 0, 0)
    assert fp8.fp8_now(proj) is None  # evaluation: the model's own precision


def test_recompute_logits_keeps_the_vocabulary_projection_out_of_fp8(caplog):
    """--ls-recompute-logits projects in blocks inside its own function: --fp8 gives the vocabulary projection no
    slot there, and says so; without it a vocabulary of a multiple of 16 takes its slot under --fp8-projections all."""
    d = make_dict(60)  # 64 symbols
    with caplog.at_level("INFO"):
        blocks = build_model("ls_transformer", d, encoder_embed_dim=32, decoder_embed_dim=32, encoder_ffn_embed_dim=64,
                             decoder_ffn_embed_dim=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                             decoder_attention_heads=2, fp8=True, fp8_projections="all", ls_recompute_logits=True)
    assert blocks.encoder.fp8_state.linears == 11 and getattr(blocks.decoder.output_projection, "fp8", None) is None
    assert "--ls-recompute-logits the vocabulary projection stays" in caplog.text
    whole = build_model("ls_transformer", d, encoder_embed_dim=32, decoder_embed_dim=32, encoder_ffn_embed_dim=64,
                        decoder_ffn_embed_dim=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                        decoder_attention_heads=2, fp8=True, fp8_projections="all")
    st = whole.encoder.fp8_state
    assert st.linears == 12 and st.in_fp8 == 12 and whole.decoder.output_projection.fp8 == fp8.Fp8Ref(st, 11, 0)


def test_linear_split_takes_the_fp8_node_where_it_applies(monkeypatch):
    """ops.linear_split (the attentions' input projections): the FP8 projection + head split node with the layer's
    slot where fp8_split_node offers it, else the projection, then the split with the bias."""
    import sys

    linear_mod = sys.modules["ls_fairseq.ops.linear"]  # (the package's name `linear` is the function)
    g = torch.Generator().manual_seed(8)
    x, w, b = torch.randn(2, 5, 32, generator=g), torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    plain = ops.linear_split(x, w, b, 2, 4)
    want = ops.split_heads(F.linear(x, w), b, 2, 4)
    assert len(plain) == 2 and all(torch.equal(p, q) for p, q in zip(plain, want))
    calls = []

    class Node:
        @staticmethod
        def ag_fp8_linear_split(*args):
            calls.append(args)
            return (torch.zeros(1), torch.ones(1))

    _, use = _use(fp8.E5M2, slots=3)
    use = use.at(2)
    monkeypatch.setattr(linear_mod, "fp8_split_node", lambda xx, ww, u: Node if u is use else None)
    got = ops.linear_split(x, w, b, 2, 4, use)
    assert isinstance(got, list) and torch.equal(got[1], torch.ones(1))
    assert calls == [(x, w, b, 2, 4, use.mode, use.state, 2)]
