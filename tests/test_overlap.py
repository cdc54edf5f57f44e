"""ls_adam's gradient all-reduce overlapped with the backward pass (ls_fairseq.optim.overlap,
ls_fairseq.optim.reduction_strategies.OverlappedAllReduce): the bucket plan, and two gloo processes on
the CPU that train one replica with the overlapped reduction and one with the synchronous reduction
after the backward, which must agree bit for bit. Both kinds of hooks run: the
Python post-accumulate-grad hooks, and the C++ hooks of csrc/torch/grad_buckets.cpp, built here on the CPU
as a module of its own (the extension ls_fairseq._C carries the same file on GPU machines)."""

import datetime
import gc
import importlib
import os
import shutil
import sys
import weakref

import pytest
import torch
import torch.distributed as dist

from ls_fairseq.optim.buckets import DEFAULT_BUCKET_MB, bucket_order, plan_buckets
from ls_fairseq.optim.overlap import OverlappedReducer
from ls_fairseq.optim.reduction_strategies import OverlappedAllReduce, ReduceAfterBackward
from ls_fairseq.optim.workspace import FlatWorkspace

from _cpu_builds import cached_cpu_extension
from _models import save_rank_result, two_rank_results

_MODULE = "ls_fairseq_grad_buckets_test"
_DIR_ENV = "LS_FAIRSEQ_TEST_GRAD_BUCKETS_DIR"  # where a two-rank worker finds the built module
_PYTHON_HOOKS = "python"  # ... or this: use the Python hooks


@pytest.fixture(scope="module")
def grad_buckets_dir(cpu_builds):
    """csrc/torch/grad_buckets.cpp built as a module of its own (once, then cached while the sources stay
    the same); its folder."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler to build the C++ hooks with")
    _, build = cached_cpu_extension(_MODULE)
    return build


def _use_built_hooks(monkeypatch=None):
    """Make the reducers use the C++ hooks of the module a test built, if it built one (in this process
    for good, as a two-rank worker wants it, or through ``monkeypatch``, undone after the test)."""
    build = os.environ.get(_DIR_ENV)
    if not build:
        return
    from ls_fairseq.optim import overlap

    if build == _PYTHON_HOOKS:  # the Python hooks, also where the extension has the C++ ones
        if monkeypatch is None:
            overlap._grad_buckets_class = lambda: None
        else:
            monkeypatch.setattr(overlap, "_grad_buckets_class", lambda: None)
        return

    if build not in sys.path:
        sys.path.insert(0, build)
    cls = importlib.import_module(_MODULE).GradBuckets
    if monkeypatch is None:
        overlap._grad_buckets_class = lambda: cls
    else:
        monkeypatch.setattr(overlap, "_grad_buckets_class", lambda: cls)


def _choose_hooks(which, request, monkeypatch):
    if which == "python_hooks":
        monkeypatch.setenv(_DIR_ENV, _PYTHON_HOOKS)
    else:
        monkeypatch.setenv(_DIR_ENV, request.getfixturevalue("grad_buckets_dir"))


@pytest.fixture(params=["python_hooks", "cpp_hooks"])
def hooks(request, monkeypatch):
    """Which hooks the reducers use; "cpp_hooks" builds them (and the test checks that it got them)."""
    _choose_hooks(request.param, request, monkeypatch)
    return request.param




# --------------------------------------------------------------------------- the bucket plan
@pytest.mark.parametrize("bucket_bytes", [1, 200, 1000, 1 << 20])
def test_buckets_tile_the_buffer_once_last_parameters_first(bucket_bytes):
    shapes = [(7, 3), (5,), (64,), (1,), (3, 11), (0,), (2, 2), (40,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    (buf,) = FlatWorkspace(params).buffers
    buckets = plan_buckets(buf, bucket_bytes)
    # contiguous ranges that tile [0, numel) exactly once, from the end of the buffer
    assert buckets[0].end == buf.numel and buckets[-1].start == 0
    for a, b in zip(buckets, buckets[1:]):
        assert b.end == a.start and a.start < a.end
    covered = torch.zeros(buf.numel, dtype=torch.int32)
    for bk in buckets:
        covered[bk.start:bk.end] += 1
    assert torch.equal(covered, torch.ones_like(covered))
    # every parameter once, in reverse layout order, inside its bucket's range
    members = [i for bk in buckets for i in bk.members]
    assert members == list(reversed(range(len(params))))
    for bk in buckets:
        for i in bk.members:
            o, k = buf.offsets[i]
            assert bk.start <= o and o + k <= bk.end
        assert bk.flat.data_ptr() == buf.grad[bk.start:].data_ptr() and bk.flat.numel() == bk.end - bk.start
    # each bucket reaches the cap, but the last one (which holds the first parameter)
    for bk in buckets[:-1]:
        assert (bk.end - bk.start) * 4 >= bucket_bytes
    if bucket_bytes == 1:  # one parameter per bucket; the empty one shares its neighbour's
        assert len(buckets) == len(params) - 1
    if bucket_bytes == 1 << 20:
        assert len(buckets) == 1


def test_buckets_of_two_dtypes_interleave_by_parameter_position():
    shapes = [(64,), (64,), (64,), (64,), (64,), (64,)]
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float32, torch.bfloat16]
    params = [torch.nn.Parameter(torch.randn(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    ws = FlatWorkspace(params)
    assert len(ws.buffers) == 2
    order = bucket_order([ws], 1)  # one parameter per bucket
    firsts = [bk.buffer.params[bk.members[-1]] for bk in order]
    assert [id(p) for p in firsts] == [id(p) for p in reversed(params)]
    for buf in ws.buffers:  # within a buffer: reverse layout order
        mine = [bk for bk in order if bk.buffer is buf]
        assert [bk.start for bk in mine] == sorted((bk.start for bk in mine), reverse=True)


def test_one_process_installs_no_hooks():
    from ls_fairseq.fairseq_ext.optimizer import LSAdamConfig, LSFairseqAdam

    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    opt = LSFairseqAdam(LSAdamConfig(lr=[0.1]), list(model.parameters()))
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(3, 5)).sum().backward()
        opt.all_reduce_grads(model)
        opt.step()
    assert "_reduction" not in opt.__dict__
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


# --------------------------------------------------------------------------- two processes
class _Net(torch.nn.Module):
    """fp32 and bf16 layers; ``extra`` (between them in the parameter layout) gets a gradient only
    where the caller uses it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(6, 16)
        self.b = torch.nn.Linear(16, 16).to(torch.bfloat16)
        self.extra = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x, use_extra, reentrant_checkpoint=False):
        h = torch.tanh(self.a(x))
        if reentrant_checkpoint:  # b and extra get their gradients in a backward nested in the outer one
            h = torch.utils.checkpoint.checkpoint(self._middle, h, use_extra, use_reentrant=True)
        else:
            h = self._middle(h, use_extra)
        return self.c(h)

    def _middle(self, h, use_extra):
        h = torch.tanh(self.b(h.to(torch.bfloat16))).float()
        return torch.tanh(self.extra(h)) if use_extra else h


def _loss(model, rank, update, micro, use_extra):
    g = torch.Generator().manual_seed(1000 * update + 10 * micro + rank)
    x = torch.randn(5, 6, generator=g)
    return model(x, use_extra, reentrant_checkpoint=update in (2, 3)).pow(2).sum() * (rank + 1)


def _reducer(opt):
    """The overlapped strategy of ``opt``'s gradient reduction, or None (none set up yet, or the reduction
    after the backward)."""
    reduction = opt.__dict__.get("_reduction")
    strategy = reduction.strategy if reduction is not None else None
    return strategy if isinstance(strategy, OverlappedReducer) else None


def _reduce_after_backward(opt):
    """The synchronous reduction (one all-reduce per flat buffer) of ``opt``'s gradients, as reference."""
    ReduceAfterBackward(opt._optimizer.workspaces, 2, dist.all_reduce).reduce()


def _replicas(rank, port):
    """Join the two-rank gloo group; two identical _Net replicas, each with ls_adam (256-byte buckets):
    ``net`` under fairseq's legacy DDP wrapper, ``ref`` bare. Returns SimpleNamespace(net, ref, ddp,
    wrapped, opt, ref_opt, names, group: a weak reference to the process group)."""
    from types import SimpleNamespace

    import ls_fairseq.fairseq_ext  # noqa: F401
    from fairseq.distributed import ModuleProxyWrapper
    from fairseq.distributed.legacy_distributed_data_parallel import LegacyDistributedDataParallel

    from ls_fairseq.fairseq_ext.optimizer import LSAdamConfig, LSFairseqAdam

    _use_built_hooks()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    cfg = LSAdamConfig(lr=[0.01], adam_betas="(0.9, 0.98)", bucket_cap_mb=256 / 2**20)
    net, ref = _Net(), _Net()
    ddp = LegacyDistributedDataParallel(net, process_group=dist.group.WORLD)
    return SimpleNamespace(net=net, ref=ref, ddp=ddp, wrapped=ModuleProxyWrapper(ddp),
                           opt=LSFairseqAdam(cfg, list(net.parameters())),
                           ref_opt=LSFairseqAdam(cfg, list(ref.parameters())),
                           names=[n for n, _ in net.named_parameters()], group=weakref.ref(dist.group.WORLD))


def _worker(rank, port, out_dir):
    """:func:`_train`, then check that the gloo group is gone: freed, its threads joined, before the
    interpreter shuts down (a rank whose group outlives it can abort at exit; see
    ls_fairseq/_collective_defaults.py and _models._rank_main)."""
    group = _train(rank, port, out_dir)
    gc.collect()
    assert group() is None, "the process group outlived destroy_process_group() and every replica"


def _train(rank, port, out_dir):
    r = _replicas(rank, port)
    net, ref, ddp, wrapped, opt, ref_opt, names = r.net, r.ref, r.ddp, r.wrapped, r.opt, r.ref_opt, r.names
    group = r.group
    out = {"mismatch": [], "rounds": []}
    try:
        # update-freq 1 and 2; `extra` is used on rank 0 only, and in update 4 on neither; updates 2
        # and 3 run the middle layers under a reentrant activation checkpoint
        for update, freq in enumerate([1, 2, 1, 2, 1, 1]):
            use_extra = rank == 0 and update != 4
            opt.zero_grad()
            ref_opt.zero_grad()
            for micro in range(freq):
                last = micro == freq - 1
                if last:
                    _loss(wrapped, rank, update, micro, use_extra).backward()
                else:
                    with wrapped.no_sync():
                        _loss(wrapped, rank, update, micro, use_extra).backward()
                        opt.all_reduce_grads(wrapped)  # waits, as fairseq's wrapper does
                _loss(ref, rank, update, micro, use_extra).backward()
                reducer = _reducer(opt)
                if not last:
                    assert reducer is None or not reducer.in_flight, "a no_sync backward started a round"
            r = reducer._round if reducer is not None else None
            out["rounds"].append(None if r is None else (r.ended, r.early, r.next, len(reducer.buckets)))
            # fairseq's Trainer all-reduces its logging statistics between the backward and all_reduce_grads
            stats = torch.tensor([float(rank + update)])
            dist.all_reduce(stats)
            assert stats.item() == 1 + 2 * update
            opt.all_reduce_grads(wrapped)
            _reduce_after_backward(ref_opt)  # the synchronous path
            for n, p, q in zip(names, net.parameters(), ref.parameters()):
                if not torch.equal(p.grad, q.grad):
                    out["mismatch"].append(f"update {update} grad {n}")
            opt.step()
            ref_opt.step()
            for n, p, q in zip(names, net.parameters(), ref.parameters()):
                if not torch.equal(p, q):
                    out["mismatch"].append(f"update {update} param {n}")
        out["params"] = [p.detach().clone() for p in net.parameters()]
        reducer = _reducer(opt)
        out["cpp_hooks"] = reducer._native is not None and not reducer._handles
        out["dtypes"] = sorted({str(bk.buffer.dtype) for bk in reducer.buckets})
        out["grads_are_views"] = all(
            p.grad.untyped_storage().data_ptr() == buf.grad.untyped_storage().data_ptr()
            for ws in opt._optimizer.workspaces for buf in ws.buffers for p in buf.params
        )

        # a second backward into gradients that are being reduced is an error, not a wrong gradient
        errors = []
        for second_in_no_sync in (False, True):
            opt.zero_grad()
            _loss(wrapped, rank, 99, 0, True).backward()
            try:
                if second_in_no_sync:
                    with wrapped.no_sync():
                        _loss(wrapped, rank, 99, 1, True).backward()
                else:
                    _loss(wrapped, rank, 99, 1, True).backward()
            except RuntimeError as e:
                errors.append(str(e))
            ddp.accumulate_grads = False  # fairseq's no_sync() does not restore it when its body raises
            opt.zero_grad()  # closes the round
            assert not reducer.in_flight
        out["errors"] = errors
        # ... and the reducer keeps working afterwards
        opt.zero_grad()
        ref_opt.zero_grad()
        _loss(wrapped, rank, 7, 0, True).backward()
        _loss(ref, rank, 7, 0, True).backward()
        opt.all_reduce_grads(wrapped)
        _reduce_after_backward(ref_opt)
        out["after_error_equal"] = all(torch.equal(p.grad, q.grad) for p, q in zip(net.parameters(), ref.parameters()))
        save_rank_result(out_dir, rank, out)
    finally:
        dist.destroy_process_group()
    return group


@pytest.mark.parametrize("hooks", ["python_hooks", "cpp_hooks"])
def test_overlapped_reduction_equals_the_synchronous_one_bit_for_bit(tmp_path, monkeypatch, request, hooks):
    _choose_hooks(hooks, request, monkeypatch)
    got = two_rank_results(_worker, tmp_path)
    for rank in (0, 1):
        out = got[rank]
        assert out["cpp_hooks"] == (hooks == "cpp_hooks")
        assert out["mismatch"] == [], out["mismatch"]
        rounds = out["rounds"]
        assert rounds[0] is None  # the first update reduces after the backward, then installs the hooks
        for update, (ended, early, launched, n_buckets) in enumerate(rounds[1:], 1):
            # every bucket was launched before the backward returned; from the hooks: all of them
            # where every parameter got a gradient, else those before the first that got none
            assert ended and launched == n_buckets and n_buckets >= 8
            assert early == (n_buckets if rank == 0 and update != 4 else 2)
        assert out["dtypes"] == ["torch.bfloat16", "torch.float32"]
        assert out["grads_are_views"]
        assert len(out["errors"]) == 2 and all("written again" in e for e in out["errors"])
        assert out["after_error_equal"]
    for a, b in zip(got[0]["params"], got[1]["params"]):
        assert torch.equal(a, b)  # the replicas stay identical


def test_parameter_hooks_do_not_keep_the_reducer_and_its_wrapper_alive(hooks, monkeypatch):
    """The post-accumulate-grad hooks live in autograd's C++ state, out of the garbage collector's
    sight. Had they held the reducer strongly, the reducer, its DDP wrapper (``arm``) and the
    wrapper's process group would stay alive as long as the parameters, and a gloo group would
    then be torn down at interpreter shutdown, where a rank could abort. Dropping the reducer
    frees it and its wrapper at once; the hooks left on the parameters then do nothing."""
    import gc
    import weakref

    class Wrapper:  # stands in for fairseq's legacy DDP wrapper (it holds the process group)
        accumulate_grads = False

    net = torch.nn.Linear(4, 3)
    ws = FlatWorkspace(list(net.parameters()))
    wrapper = Wrapper()
    _use_built_hooks(monkeypatch)
    reducer = OverlappedAllReduce(bucket_order([ws], DEFAULT_BUCKET_MB << 20), 2, None, wrapper, None)
    if hooks == "cpp_hooks":  # one hook per trainable parameter
        assert reducer._native.num_hooks == 2 and not reducer._handles
    else:
        assert len(reducer._handles) == 2 and reducer._native is None
    gone, wrapper_gone = weakref.ref(reducer), weakref.ref(wrapper)
    gc.disable()  # freed by reference counting alone, not by a later collection
    try:
        del reducer, wrapper
        assert gone() is None and wrapper_gone() is None
    finally:
        gc.enable()
    net(torch.ones(2, 4)).sum().backward()  # the orphaned hooks are no-ops
    assert torch.equal(net.bias.grad, torch.full((3,), 2.0))
