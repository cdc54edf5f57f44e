import pytest
import torch

from ls_fairseq.ops import adam_, grad_norm
from ls_fairseq.ops.adam import adam_reference_, join_master, split_master

pytestmark = pytest.mark.gpu

SIZES = [1, 1031, 1_000_003]
HP = dict(lr=1e-3, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_adam_torch_mode_matches_adamw(n, grad_dtype):
    torch.manual_seed(n)
    p0 = torch.randn(n, device="cuda")
    ref_p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref_p], lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"],
                            weight_decay=HP["weight_decay"], foreach=False)
    p, m, v = p0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    for step in range(1, 8):
        g = (torch.randn(n, device="cuda") * 0.1).to(grad_dtype)
        ref_p.grad = g.float() * 0.5
        opt.step()
        adam_(p, g, m, v, step=step, grad_scale=0.5, mode="torch", **HP)
    torch.testing.assert_close(p, ref_p.detach(), rtol=1e-5, atol=2e-6)
    st = opt.state[ref_p]
    torch.testing.assert_close(m, st["exp_avg"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("lp_dtype", [None, torch.float16, torch.bfloat16], ids=str)
def test_adam_fairseq_mode_matches_reference(n, lp_dtype):
    torch.manual_seed(n + 1)
    p0 = torch.randn(n, device="cuda")
    states = [(p0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"),
               None if lp_dtype is None else torch.empty(n, device="cuda", dtype=lp_dtype)) for _ in range(2)]
    for step in range(1, 8):
        g = torch.randn(n, device="cuda", dtype=torch.float16)
        for (p, m, v, lp), fn in zip(states, (adam_, adam_reference_)):
            fn(p, g, m, v, step=step, grad_scale=1 / 1024, param_lp=lp, mode="fairseq", **HP)
    (p, m, v, lp), (rp, rm, rv, rlp) = states
    torch.testing.assert_close(p, rp, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-12)
    if lp is not None:
        assert torch.equal(lp, p.to(lp_dtype))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_grad_norm(n, dtype):
    g = torch.randn(n, device="cuda").to(dtype)
    got = grad_norm(g)
    want = g.double().norm()
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() - want.item()) <= 1e-5 * want.item() + 1e-6
    assert torch.equal(grad_norm(g), got)  # deterministic


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_grad_is_detected_and_step_skipped(bad):
    n = 1031
    g = torch.randn(n, device="cuda", dtype=torch.float16)
    g[517] = bad
    norm = grad_norm(g)
    assert not torch.isfinite(norm).item()
    p = torch.randn(n, device="cuda")
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    lp = p.half()
    before = [t.clone() for t in (p, m, v, lp)]
    adam_(p, g, m, v, step=1, param_lp=lp, skip_if_nonfinite=norm, **HP)  # device-side skip
    for a, b in zip((p, m, v, lp), before):
        assert torch.equal(a, b)
    # a finite norm lets the step through
    g[517] = 0.0
    adam_(p, g, m, v, step=1, param_lp=lp, skip_if_nonfinite=grad_norm(g), **HP)
    assert not torch.equal(p, before[0])


def test_adam_rejects_bad_buffers():
    p = torch.randn(10, device="cuda")
    with pytest.raises(ValueError, match="elements"):
        adam_(p, torch.randn(9, device="cuda"), torch.zeros(10, device="cuda"), torch.zeros(10, device="cuda"),
              step=1, **HP)


@pytest.mark.parametrize("lp_dtype", [None, torch.float16], ids=str)
def test_device_grad_scale_matches_host_scale(lp_dtype):
    """grad_scale_tensor (read on the device) gives the same update as the same factor passed as a float."""
    n = 100_003
    torch.manual_seed(3)
    p0 = torch.randn(n, device="cuda")
    factor = torch.tensor(0.37, device="cuda")
    states = [(p0.clone(), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"),
               None if lp_dtype is None else torch.empty(n, device="cuda", dtype=lp_dtype)) for _ in range(3)]
    for step in range(1, 5):
        g = torch.randn(n, device="cuda", dtype=torch.float16)
        host = float(torch.tensor(1 / 512, dtype=torch.float32) * factor.cpu())
        p, m, v, lp = states[0]
        adam_(p, g, m, v, step=step, grad_scale=1 / 512, grad_scale_tensor=factor, param_lp=lp, **HP)
        p, m, v, lp = states[1]
        adam_(p, g, m, v, step=step, grad_scale=host, param_lp=lp, **HP)
        p, m, v, lp = states[2]
        adam_reference_(p, g, m, v, step=step, grad_scale=1 / 512, grad_scale_tensor=factor, param_lp=lp, **HP)
    (p, m, v, lp), (hp, hm, hv, hlp), (rp, rm, rv, rlp) = states
    for a, b in ((p, hp), (m, hm), (v, hv), (lp, hlp)):  # same kernel, same fp32 factor: bit for bit
        assert a is None or torch.equal(a, b)
    torch.testing.assert_close(p, rp, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(m, rm, rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-12)
    if lp is not None:
        assert torch.equal(lp, p.to(lp_dtype)) and torch.equal(rlp, rp.to(lp_dtype))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_nonfinite_device_grad_scale_skips_the_step(bad):
    n = 1031
    g = torch.randn(n, device="cuda", dtype=torch.float16)
    p = torch.randn(n, device="cuda")
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    lp = p.half()
    before = [t.clone() for t in (p, m, v, lp)]
    adam_(p, g, m, v, step=1, param_lp=lp, grad_scale_tensor=torch.tensor(bad, device="cuda"), **HP)
    for a, b in zip((p, m, v, lp), before):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="grad_scale_tensor"):
        adam_(p, g, m, v, step=1, grad_scale_tensor=torch.ones(2, device="cuda"), **HP)


@pytest.mark.parametrize("n", [1031, 1_000_003])
@pytest.mark.parametrize("lp_dtype", [None, torch.float16, torch.bfloat16], ids=str)
def test_peer_copy_receives_what_param_lp_receives(n, lp_dtype):
    """param_lp_peer gets the new weights in the same pass (here a plain buffer on the same GPU stands in
    for a peer's mapped weights; tests/gpu/test_multi_gpu.py runs the real peer mapping), unaligned too,
    and nothing when the step is skipped."""
    torch.manual_seed(n)
    want = lp_dtype or torch.float32
    for offset in (0, 1):  # offset 1: the peer range is not 16-byte aligned (the scalar loop)
        p = torch.randn(n, device="cuda")
        m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        lp = None if lp_dtype is None else torch.zeros(n, device="cuda", dtype=lp_dtype)
        peer = torch.zeros(n + offset, device="cuda", dtype=want)[offset:]
        g = torch.randn(n, device="cuda", dtype=torch.float16)
        adam_(p, g, m, v, step=1, param_lp=lp, param_lp_peer=peer, **HP)
        assert torch.equal(peer, p.to(want)) and (lp is None or torch.equal(peer, lp))
        before = peer.clone()
        inf = torch.tensor(float("inf"), device="cuda")
        adam_(p, g, m, v, step=2, param_lp=lp, param_lp_peer=peer, grad_scale_tensor=inf, **HP)
        assert torch.equal(peer, before)


def test_peer_copy_is_checked():
    p = torch.randn(64, device="cuda")
    m, v, g = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda"), torch.randn(64, device="cuda")
    lp = p.half()
    with pytest.raises(ValueError, match="param_lp_peer must be torch.float16"):
        adam_(p, g, m, v, step=1, param_lp=lp, param_lp_peer=torch.zeros(64, device="cuda"), **HP)
    with pytest.raises(ValueError, match="param_lp_peer has 63 elements"):
        adam_(p, g, m, v, step=1, param_lp=lp, param_lp_peer=torch.zeros(63, device="cuda").half(), **HP)
    with pytest.raises(ValueError, match="param_lp_peer must be torch.float32"):
        adam_(p, g, m, v, step=1, param_lp_peer=torch.zeros(64, device="cuda").half(), **HP)


def _ranges(n, count, seed):
    """`count` ascending, disjoint ranges of [0, n) with random (also unaligned) ends; every fifth one is
    empty (with more than 64 ranges, a launch's share then reaches past its first 64)."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(0, n + 1, (2 * count,), generator=gen).tolist())
    return [(cuts[2 * k], cuts[2 * k] if k % 5 == 4 else cuts[2 * k + 1]) for k in range(count)]


@pytest.mark.parametrize("count", [1, 12, 150])  # 150: more ranges than one launch takes
@pytest.mark.parametrize("lp_dtype", [None, torch.float16, torch.bfloat16], ids=str)
def test_adam_ranges_match_one_call_per_range(count, lp_dtype):
    """One launch over the owned ranges (sharded ls_adam) = the kernel run on each range alone, bit for bit,
    the peer copy included; the elements outside the ranges stay as they were."""
    n = 1_000_003
    torch.manual_seed(count)
    ranges = _ranges(n, count, seed=count)
    want = lp_dtype or torch.float32
    p0, m0, v0 = torch.randn(n, device="cuda"), torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
    g = torch.randn(n, device="cuda", dtype=torch.float16)
    a = [p0.clone(), m0.clone(), v0.clone(), torch.zeros(n, device="cuda", dtype=want),
         torch.zeros(n + 1, device="cuda", dtype=want)[1:]]  # the peer copy unaligned
    b = [t.clone() for t in a]
    lp = (lambda t: None if lp_dtype is None else t)
    adam_(a[0], g, a[1], a[2], step=3, grad_scale=0.5, param_lp=lp(a[3]), param_lp_peer=a[4], ranges=ranges, **HP)
    for lo, hi in ranges:
        if hi > lo:
            adam_(b[0][lo:hi], g[lo:hi], b[1][lo:hi], b[2][lo:hi], step=3, grad_scale=0.5,
                  param_lp=None if lp_dtype is None else b[3][lo:hi], param_lp_peer=b[4][lo:hi], **HP)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    inside = torch.zeros(n, dtype=torch.bool, device="cuda")
    for lo, hi in ranges:
        inside[lo:hi] = True
    assert torch.equal(a[0][~inside], p0[~inside]) and not torch.any(a[4][~inside] != 0)
    assert torch.equal(a[4][inside], a[0][inside].to(want))
    ref = [p0.clone(), m0.clone(), v0.clone()]
    adam_reference_(ref[0], g, ref[1], ref[2], step=3, grad_scale=0.5, ranges=ranges, **HP)
    torch.testing.assert_close(a[0], ref[0], rtol=1e-5, atol=2e-6)
    before = [t.clone() for t in a]
    adam_(a[0], g, a[1], a[2], step=4, param_lp=lp(a[3]), param_lp_peer=a[4], ranges=[], **HP)
    for x, y in zip(a, before):
        assert torch.equal(x, y)  # no range, no update (not the whole buffer)


@pytest.mark.parametrize("count", [1, 12, 150])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_grad_norm_of_ranges(count, dtype):
    n = 1_000_003
    g = torch.randn(n, device="cuda").to(dtype)
    ranges = _ranges(n, count, seed=100 + count)
    got = grad_norm(g, ranges=ranges)
    want = torch.cat([g[lo:hi] for lo, hi in ranges]).double().norm()
    assert abs(got.item() - want.item()) <= 1e-5 * want.item() + 1e-6
    assert torch.equal(grad_norm(g, ranges=ranges), got)  # deterministic
    assert grad_norm(g, ranges=[]).item() == 0.0


def test_the_kernel_entry_checks_ranges_itself():
    """The extension refuses bad ranges on its own (the Python checks sit in front of it)."""
    from ls_fairseq import _ext

    mod = _ext.get()
    g = torch.ones(64, device="cuda")
    with pytest.raises(RuntimeError, match="not inside the 64 elements"):
        mod.grad_norm(g, [0, 65])
    with pytest.raises(RuntimeError, match="ascending and disjoint"):
        mod.grad_norm(g, [8, 12, 0, 4])
    with pytest.raises(RuntimeError, match="pairs"):
        mod.grad_norm(g, [1, 2, 3])
    p, m, v = torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda"), torch.zeros(64, device="cuda")
    with pytest.raises(RuntimeError, match="not inside"):
        mod.adam_step(p, g, m, v, None, 1e-3, 0.9, 0.99, 1e-8, 0.0, 1, 1.0, False, None, None, None, [60, 70])
    assert torch.equal(p, torch.zeros(64, device="cuda"))


@pytest.mark.parametrize("count", [0, 1, 12, 150])  # 0: the whole buffer; 150: more ranges than one launch takes
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_norm_in_the_step_equals_grad_norm_and_changes_no_update(count, grad_dtype):
    """with_norm: the same update bit for bit (param, moments, low-precision copy), and the norm of the gradients as
    read (not scaled) within fp32 summation rounding of grad_norm's; repeatable."""
    n = 1_000_003
    torch.manual_seed(7 + count)
    ranges = _ranges(n, count, seed=200 + count) if count else None
    g = (torch.randn(n, device="cuda") * 3).to(grad_dtype)
    p0, m0, v0 = torch.randn(n, device="cuda"), torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
    a = [p0.clone(), m0.clone(), v0.clone(), torch.zeros(n, device="cuda", dtype=torch.bfloat16)]
    b = [t.clone() for t in a]
    scale = torch.tensor(0.25, device="cuda")
    norm = adam_(a[0], g, a[1], a[2], step=2, grad_scale=0.5, grad_scale_tensor=scale, param_lp=a[3],
                 ranges=ranges, with_norm=True, **HP)
    none = adam_(b[0], g, b[1], b[2], step=2, grad_scale=0.5, grad_scale_tensor=scale, param_lp=b[3], ranges=ranges,
                 **HP)
    assert none is None
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    want = grad_norm(g, ranges=ranges)
    assert norm.dtype == torch.float32 and norm.dim() == 0 and norm.device == g.device
    assert abs(norm.item() - want.item()) <= 1e-5 * want.item()
    again = adam_(b[0], g, b[1], b[2], step=2, grad_scale=0.5, grad_scale_tensor=scale, param_lp=b[3], ranges=ranges,
                  with_norm=True, **HP)
    assert torch.equal(again, norm)  # deterministic


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_norm_in_the_step_reports_a_nonfinite_gradient_and_a_skipped_scale(bad):
    """A non-finite gradient: the update is taken (the norm is known only after it) and the norm is not finite. A
    non-finite device factor still skips the update, and the norm is still summed."""
    n = 4099
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    g[1234] = bad
    p, m, v = torch.randn(n, device="cuda"), torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    norm = adam_(p, g, m, v, step=1, with_norm=True, **HP)
    assert not torch.isfinite(norm) and not torch.isfinite(p[1234])
    g[1234] = 2.0
    p0 = p.clone()
    p0[1234] = 0.0
    p.copy_(p0)
    m.zero_()
    v.zero_()
    norm = adam_(p, g, m, v, step=1, grad_scale_tensor=torch.tensor(bad, device="cuda"), with_norm=True, **HP)
    assert torch.equal(p, p0) and not m.any() and not v.any()
    assert abs(norm.item() - grad_norm(g).item()) <= 1e-5 * norm.item()
    with pytest.raises(ValueError, match="exclude each other"):
        adam_(p, g, m, v, step=1, skip_if_nonfinite=norm, with_norm=True, **HP)
    assert adam_(p, g, m, v, step=1, ranges=[], with_norm=True, **HP).item() == 0.0


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_adam_split_master_equals_the_fp32_master_bit_for_bit(n, grad_dtype, offset):
    """bf16 weights + int16 remainders (param_lo) updated by the fused kernel hold exactly the fp32 master the plain
    fused kernel computes from the same start, and the weights are that master split (ties away from zero); the
    peer copy receives the weights, and the norm summed in the pass is the plain kernel's."""
    torch.manual_seed(n + offset)
    p0 = torch.randn(n, device="cuda") * torch.exp(torch.randn(n, device="cuda") * 3)
    master = p0.clone()
    m, v = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
    w_full = torch.zeros(n + offset, device="cuda", dtype=torch.bfloat16)
    lo_full = torch.zeros(n + offset, device="cuda", dtype=torch.int16)
    w, lo = w_full[offset:], lo_full[offset:]
    split_master(p0, out=(w, lo))
    m2, v2 = m.clone(), v.clone()
    peer = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    for step in range(1, 6):
        g = (torch.randn(n, device="cuda") * 0.1).to(grad_dtype)
        n_plain = adam_(master, g, m, v, step=step, grad_scale=0.5, mode="fairseq", with_norm=True, **HP)
        n_split = adam_(w, g, m2, v2, step=step, grad_scale=0.5, mode="fairseq", with_norm=True, param_lo=lo,
                        param_lp_peer=peer, **HP)
        if offset == 0:  # both take the 4-wide path: the same sums in the same order
            assert torch.equal(n_plain, n_split)
        else:  # the unaligned remainders take the one-element path, which sums in another order
            torch.testing.assert_close(n_plain, n_split, rtol=1e-5, atol=0)
    assert torch.equal(join_master(w, lo).view(torch.int32), master.view(torch.int32))
    want_w, want_lo = split_master(master)
    assert torch.equal(w.view(torch.int16), want_w.view(torch.int16)) and torch.equal(lo, want_lo)
    assert torch.equal(peer.view(torch.int16), w.view(torch.int16))
    assert torch.equal(m, m2) and torch.equal(v, v2)
    # a non-finite device factor skips the step: nothing is written
    before = [t.clone() for t in (w, lo, m2, v2, peer)]
    adam_(w, g, m2, v2, step=6, param_lo=lo, param_lp_peer=peer, grad_scale_tensor=torch.tensor(float("inf"),
                                                                                             device="cuda"), **HP)
    for x, y in zip((w, lo, m2, v2, peer), before):
        assert torch.equal(x, y)


@pytest.mark.parametrize("count", [1, 150])
def test_adam_split_master_ranges_and_reference(count):
    """With ranges, the split kernel updates only them, as the reference (join, fp32 update, split) does; outside
    them nothing changes."""
    n = 1_000_003
    torch.manual_seed(count)
    ranges = _ranges(n, count, seed=count)
    w0, lo0 = split_master(torch.randn(n, device="cuda"))
    m0, v0 = torch.rand(n, device="cuda"), torch.rand(n, device="cuda")
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    a = [w0.clone(), lo0.clone(), m0.clone(), v0.clone()]
    b = [t.clone() for t in a]
    adam_(a[0], g, a[2], a[3], step=3, grad_scale=0.5, param_lo=a[1], ranges=ranges, **HP)
    adam_reference_(b[0], g, b[2], b[3], step=3, grad_scale=0.5, param_lo=b[1], ranges=ranges, **HP)
    torch.testing.assert_close(join_master(a[0], a[1]), join_master(b[0], b[1]), rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(a[2], b[2], rtol=1e-5, atol=1e-6)  # m0, v0 in [0, 1): fused multiply-adds differ
    torch.testing.assert_close(a[3], b[3], rtol=1e-5, atol=1e-6)
    inside = torch.zeros(n, dtype=torch.bool, device="cuda")
    for lo, hi in ranges:
        inside[lo:hi] = True
    assert torch.equal(a[0][~inside].view(torch.int16), w0[~inside].view(torch.int16))
    assert torch.equal(a[1][~inside], lo0[~inside]) and torch.equal(a[2][~inside], m0[~inside])
