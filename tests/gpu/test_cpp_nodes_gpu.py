"""The C++ autograd nodes (ls_fairseq._C.ag_*) against the Python autograd.Functions they replace in
eager mode: the same kernels, so the same outputs and gradients bit for bit (dropout included, from
the same generator state), and the linear node against F.linear."""

import pytest
import torch
import torch.nn.functional as F

from ls_fairseq import _ext, ops
from ls_fairseq.ops import _dispatch
from ls_fairseq.ops.attention import Varlen

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def python_functions(monkeypatch):
    """A context in which the ops take their Python autograd.Functions."""
    class _Switch:
        def __enter__(self):
            monkeypatch.setattr(_dispatch, "_CPP_AUTOGRAD", False)

        def __exit__(self, *exc):
            monkeypatch.setattr(_dispatch, "_CPP_AUTOGRAD", True)

    return _Switch()


def _leaves(*ts):
    return [t.detach().clone().requires_grad_(True) if t is not None else None for t in ts]


def _both(fn, inputs, python_functions, seed=7):
    """(outputs, grads) of fn on copies of inputs, once with the C++ nodes, once with Python Functions."""
    res = []
    for use_python in (False, True):
        leaves = _leaves(*inputs)
        torch.manual_seed(seed)
        if use_python:
            with python_functions:
                out = fn(*leaves)
        else:
            out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        g = torch.Generator(device="cuda").manual_seed(11)
        loss = sum((o.float() * torch.randn(o.shape, device="cuda", generator=g)).sum() for o in outs
                   if o.is_floating_point())
        grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
        res.append((outs, grads))
    return res


def _assert_same(a, b):
    (oa, ga), (ob, gb) = a, b
    assert len(oa) == len(ob) and len(ga) == len(gb)
    for x, y in zip(oa + ga, ob + gb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y)


def test_extension_has_the_nodes():
    assert _dispatch.cpp_nodes(_ext.get()) is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_nodes(dtype, python_functions):
    x = torch.randn(3, 37, 1024, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(1024, device="cuda")).to(dtype)
    b = (0.1 * torch.randn(1024, device="cuda")).to(dtype)
    _assert_same(*_both(lambda x, w, b: ops.layer_norm(x, w, b), [x, w, b], python_functions))
    _assert_same(*_both(lambda x, r, w, b: ops.add_layer_norm(x, r, w, b), [x, r, w, b], python_functions))
    _assert_same(*_both(lambda x, w, b: ops.pre_layer_norm(x, w, b), [x, w, b], python_functions))


def test_pre_layer_norm_residual_only(python_functions):
    """Only the passed-on input is used: the node hands its gradient straight through."""
    x = torch.randn(4, 9, 256, device="cuda", requires_grad=True)
    w = torch.ones(256, device="cuda", requires_grad=True)
    b = torch.zeros(256, device="cuda", requires_grad=True)
    _, xs = ops.pre_layer_norm(x, w, b)
    (gx,) = torch.autograd.grad((xs * 3).sum(), [x])
    assert torch.equal(gx, torch.full_like(x, 3.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.1])
def test_dropout_nodes(dtype, p, python_functions):
    x = torch.randn(5, 33, 1024, device="cuda", dtype=dtype)
    r = torch.randn_like(x)
    b = torch.randn(1024, device="cuda", dtype=dtype)
    _assert_same(*_both(lambda x, b, r: ops.bias_dropout_residual(x, b, r, p, True), [x, b, r], python_functions))
    for act in ("relu", "gelu"):
        _assert_same(*_both(lambda x, b: ops.bias_act_dropout(x, b, act, p, True), [x, b], python_functions))
    # without a bias
    _assert_same(*_both(lambda x, r: ops.bias_dropout_residual(x, None, r, p, True), [x, r], python_functions))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_heads_nodes(dtype, python_functions):
    x = torch.randn(3, 21, 3 * 512, device="cuda", dtype=dtype)
    b = torch.randn(3 * 512, device="cuda", dtype=dtype)
    _assert_same(*_both(lambda x, b: ops.qkv_split(x, b, 8), [x, b], python_functions))
    kv = x[..., : 2 * 512].contiguous()
    _assert_same(*_both(lambda x, b: ops.kv_split(x, b, 8), [kv, b[: 2 * 512].contiguous()], python_functions))


def test_split_heads_one_part_unused():
    """q and v used, k not: the node gets an undefined gradient for k and treats it as zero."""
    x = torch.randn(2, 7, 3 * 64, device="cuda", requires_grad=True)
    q, k, v = ops.qkv_split(x, None, 4)
    (gx,) = torch.autograd.grad(q.sum() + 2 * v.sum(), [x])
    want = torch.cat([torch.ones(64), torch.zeros(64), torch.full((64,), 2.0)]).cuda().expand(2, 7, -1)
    assert torch.equal(gx, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_node(dtype, bias):
    torch.manual_seed(0)
    x = torch.randn(4, 19, 256, device="cuda", dtype=dtype, requires_grad=True)
    w = (0.05 * torch.randn(384, 256, device="cuda")).to(dtype).requires_grad_(True)
    b = torch.randn(384, device="cuda", dtype=dtype, requires_grad=True) if bias else None
    ins = [x, w] + ([b] if bias else [])
    y = ops.linear(x, w, b)
    assert y.grad_fn is not None and "LinearNode" in y.grad_fn.name()
    gy = torch.randn_like(y)
    got = torch.autograd.grad((y * gy).sum(), ins)
    y_ref = F.linear(x, w, b)
    want = torch.autograd.grad((y_ref * gy).sum(), ins)
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, y_ref, **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else tol))
    for g, r in zip(got, want):
        assert g.dtype == r.dtype and g.shape == r.shape
        torch.testing.assert_close(g, r, **(dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else tol))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3, 12])
def test_linear_split_node(dtype, n):
    """ops.linear_split on CUDA: one node whose parts are views of the product (the bias added in the GEMM's
    epilogue), against F.linear and the split of its output; odd lengths, with and without a bias."""
    torch.manual_seed(0)
    heads, d = 4, 64
    x = torch.randn(3, 19, 256, device="cuda", dtype=dtype, requires_grad=True)
    w = (0.05 * torch.randn(n * heads * d, 256, device="cuda")).to(dtype).requires_grad_(True)
    for b in (torch.randn(n * heads * d, device="cuda", dtype=dtype, requires_grad=True), None):
        ins = [x, w] + ([b] if b is not None else [])
        parts = ops.linear_split(x, w, b, n, heads)
        assert len(parts) == n and "LinearSplitNode" in parts[0].grad_fn.name()
        if n > 1:  # views of one [57, n * 256] product
            assert parts[1].data_ptr() - parts[0].data_ptr() == heads * d * x.element_size()
            assert parts[0].stride(2) == n * heads * d
        ref_ins = [t.detach().float().requires_grad_(True) for t in ins]
        y = F.linear(*ref_ins)
        want = y.view(3, 19, n, heads, d).permute(2, 0, 3, 1, 4)
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        for i in range(n):
            torch.testing.assert_close(parts[i].float(), want[i], **tol)
        gys = [torch.randn_like(p) for p in parts]
        got = torch.autograd.grad(sum((p * g).sum() for p, g in zip(parts, gys)), ins)
        gy = torch.stack([g.float() for g in gys]).permute(1, 3, 0, 2, 4).reshape(3, 19, -1)
        ref = torch.autograd.grad((y * gy).sum(), ref_ins)
        for g, r in zip(got, ref):
            assert g.dtype == dtype and g.shape == r.shape
            torch.testing.assert_close(g.float(), r, **(tol if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-1)))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_reads_the_split_views_in_place(causal):
    """The short-attention kernels over q, k, v that are strided views of one product give what they give over
    contiguous copies, bit for bit, forward and backward (packed sentences, dropout drawn from the same state)."""
    torch.manual_seed(1)
    lengths = [5, 17, 33, 64, 1, 90]
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    rows = int(cu[-1])
    x = torch.randn(1, rows, 256, device="cuda", dtype=torch.bfloat16)
    w = (0.05 * torch.randn(3 * 256, 256, device="cuda")).to(torch.bfloat16)
    vl = Varlen(cu, cu, max(lengths), max(lengths))
    results = []
    for copy in (False, True):
        q, k, v = [t.detach() for t in ops.linear_split(x, w, None, 3, 4)]
        if copy:
            q, k, v = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
        q, k, v = [t.requires_grad_(True) for t in (q, k, v)]
        torch.manual_seed(5)
        out = ops.attention(q, k, v, causal=causal, p=0.1, training=True, varlen=vl)
        g = torch.randn(out.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2)).to(out.dtype)
        results.append([out] + list(torch.autograd.grad((out.float() * g.float()).sum(), [q, k, v])))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_linear_falls_back_to_torch():
    """Mixed dtypes and autocast take F.linear, with its own behaviour."""
    x = torch.randn(2, 3, 16, device="cuda")
    w = torch.randn(8, 16, device="cuda", dtype=torch.float16, requires_grad=True)
    with pytest.raises(RuntimeError):
        ops.linear(x, w)  # F.linear's dtype error, not a crash inside the extension
    with torch.autocast("cuda", dtype=torch.float16):
        y = ops.linear(x, w)
    assert y.dtype == torch.float16 and "LinearNode" not in y.grad_fn.name()


def test_node_errors_are_python_errors():
    x = torch.randn(2, 3, 16, device="cuda")
    with pytest.raises(RuntimeError, match="does not match weight"):
        _ext.get().ag_linear(x, torch.randn(8, 15, device="cuda"))
    with pytest.raises(RuntimeError, match="n must be >= 1"):
        _ext.get().ag_split_heads(torch.randn(2, 3, 64, device="cuda"), None, 0, 2)


def test_python_functions_switch(python_functions):
    """With the module flag off the ops take the Python Functions (as torch.compile does)."""
    x = torch.randn(2, 5, 64, device="cuda", requires_grad=True)
    w = torch.ones(64, device="cuda", requires_grad=True)
    b = torch.zeros(64, device="cuda", requires_grad=True)
    assert "LayerNormNode" in ops.layer_norm(x, w, b).grad_fn.name()
    with python_functions:
        assert "_LayerNormFn" in ops.layer_norm(x, w, b).grad_fn.name()
