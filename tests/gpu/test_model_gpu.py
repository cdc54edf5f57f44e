"""ls_transformer with its fused kernels on the GPU against fairseq's native transformer."""

import pytest
import torch

from ls_fairseq import _ext
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_reference
from tests._models import build_model, make_dict, random_batch
from tests.test_model_parity import native_named_grads

pytestmark = pytest.mark.gpu

CFG = dict(dropout=0.0, share_all_embeddings=True, encoder_layers=2, decoder_layers=2, encoder_embed_dim=256,
           decoder_embed_dim=256, encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024,
           encoder_attention_heads=4, decoder_attention_heads=4)


@pytest.fixture(autouse=True)
def _no_tf32():
    if _ext.get() is None:
        pytest.skip(f"extension not built: {_ext.reason()}")
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _pair(**kw):
    d = make_dict(200)
    torch.manual_seed(0)
    native = build_model("transformer_tiny", d, **{**CFG, **kw})
    ls = build_model("ls_transformer_tiny", d, **{**CFG, **kw})
    ls.load_state_dict(native.state_dict())
    return d, native, ls


def _loss(model, d, batch):
    src, lengths, prev, tgt = (t.cuda() for t in batch)
    logits = model(src, lengths, prev)[0]
    return label_smoothed_cross_entropy_reference(logits, tgt, 0.1, d.pad())[0]


def _grads(model, ls):
    if ls:
        return {k: v.double() for k, v in native_named_grads(model).items()}
    return {n: p.grad.double() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pre_ln", [False, True])
def test_fp32_loss_and_grads_match_native(pre_ln):
    kw = dict(encoder_normalize_before=pre_ln, decoder_normalize_before=pre_ln, activation_fn="gelu")
    d, native, ls = _pair(**kw)
    native.cuda(), ls.cuda()
    batch = random_batch(d, B=8, S=33, T=29)
    ln, ll = _loss(native, d, batch), _loss(ls, d, batch)
    assert torch.allclose(ll, ln, rtol=2e-5), (ll.item(), ln.item())
    ln.backward(), ll.backward()
    gn, gl = _grads(native, False), _grads(ls, True)
    total = torch.stack([g.norm() for g in gn.values()]).norm()
    for name, g in gn.items():
        if name.endswith("k_proj.bias"):
            continue  # exactly zero in exact arithmetic
        rel = (gl[name] - g).norm() / torch.maximum(g.norm(), 1e-6 * total)
        assert rel < 1e-4, f"{name}: {rel:.2e}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_error_within_twice_native(dtype):
    d, native, ls = _pair(encoder_normalize_before=True, decoder_normalize_before=True)
    batch = random_batch(d, B=8, S=41, T=37, seed=3)
    gold_model = native.cuda()
    gold = _loss(gold_model, d, batch)
    gold.backward()
    g_gold = _grads(gold_model, False)
    native.zero_grad()
    native_lp = native.to(dtype)
    ln = _loss(native_lp, d, batch)
    ln.backward()
    g_nat = _grads(native_lp, False)
    ls_lp = ls.cuda().to(dtype)
    ll = _loss(ls_lp, d, batch)
    ll.backward()
    g_ls = _grads(ls_lp, True)
    err_ls, err_nat = (ll - gold).abs().item(), (ln - gold).abs().item()
    assert err_ls <= 2 * err_nat + 1e-3 * gold.abs().item(), (err_ls, err_nat)
    for name, g in g_gold.items():
        if name.endswith("k_proj.bias"):
            continue
        e_ls = (g_ls[name] - g).norm().item()
        e_nat = (g_nat[name] - g).norm().item()
        assert e_ls <= 2 * e_nat + 2e-3 * g.norm().item() + 1e-6, f"{name}: ls {e_ls:.3g} native {e_nat:.3g}"


def test_dropout_training_is_reproducible_under_manual_seed():
    d, _, ls = _pair(dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)
    ls = ls.cuda().half().train()
    batch = random_batch(d, B=8, S=20, T=18)

    def loss(seed):
        torch.manual_seed(seed)
        return _loss(ls, d, batch).item()

    assert loss(1) == loss(1)
    assert loss(1) != loss(2)


def test_beam_search_same_translations_as_native_on_gpu():
    from fairseq.sequence_generator import SequenceGenerator

    d, native, ls = _pair()
    native.cuda().eval(), ls.cuda().eval()
    src, lengths, _, _ = random_batch(d, B=6, S=12)
    sample = {"net_input": {"src_tokens": src.cuda(), "src_lengths": lengths.cuda()}}
    hyps = []
    for m in (native, ls):
        gen = SequenceGenerator([m], d, beam_size=4, max_len_b=10)
        hyps.append([[h["tokens"].tolist() for h in sent] for sent in gen.generate([m], sample)])
    assert hyps[0] == hyps[1]


class _CountingLayers:
    """Stands in for the extension in the layer modules' cpp_layers: counts the whole-layer calls."""

    def __init__(self, mod):
        self.mod, self.calls = mod, 0

    def __getattr__(self, name):
        fn = getattr(self.mod, name)
        if name not in ("encoder_layer_fwd", "decoder_layer_fwd"):
            return fn

        def counted(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pre_ln,act", [(False, "relu"), (True, "gelu")], ids=["post_ln_relu", "pre_ln_gelu"])
@pytest.mark.parametrize("shape", ["short", "long", "left_padded_targets"])
def test_cpp_layers_same_bits_as_python_layers(monkeypatch, dtype, pre_ln, act, shape):
    """Each encoder / decoder layer as one C++ call (csrc/torch/layers.cpp) records the same nodes as the
    Python layers: the same loss and the same gradients bit for bit, dropout everywhere included."""
    from ls_fairseq.modules import encoder_layer
    from ls_fairseq.ops import _dispatch

    d, _, ls = _pair(dropout=0.1, attention_dropout=0.1, activation_dropout=0.1, activation_fn=act,
                     encoder_normalize_before=pre_ln, decoder_normalize_before=pre_ln)
    ls = ls.cuda().to(dtype).train()
    S, T = (20, 18) if shape != "long" else (100, 90)  # memory-efficient first (short) or flash first
    src, lengths, prev, tgt = random_batch(d, B=8, S=S, T=T)
    if shape == "left_padded_targets":  # a self-attention padding mask besides the causal one
        prev[2, :3] = d.pad()
    batch = (src, lengths, prev, tgt)
    counter = _CountingLayers(_ext.get())
    real = _dispatch.cpp_layers
    # both layers' choice (the decoder layer inherits it)
    monkeypatch.setattr(encoder_layer, "cpp_layers", lambda x: counter if real(x) is not None else None)

    def run(cpp_layers):
        monkeypatch.setattr(_dispatch, "_CPP_LAYERS", cpp_layers)
        ls.zero_grad(set_to_none=True)
        torch.manual_seed(5)
        loss = _loss(ls, d, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in ls.named_parameters()}

    loss_cpp, grads_cpp = run(True)
    assert counter.calls == 4  # 2 encoder + 2 decoder layers
    loss_py, grads_py = run(False)
    assert counter.calls == 4
    assert torch.isfinite(loss_cpp) and torch.equal(loss_cpp, loss_py)
    assert grads_cpp.keys() == grads_py.keys()
    for n in grads_py:
        assert torch.equal(grads_cpp[n], grads_py[n]), n
    # a different seed gives different dropout: the comparison above is not vacuous
    monkeypatch.setattr(_dispatch, "_CPP_LAYERS", True)
    torch.manual_seed(6)
    assert not torch.equal(_loss(ls, d, batch).detach(), loss_cpp)


def test_cpp_layers_in_eval_and_without_grad(monkeypatch):
    """Validation (eval, no_grad) through the C++ layers gives the Python layers' output bit for bit."""
    from ls_fairseq.ops import _dispatch

    d, _, ls = _pair(dropout=0.1, attention_dropout=0.1, activation_dropout=0.1)
    ls = ls.cuda().half().eval()
    batch = random_batch(d, B=8, S=30, T=25)
    out = {}
    for flag in (True, False):
        monkeypatch.setattr(_dispatch, "_CPP_LAYERS", flag)
        with torch.no_grad():
            out[flag] = _loss(ls, d, batch)
    assert torch.equal(out[True], out[False])
