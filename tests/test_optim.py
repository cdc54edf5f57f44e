"""ls_adam against fairseq's adam: plain, through the FairseqOptimizer wrapper, under
fairseq's FP16Optimizer and MemoryEfficientFP16Optimizer, across a state-dict round trip.

CPU notes. fairseq's flat FP16Optimizer places its fp32 copy on
``torch.cuda.current_device()``; on a machine without CUDA the test patches that call to
return ``None`` (the ``device.index`` of CPU tensors), which runs fairseq's own flattening
code on CPU unchanged. fp16 / bf16 parameters live on CPU: the toy loss upcasts them.
"""

import copy
import io

import pytest
import torch
from omegaconf import OmegaConf

import ls_fairseq.fairseq_ext  # noqa: F401  (registers ls_adam)
from fairseq import optim
from fairseq.optim.adam import Adam as FairseqAdamImpl
from fairseq.optim.fp16_optimizer import FP16Optimizer, MemoryEfficientFP16Optimizer

from ls_fairseq.ops.adam import adam_reference_
from ls_fairseq.optim import FlatWorkspace, LSAdam

SHAPES = [(1,), (7, 3), (1031,), (13, 17)]
STEPS = 7


def make_params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def clone_params(params, dtype=None):
    return [torch.nn.Parameter(p.detach().clone().to(dtype or p.dtype)) for p in params]


def grads_for(step, scale=1.0, seed=100):
    g = torch.Generator().manual_seed(seed + step)
    return [torch.randn(s, generator=g) * scale * (1 + i) for i, s in enumerate(SHAPES)]


def backward(params, grads, loss_scale=1.0):
    """Gradients of sum(p * g) through autograd (so .grad is filled the way a model fills it)."""
    loss = sum((p.float() * g).sum() for p, g in zip(params, grads))
    (loss * loss_scale).backward()


def make_cfg(name="ls_adam", betas="(0.9, 0.98)", eps=1e-8, wd=0.01, lr=3e-3, bf16=False,
             no_flatten=False, init_scale=128.0):
    return OmegaConf.create({
        "optimizer": {"_name": name, "adam_betas": betas, "adam_eps": eps, "weight_decay": wd, "lr": [lr]},
        "common": {
            "fp16_scale_window": None, "fp16_init_scale": init_scale, "fp16_scale_tolerance": 0.0,
            "threshold_loss_scale": None, "min_loss_scale": 1e-4, "bf16": bf16,
            "fp16_no_flatten_grads": no_flatten, "model_parallel_size": 1, "tpu": False,
        },
        "optimization": {"update_freq": [1], "lr": [lr]},
        "distributed_training": {"distributed_world_size": 1},
    })


def assert_params_close(a, b, rtol=1e-6, atol=1e-7):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach().float(), y.detach().float(), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- core update
@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_lsadam_matches_fairseq_adam(wd):
    ours, theirs = make_params(), make_params()
    a = LSAdam(ours, lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=wd)
    b = FairseqAdamImpl(theirs, lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=wd)
    for t in range(STEPS):
        a.zero_grad()
        b.zero_grad()
        gs = grads_for(t)
        backward(ours, gs)
        backward(theirs, gs)
        a.step()
        b.step()
        assert_params_close(ours, theirs)
    # the parameters moved, and moved differently from the start
    assert not torch.allclose(ours[2], make_params()[2])


def test_lsadam_torch_mode_matches_adamw():
    ours, theirs = make_params(), make_params()
    a = LSAdam(ours, lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1, mode="torch")
    b = torch.optim.AdamW(theirs, lr=1e-2, betas=(0.8, 0.95), eps=1e-8, weight_decay=0.1)
    for t in range(STEPS):
        a.zero_grad()
        b.zero_grad()
        gs = grads_for(t)
        backward(ours, gs)
        backward(theirs, gs)
        a.step()
        b.step()
    assert_params_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_workspace_views_ties_and_zero_grad():
    w = torch.nn.Parameter(torch.randn(5, 3))
    b = torch.nn.Parameter(torch.randn(3))
    h = torch.nn.Parameter(torch.randn(4, 2).half())
    ws = FlatWorkspace([w, b, w, h])  # w tied: appears once
    assert ws.params == [w, b, h] and ws.numel == 15 + 3 + 8
    assert [buf.dtype for buf in ws.buffers] == [torch.float32, torch.float16]
    f32, f16 = ws.buffers
    assert f32.master is f32.param and f16.master.dtype == torch.float32 and f16.param_lp is f16.param
    for buf in ws.buffers:
        for i, p in enumerate(buf.params):
            assert p.data.data_ptr() == buf.slice(buf.param, i).data_ptr()
            assert p.grad.data_ptr() == buf.slice(buf.grad, i).data_ptr()
            assert (p.data_ptr() - buf.param.data_ptr()) % 256 == 0  # aligned starts
    (w.sum() * 2 + b.sum() + h.float().sum()).backward()
    assert f32.grad.abs().sum() == 2 * 15 + 3 and f16.grad.float().sum() == 8
    ws.zero_grad()
    assert w.grad is None and b.grad is None and h.grad is None
    # the next backward hands over fresh tensors (no accumulation into the views) ...
    (w.sum() * 3).backward()
    assert w.grad.data_ptr() != f32.grad.data_ptr() and b.grad is None
    # ... and sync copies them in, zeroing the slices of parameters that got no gradient
    assert ws.sync() == 3
    assert w.grad.data_ptr() == f32.grad.data_ptr() and b.grad.data_ptr() == f32.slice(f32.grad, 1).data_ptr()
    assert torch.equal(w.grad, torch.full((5, 3), 3.0)) and b.grad.abs().sum() == 0
    assert f16.grad.abs().sum() == 0 and h.grad.data_ptr() == f16.grad.data_ptr()
    # accumulation across backwards without zero_grad still adds into the views
    (w.sum()).backward()
    assert torch.equal(w.grad, torch.full((5, 3), 4.0)) and w.grad.data_ptr() == f32.grad.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("seed", range(6))
def test_workspace_sync_fast_path_equals_the_per_parameter_pass(dtype, seed):
    """sync's list-wide fast path leaves the same buffers, views and repair count as the pass that
    looks at each parameter, whatever mix of states the parameters are in; states it does not
    handle (replaced weights, writes from outside) fall back to that pass."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (0,), (7,), (2, 2, 2), (5,), (1,)]

    def fresh():
        ps = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype))
              for i, s in enumerate(shapes)]
        return ps, FlatWorkspace(ps)

    states = []
    for (a_ps, a_ws), (b_ps, b_ws) in [(fresh(), fresh())]:
        for _ in range(4):  # a few rounds: the fast path must also leave a state the next call reads
            kinds = torch.randint(0, 5, (len(shapes),), generator=gen).tolist()
            for ps in (a_ps, b_ps):
                for i, (p, k) in enumerate(zip(ps, kinds)):
                    g = torch.full(shapes[i], float(k + 1), dtype=dtype)
                    if k == 0:
                        p.grad = None
                    elif k == 1:
                        p.grad = g  # a fresh tensor, as autograd hands over after zero_grad
                    elif k == 2 and p.grad is not None:
                        p.grad.add_(1)  # accumulated into whatever it is
                    elif k == 3 and seed % 3 == 0 and p.numel() > 0:
                        p.data = p.data.clone() * 2  # replaced weights: per-parameter pass
                    elif k == 4 and seed % 3 == 1 and p.numel() > 0:
                        with torch.no_grad():
                            p.add_(1)  # written in place from outside: per-parameter pass
            fast = a_ws.sync()
            slow = sum(buf._sync_each(True) for buf in b_ws.buffers)
            assert fast == slow
            for pa, pb in zip(a_ps, b_ps):
                torch.testing.assert_close(pa.data, pb.data, rtol=0, atol=0)
                torch.testing.assert_close(pa.grad, pb.grad, rtol=0, atol=0)
            for ba, bb in zip(a_ws.buffers, b_ws.buffers):
                for name in ("param", "grad", "master"):
                    torch.testing.assert_close(getattr(ba, name), getattr(bb, name), rtol=0, atol=0)
                for i, p in enumerate(ba.params):
                    if p.numel():
                        assert p.grad.data_ptr() == ba.slice(ba.grad, i).data_ptr()
                        assert p.data_ptr() == ba.slice(ba.param, i).data_ptr()
            states.append(fast)
    assert any(states)  # something was repaired


def test_workspace_sync_fast_path_is_taken_for_fresh_and_viewed_gradients():
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    ws = FlatWorkspace(ps)
    buf = ws.buffers[0]
    ws.zero_grad()
    (ps[0].sum() * 2).backward()  # ps[1] gets no gradient
    assert buf._sync_fast(True) == 2
    assert torch.equal(ps[0].grad, torch.full((4, 3), 2.0)) and ps[1].grad.abs().sum() == 0
    assert buf._sync_fast(True) == 0  # every gradient is now its view
    ps[0].data = ps[0].data.clone()
    assert buf._sync_fast(True) is None  # a replaced weight needs the per-parameter pass
    assert ws.sync() == 1 and buf._sync_fast(True) == 0


@pytest.mark.parametrize("state", ["fresh", "none", "mixed", "views", "fresh_and_views"])
def test_workspace_adopt_grads_fast_path_equals_the_general_path(state):
    """adopt_grads of fresh gradients (list-wide) leaves what the per-parameter path leaves; other
    states take the per-parameter path unchanged."""
    shapes = [(3, 4), (0,), (7,), (5,)]

    def setup():
        ps = [torch.nn.Parameter(torch.full(s, float(i + 1))) for i, s in enumerate(shapes)]
        ws = FlatWorkspace(ps)
        for i, p in enumerate(ps):
            if state == "fresh" or (state == "mixed" and i % 2 == 0) or (state == "fresh_and_views" and i < 2):
                p.grad = torch.full(shapes[i], 10.0 + i)
            elif state in ("none", "mixed"):
                p.grad = None
            else:  # already its view, holding a value
                p.grad.fill_(20.0 + i)
        return ps, ws.buffers[0]

    (pa, ba), (pb, bb) = setup(), setup()
    members = [2, 1, 0, 3]
    ba.adopt_grads(members)
    pending = ([], [], [])
    for i in members:
        bb._adopt_grad(i, pending)
    bb._write(pending)
    torch.testing.assert_close(ba.grad, bb.grad, rtol=0, atol=0)
    for i, (a, b) in enumerate(zip(pa, pb)):
        assert a.grad.data_ptr() == ba.slice(ba.grad, i).data_ptr()
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    assert ba._adopt_fresh(members) is False  # now every gradient is its view


def test_workspace_repairs_broken_views():
    ours, theirs = make_params(torch.float16), make_params(torch.float16)
    opt = LSAdam(ours, lr=1e-2)
    ref_master = [p.detach().float().clone() for p in theirs]
    buf = opt.workspaces[0].buffers[0]
    gs = grads_for(0)
    # (1) .grad set to None: autograd then installs a fresh tensor outside the flat buffer
    ours[1].grad = None
    backward(ours, gs)
    assert ours[1].grad.data_ptr() != buf.slice(buf.grad, 1).data_ptr()
    # (2) .grad replaced by hand with a new tensor
    ours[3].grad = ours[3].grad.clone()
    # (3) .data replaced (e.g. by .to()): the new values are taken over
    new0 = torch.full((1,), 0.5, dtype=torch.float16)
    ours[0].data = new0.clone()
    ref_master[0].fill_(0.5)
    opt.step()
    st = [torch.zeros_like(m) for m in ref_master]
    for m, g, ea, eas in zip(ref_master, [g.half() for g in gs], st, [torch.zeros_like(m) for m in ref_master]):
        adam_reference_(m.view(-1), g.view(-1), ea.view(-1), eas.view(-1), lr=1e-2, beta1=0.9, beta2=0.999,
                        eps=1e-8, weight_decay=0.0, step=1)
    for i, p in enumerate(ours):
        assert p.grad.data_ptr() == buf.slice(buf.grad, i).data_ptr(), "view re-attached"
        assert p.data_ptr() == buf.slice(buf.param, i).data_ptr()
        torch.testing.assert_close(buf.slice(buf.master, i), ref_master[i], rtol=0, atol=0)
        torch.testing.assert_close(p.data, ref_master[i].half(), rtol=0, atol=0)
    # (4) an in-place write from outside (Module.load_state_dict) refreshes the fp32 master
    with torch.no_grad():
        ours[2].copy_(torch.ones(1031))
    opt.zero_grad()
    opt.step()  # zero grad: only the momentum moves the weights
    assert (buf.slice(buf.master, 2) - 1).abs().max() < 0.05


def test_grad_norm_multiply_and_clip_are_folded():
    ours, theirs = make_params(), make_params()
    a = LSAdam(ours, lr=1e-2, weight_decay=0.01)
    b = FairseqAdamImpl(theirs, lr=1e-2, weight_decay=0.01)
    gs = grads_for(0, scale=10.0)
    backward(ours, gs)
    backward(theirs, gs)
    raw = torch.cat([g.reshape(-1) for g in gs]).norm()
    torch.testing.assert_close(a.grad_norm(), raw)
    a.multiply_grads(0.25)
    assert ours[0].grad.item() == gs[0].item(), "multiply is deferred, not applied to the buffer"
    for p in theirs:
        p.grad.mul_(0.25)
    from fairseq import utils
    n_ours = a.clip_grad_norm(1.0)
    n_theirs = utils.clip_grad_norm_(theirs, 1.0)
    torch.testing.assert_close(n_ours, n_theirs, rtol=1e-6, atol=0)
    a.step()
    b.step()
    assert_params_close(ours, theirs)


def test_step_with_norm_returns_grad_norm_and_takes_the_same_step():
    """step(with_norm=True): the norm grad_norm() gives with no factor pending (the factor is the step's own), over
    parameters in two groups (several flat buffers), and the same update as step()."""
    ours, theirs = make_params(), make_params()
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.0}]  # noqa: E731
    a = LSAdam(groups(ours), lr=1e-2, weight_decay=0.01)
    b = LSAdam(groups(theirs), lr=1e-2, weight_decay=0.01)
    for step in range(3):
        gs = grads_for(step, scale=5.0)
        for opt, ps in ((a, ours), (b, theirs)):
            opt.zero_grad()
            backward(ps, gs)
        want = b.grad_norm()
        a.multiply_grads(0.5)
        b.multiply_grads(0.5)
        got = a.step(with_norm=True)
        b.step()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(got, torch.cat([g.reshape(-1) for g in gs]).norm(), rtol=1e-6, atol=0)
        for x, y in zip(ours, theirs):
            assert torch.equal(x, y)
    assert a.step() is None  # without with_norm: the closure's loss, as torch optimizers return


# ----------------------------------------------------------------- fairseq wrappers
def run_wrapped(opt, params, steps, loss_scale_fn=lambda: 1.0, clip=0.5, update_freq=1, start=0):
    norms = []
    for t in range(start, start + steps):
        opt.zero_grad()
        for k in range(update_freq):
            gs = grads_for(10 * t + k, scale=3.0)
            opt.backward(sum((p.float() * g).sum() for p, g in zip(params, gs)))
        opt.multiply_grads(1.0 / (update_freq * 4.0))  # the trainer's 1 / sample_size
        norms.append(float(opt.clip_grad_norm(clip)))
        opt.step()
    return norms


@pytest.mark.parametrize("update_freq", [1, 3])
def test_fairseq_wrapper_fp32_matches_adam(update_freq):
    ours, theirs = make_params(), make_params()
    a = optim.build_optimizer(make_cfg("ls_adam").optimizer, ours)
    b = optim.build_optimizer(make_cfg("adam").optimizer, theirs)
    assert type(a).__name__ == "LSFairseqAdam" and a.get_lr() == 3e-3
    assert a.supports_flat_params and a.supports_memory_efficient_fp16 and a.supports_step_with_scale
    na = run_wrapped(a, ours, STEPS, update_freq=update_freq)
    nb = run_wrapped(b, theirs, STEPS, update_freq=update_freq)
    assert max(na) > 0.5, "clipping was active"
    torch.testing.assert_close(torch.tensor(na), torch.tensor(nb), rtol=1e-6, atol=0)
    assert_params_close(ours, theirs, rtol=2e-6, atol=1e-7)


@pytest.fixture
def cpu_flat_fp16(monkeypatch):
    # fairseq's flat FP16Optimizer asks torch.cuda for the device of its fp32 copy (see module docstring)
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: None)


def build_fp16(name, params, no_flatten=False):
    cfg = make_cfg(name, no_flatten=no_flatten)
    return FP16Optimizer.build_optimizer(cfg, params)


@pytest.mark.parametrize("no_flatten", [False, True])
def test_fp16_optimizer_matches_adam(cpu_flat_fp16, no_flatten):
    ours, theirs = make_params(torch.float16), make_params(torch.float16)
    a = build_fp16("ls_adam", ours, no_flatten)
    b = build_fp16("adam", theirs, no_flatten)
    assert a.has_flat_params == (not no_flatten)
    na = run_wrapped(a, ours, STEPS)
    nb = run_wrapped(b, theirs, STEPS)
    torch.testing.assert_close(torch.tensor(na), torch.tensor(nb), rtol=1e-5, atol=0)
    ma = a.fp32_params if no_flatten else [a.fp32_params[None]]
    mb = b.fp32_params if no_flatten else [b.fp32_params[None]]
    assert_params_close(ma, mb, rtol=2e-6, atol=1e-7)
    assert_params_close(ours, theirs, rtol=1e-3, atol=0)  # fp16 copies: at most one rounding apart


def test_memory_efficient_fp16_matches_fp32_master_training(cpu_flat_fp16):
    # fairseq's FP16Optimizer + adam keeps fp32 masters; ls_adam under the memory-efficient
    # wrapper must keep its own and therefore produce the same trajectory.
    ours, theirs = make_params(torch.float16), make_params(torch.float16)
    a = MemoryEfficientFP16Optimizer.build_optimizer(make_cfg("ls_adam"), ours)
    b = build_fp16("adam", theirs)
    na = run_wrapped(a, ours, STEPS)
    nb = run_wrapped(b, theirs, STEPS)
    torch.testing.assert_close(torch.tensor(na), torch.tensor(nb), rtol=1e-5, atol=0)
    buf = a.optimizer.workspaces[0].buffers[0]
    master = [buf.slice(buf.master, i) for i in range(len(ours))]
    flat = b.fp32_params[None].data
    offs = torch.tensor([0] + [p.numel() for p in theirs]).cumsum(0)
    assert_params_close(master, [flat[offs[i]:offs[i + 1]].view(theirs[i].shape) for i in range(len(ours))], rtol=2e-6, atol=1e-7)
    assert_params_close(ours, theirs, rtol=1e-3, atol=0)


@pytest.mark.parametrize("wrapper", ["fp16", "memory_efficient"])
def test_overflow_skips_step_and_lowers_scale(cpu_flat_fp16, wrapper):
    params = make_params(torch.float16)
    if wrapper == "fp16":
        opt = build_fp16("ls_adam", params)
    else:
        opt = MemoryEfficientFP16Optimizer.build_optimizer(make_cfg("ls_adam"), params)
    run_wrapped(opt, params, 2)
    before = [p.detach().clone() for p in params]
    scale = opt.scaler.loss_scale
    opt.zero_grad()
    gs = grads_for(0)
    gs[2][5] = 1e6  # x loss scale 128 overflows fp16
    opt.backward(sum((p.float() * g).sum() for p, g in zip(params, gs)))
    with pytest.raises(OverflowError):
        norm = opt.clip_grad_norm(0.0)
        assert not torch.isfinite(torch.as_tensor(norm))
        opt.scaler.check_overflow(float(norm))
    assert opt.scaler.loss_scale == scale / 2
    # the trainer skips the step and zeroes the grads; training then goes on normally
    opt.zero_grad()
    assert all(torch.equal(p, q) for p, q in zip(params, before))
    run_wrapped(opt, params, 1, start=5)
    assert all(torch.isfinite(p).all() for p in params)
    assert not torch.equal(params[2], before[2])


def test_memory_efficient_bf16_keeps_fp32_master(cpu_flat_fp16):
    ours = make_params(torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    a = MemoryEfficientFP16Optimizer.build_optimizer(make_cfg("ls_adam", bf16=True), ours)
    assert a.scaler is None
    b = optim.build_optimizer(make_cfg("adam").optimizer, ref)
    for t in range(STEPS):
        for opt, ps in ((a, ours), (b, ref)):
            opt.zero_grad()
            gs = [g.bfloat16().float() for g in grads_for(t)]  # grads bf16-representable
            opt.backward(sum((p.float() * g).sum() for p, g in zip(ps, gs)))
            opt.step()
    buf = a.optimizer.workspaces[0].buffers[0]
    assert buf.dtype == torch.bfloat16 and buf.has_separate_master
    # the master is full precision: it tracks the fp32 run, unlike the bf16 copy alone would
    assert_params_close([buf.slice(buf.master, i) for i in range(4)], ref, rtol=1e-5, atol=1e-6)
    assert_params_close(ours, ref, rtol=8e-3, atol=0)


# ---------------------------------------------------------------------- state dict
def roundtrip(obj):
    f = io.BytesIO()
    torch.save(obj, f)
    f.seek(0)
    return torch.load(f, weights_only=False)


@pytest.mark.parametrize("mode", ["fp32", "fp16", "memory_efficient", "memory_efficient_bf16"])
def test_state_dict_resume_is_exact(cpu_flat_fp16, mode):
    dtype = {"fp32": torch.float32, "memory_efficient_bf16": torch.bfloat16}.get(mode, torch.float16)

    def build(params):
        if mode == "fp32":
            return optim.build_optimizer(make_cfg("ls_adam").optimizer, params)
        if mode == "fp16":
            return build_fp16("ls_adam", params)
        return MemoryEfficientFP16Optimizer.build_optimizer(make_cfg("ls_adam", bf16=dtype == torch.bfloat16), params)

    params = make_params(dtype)
    opt = build(params)
    run_wrapped(opt, params, 3)
    # a checkpoint: model weights (as saved) + optimizer state, through torch.save
    ckpt = roundtrip({"model": [p.detach().clone() for p in params], "opt": opt.state_dict()})
    run_wrapped(opt, params, 4, start=3)

    resumed = [torch.nn.Parameter(w.clone()) for w in ckpt["model"]]
    opt2 = build(resumed)
    opt2.load_state_dict(ckpt["opt"], {})
    for k, entry in opt2.state_dict()["state"].items():
        for key, v in entry.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(ckpt["opt"]["state"][k][key])), key
    run_wrapped(opt2, resumed, 4, start=3)
    if mode == "fp16":
        # fairseq's FP16Optimizer rebuilds its fp32 copy from the fp16 weights on resume (its
        # checkpoints carry no master), so the continuation agrees only to fp16 rounding there.
        assert_params_close(params, resumed, rtol=2e-3, atol=1e-4)
    else:
        for p, q in zip(params, resumed):
            assert torch.equal(p, q)
    if mode.startswith("memory_efficient"):
        assert all("master" in s and s["master"].dtype == torch.float32 for s in ckpt["opt"]["state"].values())
        b1, b2 = opt.optimizer.workspaces[0].buffers[0], opt2.optimizer.workspaces[0].buffers[0]
        assert torch.equal(b1.master, b2.master)
        assert b1.split == (mode == "memory_efficient_bf16")


def test_load_state_dict_applies_lr_override_and_checks_shapes():
    params = make_params()
    opt = optim.build_optimizer(make_cfg("ls_adam", lr=1e-3).optimizer, params)
    run_wrapped(opt, params, 2)
    sd = copy.deepcopy(opt.state_dict())
    opt2 = optim.build_optimizer(make_cfg("ls_adam", lr=1e-3).optimizer, make_params())
    opt2.load_state_dict(sd, {"lr": 0.25})
    assert opt2.get_lr() == 0.25
    other = optim.build_optimizer(make_cfg("ls_adam").optimizer, make_params()[:3])
    with pytest.raises(ValueError, match="has 4 parameters, this optimizer has 3"):
        other.load_state_dict(sd)
    sd["state"][2]["exp_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match="exp_avg' of parameter 2 has 5 elements"):
        opt2.load_state_dict(sd)


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("betas,msg", [
    ("(0.9", "--adam-betas must be two numbers"),
    ("(0.9, 0.98, 0.99)", "--adam-betas must be two numbers"),
    ("(0.9, 1.5)", "beta2 must be in"),
    ("(a, b)", "--adam-betas must be two numbers"),
])
def test_bad_betas_are_clear_errors(betas, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        optim.build_optimizer(make_cfg("ls_adam", betas=betas).optimizer, make_params())


def test_betas_accept_fairseq_spellings():
    from ls_fairseq.fairseq_ext.optimizer import parse_betas

    assert parse_betas("(0.9, 0.98)") == parse_betas("0.9,0.98") == parse_betas([0.9, 0.98]) == (0.9, 0.98)


def test_bad_hyperparams_and_params():
    with pytest.raises(ValueError, match="eps must be >= 0"):
        LSAdam(make_params(), eps=-1.0)
    with pytest.raises(ValueError, match="mode must be one of"):
        LSAdam(make_params(), mode="adamax")
    with pytest.raises(TypeError, match="dtype torch.int64 is not supported"):
        FlatWorkspace([torch.zeros(3, dtype=torch.long)])
    with pytest.raises(ValueError, match="empty parameter list"):
        FlatWorkspace([])


def test_split_master_is_exact_and_rounds_to_nearest():
    """A bf16 master split into (weights, int16 remainders) joins back bit for bit; the weights are the master
    rounded to nearest, differing from round-to-nearest-even only at exact ties (which go away from zero)."""
    from ls_fairseq.ops.adam import join_master, split_master

    torch.manual_seed(0)
    x = torch.randn(200_000) * torch.exp(torch.randn(200_000) * 8)
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40, 3.3e38, -3.3e38, float("inf"), float("-inf")])
    ties = (torch.randint(0, 1 << 15, (500,), dtype=torch.int32) * 65536 + 0x8000).view(torch.float32)
    x = torch.cat([x, specials, ties, -ties])
    w, lo = split_master(x)
    assert w.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(join_master(w, lo).view(torch.int32), x.view(torch.int32))
    rne = x.to(torch.bfloat16)
    differs = w.view(torch.int16) != rne.view(torch.int16)
    low = x.view(torch.int32) & 0xFFFF
    assert bool((low[differs] == 0x8000).all())  # only ties differ, and those whose truncation is even do
    assert int(differs.sum()) == int(((low == 0x8000) & ((x.view(torch.int32) >> 16) & 1 == 0)).sum()) >= 400
    assert bool((w.float().abs() >= rne.float().abs())[differs].all())  # away from zero
    with pytest.raises(ValueError, match="float32"):
        split_master(x.double())
    with pytest.raises(ValueError, match="int16"):
        join_master(w, lo.int())


def test_bf16_workspace_splits_its_master_and_updates_it_as_fp32():
    """A bf16 buffer keeps no fp32 master, only int16 remainders; ls_adam's update of it follows the fp32 master's
    arithmetic exactly, and a write into the weights from outside makes them the master again."""
    torch.manual_seed(1)
    params = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (7, 1031, 64)]
    opt = LSAdam(params, lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    buf = opt.workspaces[0].buffers[0]
    assert buf.split and buf.lo.dtype == torch.int16 and buf.has_separate_master and buf._master is None
    master = torch.cat([p.detach().float() for p in params])
    m, v = torch.zeros_like(master), torch.zeros_like(master)
    for step in range(1, 6):
        gs = [torch.randn(p.shape).bfloat16() for p in params]
        for p, g in zip(params, gs):
            p.grad = g
        opt.step()
        adam_reference_(master, torch.cat(gs), m, v, lr=1e-2, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01,
                        step=step)
    got = torch.cat([buf.master_state(i).view(-1) for i in range(3)])
    assert torch.equal(got.view(torch.int32), master.view(torch.int32))
    from ls_fairseq.ops.adam import split_master

    assert torch.equal(torch.cat([p.detach().view(-1) for p in params]).view(torch.int16),
                       split_master(master)[0].view(torch.int16))
    with torch.no_grad():
        params[1].copy_(torch.ones(1031))
    opt.workspaces[0].sync()
    assert torch.equal(buf.master_state(1), torch.ones(1031))
