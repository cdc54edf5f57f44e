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
        assert a.shape == (B, H, T, D) and a.dtype == dtype and a.is_contiguous()
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
    grads = torch.autograd.grad(y, [q, k, v], g)
    ref = torch.autograd.grad(merge_heads_reference(out), [q, k, v], g)
    for a, b in zip(grads, ref):
        assert torch.equal(a, b)
