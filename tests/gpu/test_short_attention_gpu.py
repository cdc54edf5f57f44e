"""The attention kernel for short sequences (csrc/kernels/attention.cu) against a float64 reference: forward and
the three gradients, masks (key padding, causal, both, rows with no key), layouts, dropout replayed from the
kernel's keep bits, the keep rate, seeds, and CUDA-graph replay."""

import math

import pytest
import torch

from ls_fairseq import _ext
from ls_fairseq.ops import attention, merge_heads
from tests.test_packing import _cu
from ._tols import assert_close_to_gold, keep_rate_ok

pytestmark = pytest.mark.gpu

LOWP = [torch.float16, torch.bfloat16]
# B, H, Tq, Tk, D
SHAPES = [(1, 1, 1, 1, 64), (3, 2, 17, 17, 64), (2, 3, 64, 64, 64), (2, 2, 5, 37, 128), (4, 16, 16, 16, 64),
          (2, 3, 1, 40, 64), (3, 2, 29, 13, 32), (1, 4, 48, 64, 128), (2, 2, 100, 128, 64), (1, 3, 128, 128, 64),
          (2, 2, 70, 90, 128), (2, 2, 97, 97, 32)]


def _mod():
    return _ext.get()


def _valid(B, Tq, Tk, attend, causal, device):
    """[B, 1, Tq, Tk] bool: key j is visible to query i."""
    valid = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=device)
    if attend is not None:
        valid = valid & attend.bool()[:, None, None, :]
    if causal:
        valid = valid & torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(Tk - Tq)
    return valid


def reference(q, k, v, attend, causal, keep=None, p=0.0):
    """softmax with masks (rows without a visible key: probabilities 0), dropout from keep bits, in q's dtype."""
    B, _, Tq, D = q.shape
    Tk = k.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(D)
    valid = _valid(B, Tq, Tk, attend, causal, q.device)
    s = s.masked_fill(~valid, float("-inf"))
    m = s.amax(-1, keepdim=True).detach()
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    P = e / e.sum(-1, keepdim=True).clamp_min(0.5)  # >= 1 where a key is visible, 0 where none is
    if keep is not None:
        P = P * keep.to(P.dtype) / (1.0 - p)
    return torch.matmul(P.to(v.dtype), v)


def unpack_keep(mask, B, H, Tq, Tk):
    rows = (Tk + 7) // 8
    bits = (mask.view(B, H, Tq, rows, 1).long() >> torch.arange(8, device=mask.device)) & 1
    return bits.view(B, H, Tq, rows * 8)[..., :Tk].bool()


def _inputs(shape, dtype, layout, seed=0):
    B, H, Tq, Tk, D = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    def make(T):
        x = torch.randn(B, T, H, D, device="cuda", generator=g).to(dtype)
        return x.transpose(1, 2) if layout == "token_major" else x.transpose(1, 2).contiguous()
    return make(Tq), make(Tk), make(Tk), torch.randn(B, H, Tq, D, device="cuda", generator=g).to(dtype)


def _attend(kind, B, Tk):
    if kind not in ("padding", "padding_causal"):
        return None
    attend = torch.ones(B, Tk, dtype=torch.bool, device="cuda")
    attend[0, : Tk // 3] = False  # left padding, as fairseq pads sources
    if B > 1:
        attend[-1, max(1, Tk - 2):] = False
    return attend


def _compare(shape, dtype, kind, layout, p):
    mod = _mod()
    B, H, Tq, Tk, D = shape
    q, k, v, dout = _inputs(shape, dtype, layout, seed=B * 7 + Tq + Tk + D)
    attend = _attend(kind, B, Tk)
    causal = kind in ("causal", "padding_causal")
    assert mod.short_attention_fits(q, k, v, attend)
    torch.manual_seed(5)
    out, lse, mask = mod.short_attention_fwd(q, k, v, attend, causal, p)
    assert out.shape == (B, H, Tq, D) and out.dtype == dtype and out.transpose(1, 2).is_contiguous()
    dq, dk, dv = mod.short_attention_bwd(dout, q, k, v, out, lse, mask, attend, causal, p)
    keep = unpack_keep(mask, B, H, Tq, Tk) if p > 0 else None
    _assert_matches_reference(out, (dq, dk, dv), q, k, v, dout, attend, causal, keep, p, "")
    return keep


def _assert_matches_reference(out, grads, q, k, v, dout, attend, causal, keep, p, what):
    """out and its gradients (dq, dk, dv) against the reference in float64, within twice the reference's own
    error in q's dtype (the tolerance rule of _tols.py)."""
    res = []
    for dt in (q.dtype, torch.float64):
        ins = [t.detach().to(dt).requires_grad_(True) for t in (q, k, v)]
        o = reference(*ins, attend, causal, keep, p)
        res.append((o, torch.autograd.grad(o, ins, dout.to(dt))))
    (lo, lg), (go, gg) = res
    assert_close_to_gold(out, lo, go, q.dtype, "out" + what)
    for name, a, l, g in zip(("dq", "dk", "dv"), grads, lg, gg):
        assert a.shape == g.shape
        assert_close_to_gold(a, l, g, q.dtype, name + what)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["none", "padding", "causal", "padding_causal"])
def test_matches_reference(dtype, shape, kind):
    _compare(shape, dtype, kind, "head_major", 0.0)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("shape", [(3, 2, 17, 17, 64), (2, 2, 5, 37, 128)], ids=str)
def test_token_major_inputs(dtype, shape):
    _compare(shape, dtype, "padding", "token_major", 0.0)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("shape", [(3, 2, 17, 17, 64), (2, 3, 64, 64, 64), (2, 2, 5, 37, 128), (2, 2, 120, 120, 64)],
                         ids=str)
@pytest.mark.parametrize("kind", ["padding", "causal"])
def test_dropout_replays_its_keep_bits(dtype, shape, kind):
    keep = _compare(shape, dtype, kind, "head_major", 0.1)
    assert keep is not None and not keep.all()


def test_keep_rate_and_seeds():
    mod = _mod()
    q, k, v, _ = _inputs((64, 16, 32, 32, 64), torch.bfloat16, "head_major")
    masks = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        masks.append(mod.short_attention_fwd(q, k, v, None, False, 0.25)[2])
    keep = unpack_keep(masks[0], 64, 16, 32, 32)
    assert keep_rate_ok(keep, 0.25)
    assert torch.equal(masks[0], masks[1]) and not torch.equal(masks[0], masks[2])


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_rows_without_keys_give_zeros(dtype):
    mod = _mod()
    B, H, T, D = 3, 2, 9, 64
    q, k, v, dout = _inputs((B, H, T, T, D), dtype, "head_major")
    attend = torch.ones(B, T, dtype=torch.bool, device="cuda")
    attend[1] = False  # a padded sentence of a shape bucket: no key at all
    out, lse, mask = mod.short_attention_fwd(q, k, v, attend, False, 0.0)
    dq, dk, dv = mod.short_attention_bwd(dout, q, k, v, out, lse, mask, attend, False, 0.0)
    for t in (out, dq, dk, dv):
        assert torch.isfinite(t.float()).all()
        assert t[1].abs().max().item() == 0.0
    assert out[0].abs().max().item() > 0


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_public_op_takes_the_kernel_and_falls_back(dtype):
    """ops.attention runs the kernel for short fp16 / bf16 sequences (token-major output: the merge is a view)
    and SDPA beyond its limits; both agree with the reference."""
    mod = _mod()
    for T, D, fits in ((20, 64, True), (64, 32, True), (100, 64, True), (129, 64, False), (20, 48, False)):
        q, k, v, dout = _inputs((2, 3, T, T, D), dtype, "head_major")
        kpm = torch.zeros(2, T, dtype=torch.bool, device="cuda")
        kpm[0, :3] = True
        assert mod.short_attention_fits(q, k, v, ~kpm) == fits
        ins = [t.detach().requires_grad_(True) for t in (q, k, v)]
        out = attention(*ins, key_padding_mask=kpm, causal=False, p=0.0)
        if fits:
            assert merge_heads(out).data_ptr() == out.data_ptr()
        grads = torch.autograd.grad(out, ins, dout)
        _assert_matches_reference(out, grads, q, k, v, dout, ~kpm, False, None, 0.0, f" T={T} D={D}")


def test_fits_refuses_what_the_kernel_cannot_take():
    mod = _mod()
    q = torch.randn(2, 2, 8, 64, device="cuda", dtype=torch.bfloat16)
    assert mod.short_attention_fits(q, q, q, None)
    assert not mod.short_attention_fits(q.float(), q.float(), q.float(), None)
    odd = torch.randn(2, 2, 8, 65, device="cuda", dtype=torch.bfloat16)[..., :64]  # rows not 16-byte aligned
    assert not mod.short_attention_fits(odd, odd, odd, None)
    assert not mod.short_attention_fits(q, q, q, torch.ones(2, 7, dtype=torch.bool, device="cuda"))
    with pytest.raises(RuntimeError, match="do not fit"):
        mod.short_attention_fwd(odd, odd, odd, None, False, 0.0)


def test_dropout_backward_matches_forward_under_graph_replay():
    """Captured forward + backward with dropout: each replay draws fresh keep bits, and the backward uses the
    forward's: out is linear in v, so sum(v * dv) equals sum(out * dout) for every replay."""
    mod = _mod()
    B, H, T, D = 8, 4, 24, 64
    q, k, v, dout = _inputs((B, H, T, T, D), torch.bfloat16, "head_major")
    attend = torch.ones(B, T, dtype=torch.bool, device="cuda")
    attend[2, :5] = False
    ins = [t.detach().requires_grad_(True) for t in (q, k, v)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            out = mod.ag_short_attention(*ins, attend, False, 0.2)
            grads = torch.autograd.grad(out, ins, dout)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod.ag_short_attention(*ins, attend, False, 0.2)
        grads = torch.autograd.grad(out, ins, dout)
    seen = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        lhs = (ins[2].double() * grads[2].double()).sum().item()
        rhs = (out.double() * dout.double()).sum().item()
        assert abs(lhs - rhs) <= 2e-2 * max(1.0, abs(rhs)), (lhs, rhs)
        seen.append(out.clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])


# ---------------------------------------------------------------- packed sequences
# (query lengths, key lengths, head dim); zero-length sequences stand for the empty sentences of a packed bucket
PACKED = [([37, 1, 64, 5, 120], [37, 1, 64, 5, 120], 64), ([17, 0, 128, 9], [17, 0, 128, 9], 32),
          ([3, 40, 16], [20, 7, 33], 128), ([1], [1], 64), ([70, 0], [90, 13], 64)]


def _packed_inputs(lq, lk, H, D, dtype, seed):
    """Packed [1, H, N, D] q, k, v, dout (token-major storage, as the layers make them) and the offsets."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    def make(n):
        return torch.randn(1, n, H, D, device="cuda", generator=g).to(dtype).transpose(1, 2)
    return make(sum(lq)), make(sum(lk)), make(sum(lk)), make(sum(lq)), _cu(lq).cuda(), _cu(lk).cuda()


def _pad(x, lengths, T):
    """Packed [1, H, N, D] rows -> padded [B, H, T, D] (zeros beyond each length)."""
    out = x.new_zeros(len(lengths), x.shape[1], T, x.shape[3])
    o = 0
    for b, n in enumerate(lengths):
        out[b, :, :n] = x[0, :, o:o + n]
        o += n
    return out


def _unpad(x, lengths):
    return torch.cat([x[b:b + 1, :, :n] for b, n in enumerate(lengths)], dim=2)


@pytest.mark.parametrize("dtype", LOWP, ids=str)
@pytest.mark.parametrize("case", PACKED, ids=str)
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_packed_equals_the_padded_kernel(dtype, case, p):
    """Over packed sequences the kernel computes, row for row and bit for bit, what it computes over the same
    sequences padded to the longest with their keys masked (the same keep bits with the same seed): the padded
    kernel is the one checked against float64 above. Causal where the lengths are equal (self-attention)."""
    mod = _mod()
    lq, lk, D = case
    H, Tq, Tk = 3, max(lq), max(lk)
    causal = lq == lk
    q, k, v, dout, cu_q, cu_k = _packed_inputs(lq, lk, H, D, dtype, seed=len(lq) + D)
    packed = dict(cu_q=cu_q, cu_k=cu_k, max_q=Tq, max_k=Tk)
    assert mod.short_attention_fits(q, k, v, None, **packed)
    torch.manual_seed(3)
    out, lse, mask = mod.short_attention_fwd(q, k, v, None, causal, p, **packed)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    dq, dk, dv = mod.short_attention_bwd(dout, q, k, v, out, lse, mask, None, causal, p, **packed)
    attend = torch.arange(Tk, device="cuda")[None, :] < torch.tensor(lk, device="cuda")[:, None]
    pq, pk, pv, pdo = _pad(q, lq, Tq), _pad(k, lk, Tk), _pad(v, lk, Tk), _pad(dout, lq, Tq)
    torch.manual_seed(3)
    ref_out, ref_lse, ref_mask = mod.short_attention_fwd(pq, pk, pv, attend, causal, p)
    ref = mod.short_attention_bwd(pdo, pq, pk, pv, ref_out, ref_lse, ref_mask, attend, causal, p)
    assert torch.equal(out, _unpad(ref_out, lq))
    for name, got, want, lengths in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, (lq, lk, lk)):
        assert torch.equal(got, _unpad(want, lengths)), name
    if p > 0:  # the padded rows of the keep bits are the same draws
        keep, ref_keep = unpack_keep(mask, len(lq), H, Tq, Tk), unpack_keep(ref_mask, len(lq), H, Tq, Tk)
        for b, n in enumerate(lq):
            assert torch.equal(keep[b, :, :n, :lk[b]], ref_keep[b, :, :n, :lk[b]])


@pytest.mark.parametrize("dtype", LOWP, ids=str)
def test_packed_through_the_public_op_and_autograd(dtype):
    """ops.attention with varlen takes the kernel for packed sequences up to 128 tokens (flash beyond) and the
    result, with its gradients, matches attention per sequence in float64."""
    from ls_fairseq.ops.attention import Varlen

    lq = [37, 1, 64, 5, 120]
    H, D = 4, 64
    q, k, v, dout, cu, _ = _packed_inputs(lq, lq, H, D, dtype, seed=11)
    ins = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = attention(*ins, causal=True, varlen=Varlen(cu, cu, max(lq), max(lq)))
    assert merge_heads(out).data_ptr() == out.data_ptr()  # token-major: the kernel's output
    grads = torch.autograd.grad(out, ins, dout)
    o = 0
    for n in lq:
        sl = slice(o, o + n)
        o += n
        part = [t[:, :, sl] for t in (q, k, v)]
        _assert_matches_reference(out[:, :, sl], [g[:, :, sl] for g in grads], *part, dout[:, :, sl], None, True,
                                  None, 0.0, f" len={n}")


def test_packed_fits_refuses_what_the_kernel_cannot_take():
    mod = _mod()
    q, k, v, _, cu, _ = _packed_inputs([5, 9], [5, 9], 2, 64, torch.bfloat16, seed=1)
    assert mod.short_attention_fits(q, k, v, None, cu_q=cu, cu_k=cu, max_q=9, max_k=9)
    assert not mod.short_attention_fits(q, k, v, None, cu_q=cu, cu_k=cu, max_q=129, max_k=9)  # too long
    assert not mod.short_attention_fits(q, k, v, None, cu_q=cu.long(), cu_k=cu.long(), max_q=9, max_k=9)
    assert not mod.short_attention_fits(q, k, v, None, cu_q=cu, cu_k=cu[:2], max_q=9, max_k=9)
    assert not mod.short_attention_fits(q, k, v, torch.ones(1, 14, dtype=torch.bool, device="cuda"), cu_q=cu,
                                        cu_k=cu, max_q=9, max_k=9)
    with pytest.raises(RuntimeError, match="both cu_q and cu_k"):
        mod.short_attention_fits(q, k, v, None, cu_q=cu)
