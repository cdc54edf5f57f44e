"""The PyTorch reference path of every public op (what runs on CPU), checked against
independent formulations: hand-written math, torch built-ins used differently, and
fairseq's own modules. Forward values, gradients (gradcheck in fp64), dropout masks,
and the errors on bad input.
"""

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from fairseq import utils as fairseq_utils
from fairseq.criterions.label_smoothed_cross_entropy import label_smoothed_nll_loss
from fairseq.modules import MultiheadAttention, SinusoidalPositionalEmbedding
from fairseq.optim.adam import Adam as FairseqAdam

from ls_fairseq import ops
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout_reference
from ls_fairseq.ops.bias_dropout_residual import bias_dropout_residual_reference
from ls_fairseq.ops.embedding import embedding_reference

D64 = dict(dtype=torch.float64)


def rnd(*shape, seed=0, dtype=torch.float64, requires_grad=False, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


# ------------------------------------------------------------------------- layer norm
def manual_layer_norm(x, w, b, eps):
    mu = x.sum(-1, keepdim=True) / x.shape[-1]
    var = ((x - mu) ** 2).sum(-1, keepdim=True) / x.shape[-1]
    return (x - mu) / torch.sqrt(var + eps) * w + b


@pytest.mark.parametrize("C", [1, 7, 31])
def test_layer_norm_forward_and_grad(C):
    x, r = rnd(3, 5, C, seed=1, requires_grad=True), rnd(3, 5, C, seed=2, requires_grad=True)
    w, b = rnd(C, seed=3, requires_grad=True), rnd(C, seed=4, requires_grad=True)
    torch.testing.assert_close(ops.layer_norm(x, w, b, 1e-5), manual_layer_norm(x, w, b, 1e-5))
    y, s = ops.add_layer_norm(x, r, w, b, 1e-6)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, manual_layer_norm(x + r, w, b, 1e-6))
    if C > 1:
        xs, rs = x[:2, :3].detach().requires_grad_(), r[:2, :3].detach().requires_grad_()
        assert torch.autograd.gradcheck(lambda *a: ops.layer_norm(*a, 1e-5), (xs, w, b))
        assert torch.autograd.gradcheck(lambda *a: ops.add_layer_norm(*a, 1e-5), (xs, rs, w, b), fast_mode=True)


def test_pre_layer_norm_returns_its_input():
    x = rnd(2, 3, 8, seed=3, requires_grad=True)
    w, b = rnd(8, seed=4, requires_grad=True), rnd(8, seed=5, requires_grad=True)
    y, r = ops.pre_layer_norm(x, w, b)
    torch.testing.assert_close(y, F.layer_norm(x, (8,), w, b, 1e-5))
    assert r is x


def test_layer_norm_low_precision_upcasts():
    x = rnd(4, 33, seed=5, dtype=torch.float16, scale=30)
    w, b = rnd(33, seed=6, dtype=torch.float16), rnd(33, seed=7, dtype=torch.float16)
    y = ops.layer_norm(x, w, b)
    assert y.dtype == torch.float16
    exact = manual_layer_norm(x.double(), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(y.double(), exact, rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------ dropout families
def test_bias_dropout_residual_forward_and_grad():
    x, r = rnd(2, 3, 11, seed=1, requires_grad=True), rnd(2, 3, 11, seed=2, requires_grad=True)
    b = rnd(11, seed=3, requires_grad=True)
    mask = rnd(2, 3, 11, seed=9) > 0
    p = 0.3
    out = bias_dropout_residual_reference(x, b, r, p, True, mask)
    torch.testing.assert_close(out, r + torch.where(mask, (x + b) / (1 - p), torch.zeros_like(x)))
    assert torch.autograd.gradcheck(lambda x, b, r: bias_dropout_residual_reference(x, b, r, p, True, mask), (x, b, r))
    # eval mode and p = 0: a plain residual add, no bias optional
    torch.testing.assert_close(ops.bias_dropout_residual(x, b, r, p, training=False), x + b + r)
    torch.testing.assert_close(ops.bias_dropout_residual(x, None, r, 0.0), x + r)


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_bias_act_dropout_forward_and_grad(act):
    x, b = rnd(2, 5, 13, seed=1, requires_grad=True), rnd(13, seed=2, requires_grad=True)
    mask = rnd(2, 5, 13, seed=3) > -0.5
    p = 0.2
    fairseq_act = fairseq_utils.get_activation_fn(act)
    expect = torch.where(mask, fairseq_act(x + b) / (1 - p), torch.zeros_like(x))
    # fairseq's gelu computes in fp32 even for fp64 input: compare at fp32 accuracy
    torch.testing.assert_close(bias_act_dropout_reference(x, b, act, p, True, mask), expect, rtol=1e-5, atol=1e-6)
    if act == "gelu":
        erf_gelu = 0.5 * (x + b) * (1 + torch.erf((x + b) / math.sqrt(2)))
        torch.testing.assert_close(ops.bias_act_dropout(x, b, act, 0.0), erf_gelu)
        assert torch.autograd.gradcheck(lambda x, b: bias_act_dropout_reference(x, b, act, p, True, mask), (x, b))
    else:
        torch.testing.assert_close(ops.bias_act_dropout(x, b, act, p, training=False), (x + b).clamp_min(0))
        out = bias_act_dropout_reference(x, b, act, p, True, mask)
        out.backward(torch.ones_like(out))
        expect_gx = ((x + b) > 0).double() * mask.double() / (1 - p)
        torch.testing.assert_close(x.grad, expect_gx)
        torch.testing.assert_close(b.grad, expect_gx.sum((0, 1)))


def _dropout_calls():
    x = rnd(4, 50, 64, seed=1, dtype=torch.float32)
    r = rnd(4, 50, 64, seed=2, dtype=torch.float32)
    b = rnd(64, seed=3, dtype=torch.float32)
    tok = torch.randint(2, 100, (4, 50), generator=torch.Generator().manual_seed(4))
    W = rnd(100, 64, seed=5, dtype=torch.float32)
    return {
        "bias_dropout_residual": (
            lambda p, **kw: ops.bias_dropout_residual(x, b, r, p, **kw),
            lambda p, m: bias_dropout_residual_reference(x, b, r, p, True, m),
            lambda out: out - r,
        ),
        "bias_act_dropout": (
            lambda p, **kw: ops.bias_act_dropout(x, b, "gelu", p, **kw),
            lambda p, m: bias_act_dropout_reference(x, b, "gelu", p, True, m),
            lambda out: out,
        ),
        "embedding": (
            lambda p, **kw: ops.embedding(tok, W, scale=2.0, p=p, **kw),
            lambda p, m: embedding_reference(tok, W, scale=2.0, p=p, mask=m),
            lambda out: out,
        ),
    }


@pytest.mark.parametrize("name", ["bias_dropout_residual", "bias_act_dropout", "embedding"])
def test_dropout_mask_replay_keep_rate_and_seed(name):
    call, ref, dropped_part = _dropout_calls()[name]
    p = 0.3
    torch.manual_seed(123)
    out, mask = call(p, return_mask=True)
    assert mask.dtype == torch.bool and mask.shape == out.shape
    # replay: the reference with the returned mask gives the same output, bit for bit
    assert torch.equal(out, ref(p, mask))
    # dropped entries are exactly zero, kept ones are scaled by 1 / (1 - p)
    full = ref(p, torch.ones_like(mask))
    part, full_part = dropped_part(out), dropped_part(full)
    assert torch.equal(part[~mask], torch.zeros_like(part[~mask]))
    torch.testing.assert_close(part[mask], full_part[mask])
    keep = mask.double().mean().item()
    assert abs(keep - (1 - p)) < 4 * math.sqrt(p * (1 - p) / mask.numel()) + 1e-3, keep
    # torch.manual_seed reproduces the mask; another seed changes it
    torch.manual_seed(123)
    out2, mask2 = call(p, return_mask=True)
    assert torch.equal(mask, mask2) and torch.equal(out, out2)
    torch.manual_seed(124)
    assert not torch.equal(mask, call(p, return_mask=True)[1])
    # the plain call draws a mask too, with the same keep rate
    plain = dropped_part(call(p))
    assert abs(plain.eq(0).double().mean().item() - p) < 0.02
    # no dropout without training or with p = 0: no mask
    out_eval, m_eval = call(p, training=False, return_mask=True)
    assert m_eval is None and torch.equal(out_eval, ref(0.0, None))
    assert call(0.0, return_mask=True)[1] is None


# ------------------------------------------------------------------------- embedding
def test_embedding_matches_fairseq_sinusoidal_and_grads():
    pad, V, C, B, T = 1, 23, 10, 3, 9
    tok = torch.randint(2, V, (B, T), generator=torch.Generator().manual_seed(0))
    tok[0, 6:] = pad
    tok[2, 3:] = pad
    W = rnd(V, C, seed=1, requires_grad=True)
    sin = SinusoidalPositionalEmbedding(C, pad, init_size=T + pad + 1)
    pos_w = SinusoidalPositionalEmbedding.get_embedding(T + pad + 1, C, pad).double()
    positions = fairseq_utils.make_positions(tok, pad)
    scale = math.sqrt(C)
    out = ops.embedding(tok, W, pos_w, positions, scale=scale, padding_idx=pad, zero_pad=True)
    expect = scale * W[tok] + sin(tok).double()
    expect = expect.masked_fill(tok.eq(pad).unsqueeze(-1), 0.0)
    torch.testing.assert_close(out, expect)
    # weight gradient: scatter-add of the output gradient, nothing into the padding row
    go = rnd(B, T, C, seed=2)
    out.backward(go)
    g_expect = torch.zeros(V, C, **D64).index_add_(0, tok.reshape(-1), (scale * go).reshape(-1, C))
    g_expect[pad] = 0
    torch.testing.assert_close(W.grad, g_expect)
    # learned positions get their gradient too
    P = rnd(T + 2, C, seed=3, requires_grad=True)
    assert torch.autograd.gradcheck(
        # zero_pad: padding rows get no gradient by design (nn.Embedding semantics), so their
        # outputs must not depend on them either for a numerical Jacobian to agree
        lambda w, pw: ops.embedding(tok, w, pw, positions, scale=scale, padding_idx=pad, zero_pad=True), (W, P)
    )


# ------------------------------------------------------------------------- attention
def manual_attention(q, k, v, allowed):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


def test_split_and_merge_heads():
    B, T, H, Dh = 2, 5, 3, 4
    C = H * Dh
    x, bias = rnd(B, T, 3 * C, seed=1, requires_grad=True), rnd(3 * C, seed=2, requires_grad=True)
    q, k, v = ops.qkv_split(x, bias, H)
    y = x + bias
    for i, t in enumerate((q, k, v)):
        for h in range(H):
            torch.testing.assert_close(t[:, h], y[..., i * C + h * Dh:i * C + (h + 1) * Dh])
    k2, v2 = ops.kv_split(x[..., C:], bias[C:], H)  # a non-contiguous slice, as the decoder passes
    torch.testing.assert_close(k2, k)
    torch.testing.assert_close(v2, v)
    k3, v3 = ops.kv_split(x[..., C:].detach(), None, H)
    torch.testing.assert_close(k3, (k - bias[C:2 * C].view(H, 1, Dh)).detach())
    torch.testing.assert_close(ops.merge_heads(q), y[..., :C])
    assert torch.autograd.gradcheck(lambda a, b: ops.qkv_split(a, b, H), (x, bias))
    assert torch.autograd.gradcheck(lambda a: ops.merge_heads(a), (q.detach().requires_grad_(),))


def test_merge_heads_of_token_major_input_is_a_view():
    B, H, T, D = 2, 3, 5, 4
    base = torch.randn(B, T, H, D, dtype=torch.float64, requires_grad=True)
    x = base.transpose(1, 2)  # [B, H, T, D] view of token-major memory, as SDPA returns it
    y = ops.merge_heads(x)
    assert y.data_ptr() == base.data_ptr()
    assert torch.equal(y, x.detach().transpose(1, 2).reshape(B, T, H * D))
    g = torch.randn_like(y)
    (gb,) = torch.autograd.grad(y, [base], g)
    assert torch.equal(gb, g.view(B, T, H, D))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_against_manual_and_gradcheck(causal):
    B, H, Tq, S, Dh = 2, 3, 4, 6, 5
    q, k, v = (rnd(B, H, n, Dh, seed=i, requires_grad=True) for i, n in enumerate((Tq, S, S)))
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 4:] = True
    allowed = (~kpm).view(B, 1, 1, S)
    if causal:  # incremental form: query i sits at absolute position S - Tq + i
        allowed = allowed & (torch.arange(S).view(1, S) <= torch.arange(Tq).view(Tq, 1) + S - Tq)
    out = ops.attention(q, k, v, kpm, causal=causal)
    torch.testing.assert_close(out, manual_attention(q, k, v, allowed))
    assert torch.autograd.gradcheck(lambda a, b, c: ops.attention(a, b, c, kpm, causal=causal), (q, k, v))
    # dropout only in training
    torch.testing.assert_close(ops.attention(q, k, v, kpm, causal, p=0.5, training=False), out)


@pytest.mark.parametrize("self_attn", [True, False])
def test_attention_pipeline_matches_fairseq_multihead_attention(self_attn):
    torch.manual_seed(0)
    B, T, S, C, H = 2, 5, 7, 12, 3
    mha = MultiheadAttention(C, H, self_attention=self_attn, encoder_decoder_attention=not self_attn).double()
    x = rnd(B, T, C, seed=1)
    enc = x if self_attn else rnd(B, S, C, seed=2)
    kpm = torch.zeros(B, enc.shape[1], dtype=torch.bool)
    kpm[0, -2:] = True
    Wqkv = torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight])
    bqkv = torch.cat([mha.q_proj.bias, mha.k_proj.bias, mha.v_proj.bias])
    if self_attn:
        q, k, v = ops.qkv_split(x @ Wqkv.t(), bqkv, H)
    else:
        q = ops.qkv_split(torch.cat([x @ Wqkv[:C].t()] * 3, -1), torch.cat([bqkv[:C]] * 3), H)[0]
        k, v = ops.kv_split(enc @ Wqkv[C:].t(), bqkv[C:], H)
    ours = mha.out_proj(ops.merge_heads(ops.attention(q, k, v, kpm, causal=self_attn)))
    future = torch.triu(torch.full((T, T), float("-inf"), **D64), 1) if self_attn else None
    with warnings.catch_warnings():  # fairseq mixes a bool padding mask with a float future mask
        warnings.simplefilter("ignore", UserWarning)
        theirs, _ = mha(x.transpose(0, 1), enc.transpose(0, 1), enc.transpose(0, 1), key_padding_mask=kpm,
                        attn_mask=future, need_weights=False)
    torch.testing.assert_close(ours, theirs.transpose(0, 1))


# ---------------------------------------------------------------------- cross entropy
@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_label_smoothed_cross_entropy_matches_fairseq(eps):
    N, V, pad = 17, 11, 1
    logits = rnd(N, V, seed=1, requires_grad=True, scale=2)
    target = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))
    target[[0, 5, 6]] = pad
    loss, nll = ops.label_smoothed_cross_entropy(logits, target, eps, ignore_index=pad)
    lprobs = torch.log_softmax(logits, -1)
    ref_loss, ref_nll = label_smoothed_nll_loss(lprobs, target, eps, ignore_index=pad)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(nll, ref_nll)
    g_ours = torch.autograd.grad(loss, logits)[0]
    g_ref = torch.autograd.grad(ref_loss, logits)[0]
    torch.testing.assert_close(g_ours, g_ref)
    assert torch.autograd.gradcheck(lambda l: ops.label_smoothed_cross_entropy(l, target, eps, pad), (logits,))
    # 3-D logits with [B, T] targets give the same sums
    l3, n3 = ops.label_smoothed_cross_entropy(logits.view(1, N, V), target.view(1, N), eps, pad)
    torch.testing.assert_close((l3, n3), (loss, nll))


# --------------------------------------------------------------------------- adam
@pytest.mark.parametrize("mode", ["fairseq", "torch"])
def test_adam_reference_matches_fairseq_and_torch(mode):
    n = 1031
    p_ours = rnd(n, seed=1, dtype=torch.float32)
    ref = torch.nn.Parameter(p_ours.clone())
    ea, eas = torch.zeros(n), torch.zeros(n)
    lp = torch.empty(n, dtype=torch.bfloat16)
    kw = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.05)
    opt = FairseqAdam([ref], **kw) if mode == "fairseq" else torch.optim.AdamW([ref], **kw)
    for step in range(1, 8):
        g = rnd(n, seed=10 + step, dtype=torch.float32)
        ref.grad = g.clone()
        opt.step()
        ops.adam_(p_ours, g * 4, ea, eas, lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-6, weight_decay=0.05,
                  step=step, grad_scale=0.25, param_lp=lp, mode=mode)
        torch.testing.assert_close(p_ours, ref.data, rtol=1e-6, atol=1e-7)
        assert torch.equal(lp, p_ours.bfloat16())
    torch.testing.assert_close(ea, opt.state[ref]["exp_avg"])



def test_adam_device_grad_scale_is_multiplied_in_and_nonfinite_skips():
    n = 257
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-6, weight_decay=0.0, step=1)
    g = rnd(n, seed=3, dtype=torch.float32)
    a = [rnd(n, seed=4, dtype=torch.float32), torch.zeros(n), torch.zeros(n)]
    b = [t.clone() for t in a]
    ops.adam_(a[0], g, a[1], a[2], grad_scale=0.5, grad_scale_tensor=torch.tensor(0.25), **hp)
    ops.adam_(b[0], g, b[1], b[2], grad_scale=0.125, **hp)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    before = [t.clone() for t in a]
    for bad in (float("inf"), float("nan")):
        ops.adam_(a[0], g, a[1], a[2], grad_scale_tensor=torch.tensor(bad), **hp)
        for x, y in zip(a, before):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="grad_scale_tensor"):
        ops.adam_(a[0], g, a[1], a[2], grad_scale_tensor=torch.ones(2), **hp)


def test_adam_peer_copy_gets_the_new_weights_unless_skipped():
    n = 257
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-6, weight_decay=0.0)
    g = rnd(n, seed=5, dtype=torch.float32)
    p, m, v = rnd(n, seed=6, dtype=torch.float32), torch.zeros(n), torch.zeros(n)
    lp, peer = torch.zeros(n, dtype=torch.float16), torch.zeros(n, dtype=torch.float16)
    ops.adam_(p, g, m, v, step=1, param_lp=lp, param_lp_peer=peer, **hp)
    assert torch.equal(peer, p.half()) and torch.equal(peer, lp)
    before = peer.clone()
    ops.adam_(p, g, m, v, step=2, param_lp=lp, param_lp_peer=peer, grad_scale_tensor=torch.tensor(float("nan")), **hp)
    assert torch.equal(peer, before)
    fp32_peer = torch.zeros(n)  # without param_lp the peer copy is fp32, like the master
    ops.adam_(p, g, m, v, step=2, param_lp_peer=fp32_peer, **hp)
    assert torch.equal(fp32_peer, p)
    with pytest.raises(ValueError, match="param_lp_peer must be torch.float32"):
        ops.adam_(p, g, m, v, step=3, param_lp_peer=peer, **hp)
    with pytest.raises(ValueError, match="param_lp_peer has 256 elements"):
        ops.adam_(p, g, m, v, step=3, param_lp=lp, param_lp_peer=peer[1:], **hp)


def test_adam_ranges_update_only_those_ranges():
    n = 301
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-6, weight_decay=0.01, step=1)
    ranges = [(0, 10), (40, 41), (100, 177), (177, 300)]
    g = rnd(n, seed=7, dtype=torch.float16)
    a = [rnd(n, seed=8, dtype=torch.float32), torch.rand(n), torch.rand(n), torch.zeros(n, dtype=torch.float16)]
    b = [t.clone() for t in a]
    ops.adam_(a[0], g, a[1], a[2], param_lp=a[3], ranges=ranges, **hp)
    for lo, hi in ranges:  # one call over the ranges = one call per range
        ops.adam_(b[0][lo:hi], g[lo:hi], b[1][lo:hi], b[2][lo:hi], param_lp=b[3][lo:hi], **hp)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    untouched = torch.ones(n, dtype=torch.bool)
    for lo, hi in ranges:
        untouched[lo:hi] = False
    assert untouched.sum() == n - 10 - 1 - 200 and torch.equal(a[3][untouched], torch.zeros(int(untouched.sum())).half())
    before = [t.clone() for t in a]
    ops.adam_(a[0], g, a[1], a[2], param_lp=a[3], ranges=ranges, grad_scale_tensor=torch.tensor(float("inf")), **hp)
    for x, y in zip(a, before):
        assert torch.equal(x, y)  # a skipped step writes no range
    ops.adam_(a[0], g, a[1], a[2], param_lp=a[3], ranges=[], **hp)
    for x, y in zip(a, before):
        assert torch.equal(x, y)  # no range, no update


@pytest.mark.parametrize("ranges, match", [
    ([(5, 3)], "range \\[5, 3\\) is not inside the 64 elements"),
    ([(0, 65)], "range \\[0, 65\\) is not inside"),
    ([(-1, 4)], "is not inside"),
    ([(0, 8), (4, 12)], "ascending and disjoint: \\[4, 12\\) starts before the previous range ends at 8"),
    ([(8, 12), (0, 4)], "ascending and disjoint"),
    ([(1, 2, 3)], "ranges must be \\(lo, hi\\) pairs"),
])
def test_ranges_are_checked(ranges, match):
    p, m, v, g = torch.zeros(64), torch.zeros(64), torch.zeros(64), torch.ones(64)
    with pytest.raises(ValueError, match=match):
        ops.adam_(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1, ranges=ranges)
    with pytest.raises(ValueError, match=match):
        ops.grad_norm(g, ranges=ranges)
    assert torch.equal(p, torch.zeros(64))


def test_ranges_need_flat_buffers():
    p, m, v, g = torch.zeros(4, 16), torch.zeros(4, 16), torch.zeros(4, 16), torch.ones(4, 16)
    with pytest.raises(ValueError, match="ranges index 1-D flat buffers; got a buffer of shape \\(4, 16\\)"):
        ops.adam_(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1, ranges=[(0, 8)])
    with pytest.raises(ValueError, match="ranges index 1-D flat buffers"):
        ops.grad_norm(g, ranges=[(0, 8)])
    ops.adam_(p, g, m, v, lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)  # no ranges: any shape
    assert not torch.equal(p, torch.zeros(4, 16))


def test_grad_norm_of_ranges():
    g = rnd(1031, seed=2, dtype=torch.bfloat16)
    ranges = [(3, 17), (500, 1031)]
    want = torch.cat([g[3:17], g[500:]]).double().norm()
    torch.testing.assert_close(ops.grad_norm(g, ranges=ranges).double(), want, rtol=1e-6, atol=0)
    assert ops.grad_norm(g, ranges=[]).item() == 0.0 and ops.grad_norm(g, ranges=[(4, 4)]).item() == 0.0
    g[20] = float("inf")  # outside the ranges: not seen
    assert ops.grad_norm(g, ranges=ranges).isfinite() and ops.grad_norm(g, ranges=[(20, 21)]).isinf()


def test_grad_norm():
    g = rnd(1031, seed=1, dtype=torch.float16)
    n = ops.grad_norm(g)
    assert n.dtype == torch.float32 and n.dim() == 0
    torch.testing.assert_close(n.double(), torch.linalg.vector_norm(g.double()), rtol=1e-6, atol=0)
    g[7] = float("inf")
    assert ops.grad_norm(g).isinf()
    g[8] = float("nan")
    assert ops.grad_norm(g).isnan()


# ------------------------------------------------------------------------- bad input
def _bad_calls():
    x, r, b = torch.zeros(2, 3, 8), torch.zeros(2, 3, 8), torch.zeros(8)
    tok, W = torch.zeros(2, 3, dtype=torch.long), torch.zeros(5, 8)
    q = torch.zeros(2, 2, 3, 4)
    buf = torch.zeros(4)
    adam = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, step=1)
    return [
        (lambda: ops.bias_dropout_residual(x, b, r, 1.0), "dropout probability must be in \\[0, 1\\), got 1.0"),
        (lambda: ops.bias_dropout_residual(x, b, r, -0.1), "dropout probability must be in \\[0, 1\\)"),
        (lambda: ops.bias_act_dropout(x, b, "relu", 1.5), "activation dropout probability must be in"),
        (lambda: ops.embedding(tok, W, p=1.0), "dropout probability must be in"),
        (lambda: ops.attention(q, q, q, p=2.0), "attention dropout probability must be in"),
        (lambda: ops.bias_act_dropout(x, b, "swish"), "unsupported activation 'swish'"),
        (lambda: ops.qkv_split(torch.zeros(2, 3, 3 * 10), None, 4), "embed_dim 10 is not divisible by num_heads 4"),
        (lambda: ops.kv_split(torch.zeros(2, 3, 2 * 10), None, 3), "embed_dim 10 is not divisible by num_heads 3"),
        (lambda: ops.qkv_split(torch.zeros(2, 3, 10), None, 1), "expected \\[batch, length, 3\\*embed_dim\\]"),
        (lambda: ops.qkv_split(torch.zeros(2, 3, 12), torch.zeros(5), 2), "bias shape \\(5,\\) != \\(12,\\)"),
        (lambda: ops.merge_heads(torch.zeros(2, 3, 4)), "merge_heads: expected \\[batch, heads, length, head_dim\\]"),
        (lambda: ops.attention(q, q, q, torch.zeros(2, 5, dtype=torch.bool)), "key_padding_mask shape \\(2, 5\\)"),
        (lambda: ops.bias_dropout_residual(x, b, torch.zeros(2, 3, 7)), "residual shape \\(2, 3, 7\\) != x shape"),
        (lambda: ops.bias_dropout_residual(x, torch.zeros(7), r), "bias: expected last dimension 8"),
        (lambda: ops.bias_act_dropout(x, torch.zeros(3)), "bias: expected last dimension 8"),
        (lambda: ops.layer_norm(x, torch.zeros(7), b), "layer_norm weight: expected last dimension 8"),
        (lambda: ops.add_layer_norm(x, torch.zeros(2, 8), b, b), "residual shape \\(2, 8\\) != x shape"),
        (lambda: ops.embedding(torch.zeros(6), W), "tokens must be an integer \\[batch, length\\]"),
        (lambda: ops.embedding(tok, W, torch.zeros(9, 8)), "positions must be given"),
        (lambda: ops.embedding(tok, W, torch.zeros(9, 7), tok), "positional width 7 != token embedding width 8"),
        (lambda: ops.label_smoothed_cross_entropy(x, tok[:, :2]), "logits \\(2, 3, 8\\) do not match target"),
        (lambda: ops.label_smoothed_cross_entropy(x, tok, 1.0), "label smoothing must be in \\[0, 1\\)"),
        (lambda: ops.adam_(buf, torch.zeros(3), buf.clone(), buf.clone(), **adam), "grad has 3 elements, param has 4"),
        (lambda: ops.adam_(buf.half(), buf, buf.clone(), buf.clone(), **adam), "param must be float32"),
        (lambda: ops.adam_(buf, buf, buf, buf, mode="sgd", **adam), "mode must be one of"),
        (lambda: ops.adam_(buf, buf, buf, buf, **dict(adam, step=0)), "step must be >= 1"),
    ]


@pytest.mark.parametrize("i", range(len(_bad_calls())))
def test_bad_input_errors_name_the_problem(i):
    fn, msg = _bad_calls()[i]
    with pytest.raises(ValueError, match=msg):
        fn()


def test_attention_backend_choice_equals_sdpa_kernel_and_restores():
    """The attention op's reusable backend context sets the same SDPA flags and priority order as
    torch's sdpa_kernel, nests, and restores what was set before."""
    import importlib

    from torch.nn.attention import SDPBackend, _cur_sdpa_kernel_backends, sdpa_kernel

    A = importlib.import_module("ls_fairseq.ops.attention")
    if A._FAST_BACKENDS is None:
        pytest.skip("this torch lacks the SDPA flag functions; the public context manager is used")

    def state():
        return _cur_sdpa_kernel_backends(with_priority=True), list(torch._C._get_sdp_priority_order())

    def torch_ctx(short):
        return sdpa_kernel(A._SDPA_SHORT if short else A._SDPA_BACKENDS, set_priority=short)

    base = list(torch._C._get_sdp_priority_order())
    before = state()
    for short in (False, True):
        with sdpa_kernel(SDPBackend.MATH):
            torch._C._set_sdp_priority_order(base)  # (torch's own context does not restore the order)
            with torch_ctx(short):
                want = state()
                with torch_ctx(not short):
                    want_nested = state()
            torch._C._set_sdp_priority_order(base)
            outer = state()
            with A._backends(short):
                assert state() == want
                with A._backends(not short):
                    assert state() == want_nested
                assert state() == want
            assert state() == outer  # ours restores exactly
    torch._C._set_sdp_priority_order(base)
    assert state() == before


def test_linear_on_cpu_is_torch_linear():
    """ops.linear: the C++ node is for CUDA tensors; elsewhere it is F.linear, values and gradients."""
    import torch.nn.functional as F

    from ls_fairseq import ops

    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    for bias in (None, b):
        y = ops.linear(x, w, bias)
        y_ref = F.linear(x, w, bias)
        assert torch.equal(y, y_ref)
        gy = torch.randn_like(y)
        ins = [x, w] + ([b] if bias is not None else [])
        for g, r in zip(torch.autograd.grad((y * gy).sum(), ins), torch.autograd.grad((y_ref * gy).sum(), ins)):
            assert torch.equal(g, r)


def test_kernel_module_takes_the_reference_off_cuda():
    from ls_fairseq.ops import _dispatch

    x = torch.randn(2, 4)
    assert _dispatch.kernel_module("layer_norm", x, None, x) is None
    assert _dispatch.cpp_nodes(None) is None
