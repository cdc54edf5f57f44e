import pytest
import torch

from ls_fairseq.ops import embedding
from ls_fairseq.ops.embedding import deterministic, embedding_reference
from ._tols import DTYPES, assert_close_to_gold, keep_rate_ok

pytestmark = pytest.mark.gpu

PAD = 1


def _inputs(B, T, V, C, P, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # Zipf-like tokens (heavy hitters exercise long runs in the sorted backward) plus padding.
    ranks = torch.randint(1, V, (B, T), device="cuda", generator=g)
    tokens = torch.where(torch.rand(B, T, device="cuda", generator=g) < 0.5, ranks % 5 + 2, ranks)
    lengths = torch.randint(1, T + 1, (B,), device="cuda", generator=g)
    pad = torch.arange(T, device="cuda")[None, :] >= lengths[:, None]
    tokens = tokens.masked_fill(pad, PAD)
    positions = (torch.cumsum((~pad).long(), 1) * (~pad).long()) + PAD  # fairseq's make_positions
    W = torch.randn(V, C, device="cuda", generator=g)
    Pw = torch.randn(P, C, device="cuda", generator=g)
    return tokens, positions, W, Pw


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("C", [1, 7, 63, 1024, 1031])
@pytest.mark.parametrize("BT", [(1, 1), (1, 13), (11, 373)])
@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("zero_pad", [False, True])
@pytest.mark.parametrize("learned_pos", [True, False])
def test_embedding_matches_reference(dtype, C, BT, p, zero_pad, learned_pos):
    B, T = BT
    V = 997
    tokens, positions, W, Pw = _inputs(B, T, V, C, T + 2, seed=C + B * T)
    scale = C ** 0.5
    g = torch.randn(B, T, C, device="cuda")
    w_f = W.to(dtype).requires_grad_(True)
    p_f = Pw.to(dtype).requires_grad_(learned_pos)
    out, mask = embedding(tokens, w_f, p_f, positions, scale=scale, p=p, padding_idx=PAD, zero_pad=zero_pad,
                          return_mask=True)
    if p > 0 and out.numel() > 10000:
        assert keep_rate_ok(mask, p)
    want = [w_f] + ([p_f] if learned_pos else [])
    gf = torch.autograd.grad((out.float() * g).sum(), want)
    res = []
    for dt in (dtype, torch.float32):
        wi = W.to(dt).requires_grad_(True)
        pi = Pw.to(dt).requires_grad_(learned_pos)
        o = embedding_reference(tokens, wi, pi, positions, scale, p, True, PAD, zero_pad, mask)
        res.append((o, torch.autograd.grad((o.float() * g).sum(), [wi] + ([pi] if learned_pos else []))))
    (lo, lg), (go, gg) = res
    assert out.dtype == dtype and out.shape == (B, T, C)
    assert_close_to_gold(out, lo, go, dtype, "out")
    for k, (a, l, gd) in enumerate(zip(gf, lg, gg)):
        assert a.dtype == dtype
        assert_close_to_gold(a, l, gd, dtype, f"grad{k}")
    assert gf[0][PAD].abs().max().item() == 0.0  # padding row never receives gradient


@pytest.fixture
def deterministic_algorithms():
    """Sets torch.use_deterministic_algorithms for one test and restores it after."""
    before = torch.are_deterministic_algorithms_enabled()
    yield torch.use_deterministic_algorithms
    torch.use_deterministic_algorithms(before)


@pytest.mark.parametrize("asked", [True, False])
def test_embedding_backward_bit_identical(deterministic_algorithms, asked):
    """The sorted backward gives the same bits run after run, whether or not torch's deterministic mode (which
    ls_fairseq.ops.embedding.deterministic() reports) asks for it."""
    deterministic_algorithms(asked)
    assert deterministic() is asked
    tokens, positions, W, Pw = _inputs(64, 128, 503, 1024, 130, seed=3)
    W = W.half().requires_grad_(True)
    g = torch.randn(64, 128, 1024, device="cuda", dtype=torch.float16)
    grads = []
    for _ in range(3):
        out = embedding(tokens, W, None, None, scale=32.0, p=0.0)
        (gw,) = torch.autograd.grad(out, [W], g)
        grads.append(gw)
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[1], grads[2])


def test_embedding_seed_reproduces_mask():
    tokens, positions, W, Pw = _inputs(4, 33, 100, 63, 40, seed=5)
    torch.manual_seed(11)
    m1 = embedding(tokens, W, Pw, positions, p=0.2, return_mask=True)[1]
    torch.manual_seed(11)
    m2 = embedding(tokens, W, Pw, positions, p=0.2, return_mask=True)[1]
    torch.manual_seed(12)
    m3 = embedding(tokens, W, Pw, positions, p=0.2, return_mask=True)[1]
    assert torch.equal(m1, m2) and not torch.equal(m1, m3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("always_add", [False, True])
@pytest.mark.parametrize("C", [63, 1024])
def test_embedding_backward_writes_the_tables_gradient_sink(dtype, always_add, C):
    """While the CUDA-graph step names a sink for the table (weight_grads.cpp), the backward writes the table's
    gradient there (overwriting the whole slice, or adding to it: the head's weight) and hands autograd none; two
    lookups of one table (shared embeddings) add up. Against the fp32 gold, within the tolerance of autograd's
    own sum of the two lookups' gradients (the sink rounds the sum once, autograd twice)."""
    from ls_fairseq import _ext

    mod = _ext.get()
    tokens, positions, W, Pw = _inputs(8, 45, 301, C, 50, seed=C)
    other = tokens.flip(0)
    g1, g2 = (torch.randn(8, 45, C, device="cuda") for _ in range(2))
    start = 0.5 if always_add else 0.0

    def grad_of(dt, sink=None):
        w = W.to(dt).requires_grad_(True)
        loss = sum((embedding(t, w, None, None, scale=C ** 0.5, p=0.0, padding_idx=PAD, zero_pad=True).float() * g)
                   .sum() for t, g in ((tokens, g1), (other, g2)))
        if sink is None:
            return torch.autograd.grad(loss, [w])[0] + start
        dest = torch.full_like(w, 0.5)  # overwritten whole, or added to
        if always_add:
            mod.set_weight_grad_sinks([], [], False)
            mod.add_weight_grad_sinks([w], [dest])
        else:
            mod.set_weight_grad_sinks([w], [dest], False)
        loss.backward()
        assert mod.take_weight_grad_sinks() == [w.data_ptr()]
        assert w.grad is None  # written into the sink, not handed to autograd
        return dest

    got, plain, gold = grad_of(dtype, sink=True), grad_of(dtype), grad_of(torch.float32)
    assert got.dtype == dtype
    assert_close_to_gold(got, plain, gold, dtype, "sink")
    if not always_add:
        assert torch.equal(got[PAD], torch.zeros_like(got[PAD]))  # rows no token reaches zeroed, not left at 0.5
