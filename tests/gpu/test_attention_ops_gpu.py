import pytest
import torch

from ls_fairseq.ops import attention, kv_split, merge_heads, qkv_split
from ls_fairseq.ops.attention import _split_reference, merge_heads_reference
from ._tols import DTYPES, assert_close_to_gold

pytestmark = pytest.mark.gpu

SHAPES = [(1, 1, 1, 1), (2, 13, 4, 8), (3, 7, 2, 7), (2, 67, 16, 64), (1, 5, 3, 63)]  # B, T, H, D


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("with_bias", [True, False])
def test_split_matches_reference(dtype, shape, n, with_bias):
    B, T, H, D = shape
    torch.manual_seed(B + T + H + D)
    x = torch.randn(B, T, n * H * D, device="cuda")
    bias = torch.randn(n * H * D, device="cuda") if with_bias else None
    gs = [torch.randn(B, H, T, D, device="cuda") for _ in range(n)]
    op = qkv_split if n == 3 else kv_split
    res = []
    for dt, fn in ((dtype, lambda a, b: op(a, b, H)), (dtype, lambda a, b: _split_reference(a, b, n, H)),
                   (torch.float32, lambda a, b: _split_reference(a, b, n, H))):
        xi = x.to(dt).requires_grad_(True)
        bi = bias.to(dt).requires_grad_(True) if bias is not None else None
        outs = fn(xi, bi)
        loss = sum((o.float() * g).sum() for o, g in zip(outs, gs))
        ins = [xi] + ([bi] if bi is not None else [])
        res.append((outs, torch.autograd.grad(loss, ins)))
    (fo, fg), (lo, lg), (go, gg) = res
    for a, l, g in zip(fo, lo, go):
        # token-major storage: [B, T, H, D] in memory, the layout SDPA reads natively
        assert a.shape == (B, H, T, D) and a.dtype == dtype and a.transpose(1, 2).is_contiguous()
        assert_close_to_gold(a, l, g, dtype, "out")
    for k, (a, l, g) in enumerate(zip(fg, lg, gg)):
        assert_close_to_gold(a, l, g, dtype, f"grad{k}")


def test_split_partial_gradients():
    x = torch.randn(2, 5, 3 * 16, device="cuda", requires_grad=True)
    q, k, v = qkv_split(x, None, 4)
    (gx,) = torch.autograd.grad(k.sum(), [x])
    assert torch.equal(gx[..., 16:32], torch.ones_like(gx[..., 16:32]))
    assert gx[..., :16].abs().sum() == 0 and gx[..., 32:].abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_merge_heads_is_exact(dtype, shape):
    B, T, H, D = shape
    x = torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True)
    y = merge_heads(x)
    assert torch.equal(y, merge_heads_reference(x.detach()))
    g = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, [x], g)
    assert torch.equal(gx, g.view(B, T, H, D).transpose(1, 2))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_merge_heads_of_sdpa_output_is_a_free_view(dtype):
    """SDPA's flash / efficient output is token-major: merge_heads returns a view, no kernel."""
    B, H, T, D = 3, 4, 17, 64
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    out = attention(q, k, v)  # flash (no mask): token-major output
    y = merge_heads(out)
    if dtype != torch.float32:  # fp32 may take another backend; the values must agree either way
        assert y.data_ptr() == out.data_ptr()
    assert torch.equal(y, merge_heads_reference(out.detach()))
    g = torch.randn_like(y)
    grads = torch.autograd.grad(y, [q, k, v], g, retain_graph=True)
    ref = torch.autograd.grad(merge_heads_reference(out), [q, k, v], g)
    for a, b in zip(grads, ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_is_token_major_and_backward_reads_either_layout(dtype):
    B, T, H, D = 3, 11, 4, 16
    x = torch.randn(B, T, 3 * H * D, device="cuda", dtype=dtype, requires_grad=True)
    bias = torch.randn(3 * H * D, device="cuda", dtype=dtype, requires_grad=True)
    q, k, v = qkv_split(x, bias, H)
    for t in (q, k, v):
        assert t.shape == (B, H, T, D) and t.transpose(1, 2).is_contiguous()
    ref = _split_reference(x.detach(), bias.detach(), 3, H)
    for a, b in zip((q, k, v), ref):
        assert torch.equal(a, b)
    gs = [torch.randn(B, H, T, D, device="cuda", dtype=dtype) for _ in range(3)]
    head_major = torch.autograd.grad((q, k, v), (x, bias), gs, retain_graph=True)
    token_major = torch.autograd.grad((q, k, v), (x, bias), [g.transpose(1, 2).contiguous().transpose(1, 2)
                                                             for g in gs])
    assert torch.equal(head_major[0], token_major[0]) and torch.equal(head_major[1], token_major[1])
    want = torch.cat([g.transpose(1, 2).reshape(B, T, H * D) for g in gs], dim=-1)
    assert torch.equal(head_major[0], want)


@pytest.mark.parametrize("n", [6, 12, 70])  # 70: more parts than one merge kernel takes (stacked instead)
def test_batched_kv_split_backward_matches_reference(n):
    """The layer-batched cross-attention keys and values: their gradients merged, unused parts as zeros, and the
    bias gradient summed, by the split node's backward."""
    from ls_fairseq.ops import split_heads

    B, T, H, D = 2, 7, 2, 8
    x = torch.randn(B, T, n * H * D, device="cuda", dtype=torch.float16, requires_grad=True)
    bias = torch.randn(n * H * D, device="cuda", dtype=torch.float16, requires_grad=True)
    parts = split_heads(x, bias, n, H)
    assert "SplitHeadsNode" in parts[0].grad_fn.name()
    gs = [torch.randn(B, H, T, D, device="cuda", dtype=torch.float16) for _ in range(n)]
    gs[3] = None  # a layer whose K got no gradient
    used = [(p, g) for p, g in zip(parts, gs) if g is not None]
    dx, db = torch.autograd.grad([p for p, _ in used], (x, bias), [g for _, g in used])
    zero = torch.zeros(B, H, T, D, device="cuda", dtype=torch.float16)
    want = torch.cat([(g if g is not None else zero).transpose(1, 2).reshape(B, T, H * D) for g in gs], dim=-1)
    assert torch.equal(dx, want)
    torch.testing.assert_close(db, want.float().sum((0, 1)).half(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [17, 100])  # short: memory-efficient kernel; long: flash
@pytest.mark.parametrize("kind", ["none", "causal", "padding", "cross"])
def test_attention_matches_reference(dtype, T, kind):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ls_fairseq.ops.attention import SHORT_ATTENTION_LEN, _attn_mask, attention_reference

    assert (T <= SHORT_ATTENTION_LEN) == (T == 17)
    torch.manual_seed(T)
    B, H, D = 3, 4, 64
    S = T + 9 if kind == "cross" else T
    q0, k0, v0 = torch.randn(B, H, T, D, device="cuda"), torch.randn(B, H, S, D, device="cuda"), \
        torch.randn(B, H, S, D, device="cuda")
    g = torch.randn(B, H, T, D, device="cuda")
    kpm = None
    if kind in ("padding", "cross"):
        kpm = torch.zeros(B, S, dtype=torch.bool, device="cuda")
        kpm[0, : S // 3] = True  # left padding, as fairseq pads sources
        kpm[2, -2:] = True
    causal = kind == "causal"
    res = {}
    for name, dt in (("fused", dtype), ("lowp", dtype), ("gold", torch.float64)):
        q, k, v = (t.to(dtype).to(dt).requires_grad_(True) for t in (q0, k0, v0))
        if name == "fused":
            out = attention(q, k, v, key_padding_mask=kpm, causal=causal, p=0.0, training=True)
        elif name == "lowp":  # PyTorch's math backend in the low-precision dtype
            with sdpa_kernel([SDPBackend.MATH]):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=_attn_mask(q, k, kpm, causal))
        else:
            out = attention_reference(q, k, v, key_padding_mask=kpm, causal=causal, p=0.0, training=True)
        res[name] = (out, torch.autograd.grad((out.double() * g.double()).sum(), (q, k, v)))
    (fo, fg), (lo, lg), (go, gg) = res["fused"], res["lowp"], res["gold"]
    assert_close_to_gold(fo, lo, go, dtype, "out")
    for i in range(3):
        assert_close_to_gold(fg[i], lg[i], gg[i], dtype, f"grad{i}")
