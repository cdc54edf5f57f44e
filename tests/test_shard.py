"""ls_adam with its state sharded over data-parallel ranks (LSAdam.shard_, the reduce-scatter of
ls_fairseq.optim.reduction_strategies): two gloo processes on the CPU train one replica sharded and one with the whole
state and the synchronous all-reduce; weights, norms and the consolidated state must agree."""

import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ls_fairseq.optim.adam import LSAdam
from ls_fairseq.optim.buckets import bucket_order, shardable
from ls_fairseq.optim.workspace import FlatWorkspace

from _models import assert_same_checkpoint_state, save_rank_result, two_rank_results
from test_overlap import _loss, _reduce_after_backward, _replicas


def test_shardable_needs_equal_aligned_parts():
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(100,), (3, 7), (64,)]]
    ws = FlatWorkspace(params)  # fp32: every parameter starts on a 64-element boundary
    buckets = bucket_order([ws], 1)
    assert shardable(buckets, 2) and shardable(buckets, 4) and shardable(buckets, 8)
    assert not shardable(buckets, 3) and not shardable(buckets, 16) and not shardable(buckets, 1)
    lo, hi = buckets[0].own(1, 4)
    assert (hi - lo) * 4 == buckets[0].end - buckets[0].start and lo == buckets[0].start + (hi - lo)


def test_shard_refuses_buckets_that_do_not_tile_the_buffers():
    net = torch.nn.Linear(8, 8)
    opt = LSAdam(net.parameters(), lr=0.1)
    (ws,) = opt.workspaces
    buckets = bucket_order([ws], 1)
    with pytest.raises(ValueError, match="tile"):
        opt.shard_(buckets[:1], 0, 2)
    other = bucket_order([FlatWorkspace([torch.nn.Parameter(torch.randn(8))])], 1)
    with pytest.raises(ValueError, match="cover"):
        opt.shard_(other, 0, 2)
    with pytest.raises(ValueError, match="world size"):
        opt.shard_(buckets, 2, 2)
    odd = [SimpleNamespace(buffer=b.buffer, start=b.start, end=b.end, own=lambda r, w, b=b: (b.start, b.start + 1))
           for b in buckets]
    with pytest.raises(ValueError, match="equal parts"):
        opt.shard_(odd, 0, 2)
    assert not opt.sharded


def test_peer_weights_must_match_the_buffers_and_two_ranks():
    net = torch.nn.Linear(8, 8)
    opt = LSAdam(net.parameters(), lr=0.1)
    (ws,) = opt.workspaces
    (buf,) = ws.buffers
    buckets = bucket_order([ws], 1)
    with pytest.raises(ValueError, match="does not match"):
        opt.shard_(buckets, 0, 2, peers={id(buf): torch.zeros(buf.numel + 1)})
    with pytest.raises(ValueError, match="does not match"):
        opt.shard_(buckets, 0, 2, peers={id(buf): torch.zeros(buf.numel, dtype=torch.float16)})
    with pytest.raises(ValueError, match="two ranks"):
        opt.shard_(buckets, 0, 4, peers={id(buf): torch.zeros(buf.numel)})
    assert not opt.sharded


def test_move_params_to_keeps_weights_views_and_master():
    half = torch.nn.Linear(8, 4).half()
    both = [torch.nn.Parameter(torch.randn(5, 3)), *half.parameters()]
    ws = FlatWorkspace(both)
    f32, f16 = ws.buffers
    values = [p.detach().clone() for p in both]
    for buf in (f32, f16):
        master = buf.master
        fresh = torch.full((buf.numel,), 7, dtype=buf.dtype)
        buf.move_params_to(fresh)
        assert buf.param is fresh
        assert (buf.master is fresh) if buf.dtype == torch.float32 else (buf.master is master)
    for p, v, (buf, i) in zip(both, values, (ws.locate(p) for p in both)):
        assert torch.equal(p.detach(), v) and p.data_ptr() == buf.param_view(i).data_ptr()
    assert ws.sync() == 0  # the views are intact: nothing to repair
    with pytest.raises(ValueError, match="vector of"):
        f16.move_params_to(torch.zeros(f16.numel))  # fp32 storage for fp16 weights


def test_crash_checkpoint_gathers_nothing_when_the_state_is_sharded(tmp_path):
    """After an exception on one rank nothing collective may run (the other ranks are elsewhere): with
    sharded state crash.pt is written without the optimizer state, and the setting is restored."""
    from omegaconf import OmegaConf

    from ls_fairseq.fairseq_ext.step.deferred_step import DeferredStep

    calls = []
    cfg = OmegaConf.create({"checkpoint": {"save_dir": str(tmp_path), "no_save_optimizer_state": False}})
    fake = SimpleNamespace(
        cfg=cfg,
        consolidate_optimizer=lambda: calls.append("consolidate"),
        save_checkpoint=lambda path, extra: calls.append(("save", os.path.basename(path),
                                                          cfg.checkpoint.no_save_optimizer_state)),
    )
    DeferredStep._save_crash_checkpoint(SimpleNamespace(trainer=fake, ls_adam=SimpleNamespace(sharded=True)))
    assert calls == [("save", "crash.pt", True)] and cfg.checkpoint.no_save_optimizer_state is False
    calls.clear()
    DeferredStep._save_crash_checkpoint(SimpleNamespace(trainer=fake, ls_adam=SimpleNamespace(sharded=False)))
    assert calls == ["consolidate", ("save", "crash.pt", False)]


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _worker(rank, port, out_dir):
    r = _replicas(rank, port)
    net, ref, wrapped, opt, ref_opt, names = r.net, r.ref, r.wrapped, r.opt, r.ref_opt, r.names
    out = {"mismatch": [], "norms": [], "sharded": []}
    try:
        opt.request_sharding()
        for update, freq in enumerate([1, 2, 1, 1, 2, 1]):
            use_extra = rank == 0 and update != 4
            opt.zero_grad()
            ref_opt.zero_grad()
            for micro in range(freq):
                if micro < freq - 1:
                    with wrapped.no_sync():
                        _loss(wrapped, rank, update, micro, use_extra).backward()
                        opt.all_reduce_grads(wrapped)
                else:
                    _loss(wrapped, rank, update, micro, use_extra).backward()
                _loss(ref, rank, update, micro, use_extra).backward()
            opt.all_reduce_grads(wrapped)
            _reduce_after_backward(ref_opt)
            out["sharded"].append(opt.sharded)
            # updates 3 and 5 clip (a factor read from the norm), the others step with the raw gradients
            if update in (3, 5):
                norm, ref_norm = opt.clip_grad_norm(0.5), ref_opt.clip_grad_norm(0.5)
            else:
                norm, ref_norm = opt._optimizer.grad_norm(), ref_opt._optimizer.grad_norm()
            out["norms"].append((float(norm), float(ref_norm)))
            opt.step()
            ref_opt.step()
            tol = {} if update not in (3, 5) else {"rtol": 1e-5, "atol": 1e-6}
            for n, p, q in zip(names, net.parameters(), ref.parameters()):
                ok = _same(p, q) if not tol else torch.allclose(p.float(), q.float(), **tol)
                if not ok:
                    out["mismatch"].append(f"update {update} param {n}")
            if update == 3:  # from here on both start from the same weights again
                with torch.no_grad():
                    for p, q in zip(net.parameters(), ref.parameters()):
                        q.copy_(p)
                opt.optimizer.consolidate_state_dict()  # as fairseq's Trainer.consolidate_optimizer does
                ref_opt.load_state_dict(opt.state_dict())
        # the whole state only after consolidation, and then equal to the unsharded optimizer's
        try:
            opt.state_dict()
            out["stale_read"] = "allowed"
        except RuntimeError as e:
            out["stale_read"] = str(e)
        opt.optimizer.consolidate_state_dict()
        got, want = opt.state_dict(), ref_opt.state_dict()
        out["state_equal"] = all(
            _same(got["state"][i][k], v) for i, entry in want["state"].items() for k, v in entry.items()
            if torch.is_tensor(v))
        out["params"] = [p.detach().clone() for p in net.parameters()]
        # a non-finite device factor (an fp16 overflow) skips the update on every part
        before = [p.detach().clone() for p in net.parameters()]
        opt.zero_grad()
        _loss(wrapped, rank, 50, 0, True).backward()
        opt.all_reduce_grads(wrapped)
        opt._optimizer._grad_factor = torch.tensor(float("nan"))
        opt.step()
        out["skipped"] = all(_same(a, p) for a, p in zip(before, net.parameters()))
        # dropping the reduction (a new wrapper) consolidates and keeps the whole state from then on
        opt._optimizer.forget_last_step()
        opt._drop_reduction()
        out["after_drop"] = (opt.sharded, opt._optimizer._stale)
        save_rank_result(out_dir, rank, out)
    finally:
        dist.destroy_process_group()


def test_sharded_adam_equals_the_whole_state_on_two_ranks(tmp_path):
    got = two_rank_results(_worker, tmp_path)
    for rank in (0, 1):
        out = got[rank]
        assert out["mismatch"] == [], out["mismatch"]
        # sharded from the first update on (its gradients were all-reduced whole before the hooks existed)
        assert out["sharded"] == [True] * 6
        for norm, ref in out["norms"]:
            assert norm == pytest.approx(ref, rel=1e-6)
        assert "consolidate_state_dict" in out["stale_read"]
        assert out["state_equal"]
        assert out["skipped"]
        assert out["after_drop"] == (False, False)
    for a, b in zip(got[0]["params"], got[1]["params"]):
        assert torch.equal(a, b)  # every rank holds all the new weights
    # each rank's norm is the norm of all the gradients, not of its own part
    assert [n for n, _ in got[0]["norms"]] == [n for n, _ in got[1]["norms"]]


def _peer_worker(rank, port, out_dir):
    """Sharded with peer writes, on gloo: each rank's stand-in for the other GPU's weights is a local buffer.
    The step must write exactly the owned parts into it (one update call per flat buffer) and gather
    nothing; the test then plays the peer's stores and checks the weights against the whole state."""
    r = _replicas(rank, port)
    net, ref, wrapped, opt, ref_opt, names = r.net, r.ref, r.wrapped, r.opt, r.ref_opt, r.names
    lsadam = opt._optimizer
    out = {"mismatch": [], "peer_parts": [], "norms": [], "stale_parts": []}
    try:
        opt.request_sharding()
        for update in range(4):
            opt.zero_grad()
            ref_opt.zero_grad()
            _loss(wrapped, rank, update, 0, rank == 0).backward()
            _loss(ref, rank, update, 0, rank == 0).backward()
            opt.all_reduce_grads(wrapped)
            _reduce_after_backward(ref_opt)
            if update == 0:  # the strategy is chosen now (gloo: sharded with all-gathers); give it stand-ins
                bufs = [buf for ws in lsadam.workspaces for buf in ws.buffers]
                stand_in = {id(b): torch.zeros_like(b.param) for b in bufs}
                lsadam.shard_(opt._reduction.strategy.buckets, rank, 2, lsadam._shard.group, peers=stand_in)
            for t in stand_in.values():
                t.zero_()
            out["norms"].append((float(lsadam.grad_norm()), float(ref_opt._optimizer.grad_norm())))
            masters = [b.master.clone() for b in bufs]
            opt.step()
            ref_opt.step()
            for b, before in zip(bufs, masters):
                owned = torch.zeros(b.numel, dtype=torch.bool)
                for lo, hi in lsadam._shard.ranges[id(b)]:
                    owned[lo:hi] = True
                t = stand_in[id(b)]
                out["peer_parts"].append(bool(0 < owned.sum() < b.numel and torch.equal(t[owned], b.param[owned])
                                              and not t[~owned].any()))
                if b.has_separate_master:  # no all-gather: the parts the peer owns are stale here until it writes
                    out["stale_parts"].append(torch.equal(b.master[~owned], before[~owned]))
                full = t.clone()
                dist.all_reduce(full)  # what the peer stored into this rank's weights, plus our own part
                b.param.copy_(full)
            for n, p, q in zip(names, net.parameters(), ref.parameters()):
                if not _same(p, q):
                    out["mismatch"].append(f"update {update} param {n}")
        save_rank_result(out_dir, rank, out)
    finally:
        dist.destroy_process_group()


def test_peer_writes_store_exactly_the_owned_parts_on_two_ranks(tmp_path):
    got = two_rank_results(_peer_worker, tmp_path)
    for out in got:
        assert out["mismatch"] == [], out["mismatch"]
        assert out["peer_parts"] and all(out["peer_parts"]), out["peer_parts"]
        assert out["stale_parts"] and all(out["stale_parts"])
        for norm, ref in out["norms"]:
            assert norm == pytest.approx(ref, rel=1e-6)


# --------------------------------------------------------------------------- lightseq-train, two gloo ranks
from test_end_to_end import inner_by_update, train  # noqa: E402


def test_sharded_checkpoints_hold_the_whole_state_and_resume_anywhere(data_bin, tmp_path):
    """lightseq-train on two gloo ranks with the optimizer state sharded (``--ls-shard-state on``), with
    the default (``auto``: only with peer writes, which gloo has not, so the whole state) and with the
    whole state on every rank (``off``): no clipping, so the updates agree bit for bit, and so do the checkpoints (the
    sharded run consolidates before saving). The sharded checkpoint resumes on two ranks and on one
    process with --update-freq 2."""
    from _models import lightseq_train_two_ranks
    from test_end_to_end import TRAIN_FLAGS

    flags = [*TRAIN_FLAGS, "--dropout", "0", "--log-interval", "3", "--disable-validation"]
    runs = {}
    for name, shard in (("sharded", ["--ls-shard-state", "on"]), ("whole", ["--ls-shard-state", "off"]),
                        ("auto", [])):
        save = tmp_path / name
        save.mkdir()
        runs[name] = lightseq_train_two_ranks(data_bin, save, save, [*flags, *shard, "--max-update", "6"])
    # auto shards only with peer writes, which gloo cannot have: the whole state, every rank agreeing
    with open(tmp_path / "auto" / "rank0.log") as f:
        log = f.read()
    assert "optimizer state not sharded (no peer writes: the weights are not on one CUDA device)" in log
    assert "optimizer state sharded over" not in log
    with open(tmp_path / "whole" / "rank0.log") as f:
        log = f.read()
    assert "peer writes" not in log and "optimizer state sharded over" not in log
    with open(tmp_path / "sharded" / "rank0.log") as f:
        log = f.read()
    assert "optimizer state sharded over 2 ranks" in log
    # peer writes need two CUDA devices: on gloo every rank falls back on the all-gathers together
    assert "sharded weights are all-gathered (no peer writes: the weights are not on one CUDA device)" in log
    assert "the forward waits for the weights' all-gathers layer by layer (4 layers" in log
    for name in ("sharded", "auto"):
        assert sorted(runs[name]) == sorted(runs["whole"]) == [3, 6]
        for u in (3, 6):
            for k in ("loss", "nll_loss", "gnorm", "wpb"):
                assert runs[name][u][k] == runs["whole"][u][k], (name, u, k)
        # the toy epoch is 3 updates on two ranks: checkpoint_last.pt was written at updates 3 and 6
        assert_same_checkpoint_state(*(tmp_path / n / "checkpoint_last.pt" for n in (name, "whole")))

    # resume the sharded run on two ranks, and on one process with --update-freq 2 (the same batches)
    import shutil

    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(tmp_path / "sharded" / "checkpoint_last.pt", one / "checkpoint_last.pt")
    more = lightseq_train_two_ranks(data_bin, tmp_path / "sharded", tmp_path / "sharded",
                                    [*flags, "--ls-shard-state", "on", "--max-update", "9"])
    with open(tmp_path / "sharded" / "rank0.log") as f:
        assert "Loaded checkpoint" in f.read()
    assert sorted(more) == [9]
    records = inner_by_update(train(data_bin, str(one), "--dropout", "0", "--log-interval", "3",
                                    "--disable-validation", "--update-freq", "2", "--max-update", "9"))
    assert sorted(records) == [9]
    assert float(records[9]["loss"]) == pytest.approx(float(more[9]["loss"]), abs=0.01)


def test_shard_setting_is_checked(tmp_path):
    """--ls-shard-state is an option of ls_adam (auto, on, off; auto by default); LSTrainer reads it from the
    optimizer's config when it sets up the deferred step."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from ls_fairseq.cli import train
    from ls_fairseq.fairseq_ext.optimizer import LSAdamConfig, LSFairseqAdam

    base = [str(tmp_path), "--arch", "ls_transformer_tiny", "--optimizer", "ls_adam", "--lr", "1e-3",
            "--criterion", "ls_label_smoothed_cross_entropy", "--max-tokens", "64", "--cpu"]
    for extra, want in (([], "auto"), (["--ls-shard-state", "on"], "on"), (["--ls-shard-state", "off"], "off")):
        cfg = convert_namespace_to_omegaconf(train.parse(base + extra))
        assert str(cfg.optimizer.ls_shard_state) == want
    with pytest.raises(SystemExit):
        train.parse(base + ["--ls-shard-state", "p2p"])
    opt = LSFairseqAdam(LSAdamConfig(lr=[0.01]), [torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="request_sharding takes True, False or 'p2p', not 'P2P'"):
        opt.request_sharding("P2P")


def _vote_worker(rank, port, out_dir):
    """map_peer_weights' agreement on two gloo ranks, with the CUDA-only parts stood in for: every rank
    must be able to map, and all on one host, or none maps."""
    import logging
    import socket

    import torch.distributed._symmetric_memory as symm_mem

    from ls_fairseq.optim import peer
    from test_deferred_step import _Lines

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    symm_mem.empty = lambda n, dtype, device: torch.empty(n, dtype=dtype, device=device)
    lg, lines = logging.getLogger("ls_fairseq.optim.peer"), _Lines()
    lg.addHandler(lines)
    lg.setLevel(logging.INFO)
    def no_peer_access(t, group):
        raise RuntimeError("peer access is not supported between these devices")

    got = {}
    for case in ("other_host", "other_rank_cannot", "mapping_fails", "mapping_fails_on_one"):
        ws = FlatWorkspace([torch.nn.Parameter(torch.randn(10))])
        before = ws.buffers[0].param
        peer._why_not = lambda *a, case=case: "cannot here" if case == "other_rank_cannot" and rank == 1 else None
        socket.gethostname = lambda case=case: f"host{rank}" if case == "other_host" else "host"
        # the rendezvous itself refuses (every rank, or only rank 1 while rank 0 maps a stand-in of the peer)
        fails = case == "mapping_fails" or (case == "mapping_fails_on_one" and rank == 1)
        stand_in = SimpleNamespace(get_buffer=lambda peer, shape, dtype, offset: torch.empty(shape, dtype=dtype))
        symm_mem.rendezvous = no_peer_access if fails else (lambda t, group, h=stand_in: h)
        lines.lines = []
        got[case] = (peer.map_peer_weights([ws], rank, 2) is None, ws.buffers[0].param is before, lines.lines)
    dist.destroy_process_group()
    save_rank_result(out_dir, rank, got)


def test_peer_mapping_needs_every_rank_on_one_host(tmp_path):
    got = two_rank_results(_vote_worker, tmp_path)
    for rank in (0, 1):
        none, unmoved, lines = got[rank]["other_host"]
        assert none and unmoved and lines == ["ls_adam: sharded weights are all-gathered (no peer writes: the ranks "
                                              "run on different hosts)"]
    for rank, why in ((0, "another rank cannot"), (1, "cannot here")):
        none, unmoved, lines = got[rank]["other_rank_cannot"]
        assert none and unmoved and lines == [f"ls_adam: sharded weights are all-gathered (no peer writes: {why})"]
    refused = "symmetric memory mapping failed (peer access is not supported between these devices)"
    for rank, case, why in ((0, "mapping_fails", refused), (1, "mapping_fails", refused),
                            (0, "mapping_fails_on_one", "another rank cannot"), (1, "mapping_fails_on_one", refused)):
        none, unmoved, lines = got[rank][case]
        assert none and unmoved and lines == [f"ls_adam: sharded weights are all-gathered (no peer writes: {why})"]


# --------------------------------------------------------------------------- peer copies
def _peer_copies_worker(rank, port, out_dir):
    """Two strategies over two identical _Net replicas, both sharded: one reduce-scatters with gloo, the
    other copies the other rank's halves into its inbox. Here the inboxes are files both processes map
    (shared memory stands in for symmetric memory); CPU copies are synchronous. The owned halves must
    agree bit for bit in every round, across both halves of the inbox (rounds alternate between them)."""
    import datetime

    from ls_fairseq.optim.reduction_strategies import PeerCopyReduce, ShardedReduceScatter
    from test_overlap import _Net

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))

    class Arm:
        accumulate_grads = False

    out = {"mismatch": [], "rounds": 0, "buckets": 0}
    try:
        nets = {name: _Net() for name in ("copies", "scatter")}
        spaces = {name: FlatWorkspace(list(net.parameters())) for name, net in nets.items()}
        plans = {name: bucket_order([ws], 256) for name, ws in spaces.items()}
        inboxes = {}
        for i, buf in enumerate(spaces["copies"].buffers):
            path = lambda r: os.path.join(str(out_dir), f"inbox{i}_rank{r}.bin")  # noqa: E731
            t = {r: torch.from_file(path(r), shared=True, size=buf.numel, dtype=buf.grad.dtype) for r in (0, 1)}
            inboxes[id(buf)] = (t[rank], t[1 - rank], None)
        dist.barrier()  # both ranks' files exist before any copy
        reducers = {
            "scatter": ShardedReduceScatter(plans["scatter"], 2, dist.group.WORLD, Arm(), None, rank),
            "copies": PeerCopyReduce(plans["copies"], 2, dist.group.WORLD, Arm(), None, rank, inboxes),
        }
        out["buckets"] = len(reducers["copies"].buckets)
        for update in range(5):
            for name, net in nets.items():
                for p in net.parameters():
                    p.grad = None
                _loss(net, rank, update, 0, update != 3).backward()
                assert reducers[name].finish()
            reducer = reducers["copies"]
            for n, own in enumerate(reducer.owned):
                if not torch.equal(own, reducers["scatter"].owned[n]):
                    out["mismatch"].append(f"update {update} bucket {n}")
            out["rounds"] = reducer.rounds
        save_rank_result(out_dir, rank, out)
    finally:
        dist.destroy_process_group()


def test_peer_copies_equal_the_reduce_scatter_on_two_ranks(tmp_path):
    got = two_rank_results(_peer_copies_worker, tmp_path)
    for out in got:
        assert out["mismatch"] == [], out["mismatch"]
        assert out["rounds"] == 5 and out["buckets"] >= 4


def test_peer_copies_check_their_inboxes():
    from ls_fairseq.optim.reduction_strategies import PeerCopyReduce

    class Arm:
        accumulate_grads = False

    net = torch.nn.Linear(16, 16)
    ws = FlatWorkspace(list(net.parameters()))
    (buf,) = ws.buffers
    buckets = bucket_order([ws], 256)
    with pytest.raises(ValueError, match="sharded over two ranks"):
        PeerCopyReduce(buckets, 4, None, Arm(), None, 0, {id(buf): (torch.zeros_like(buf.grad),) * 2 + (None,)})
    with pytest.raises(ValueError, match="must match its flat gradient buffer"):
        PeerCopyReduce(buckets, 2, None, Arm(), None, 0, {id(buf): (torch.zeros(buf.numel + 1),) * 2 + (None,)})
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())  # refused before any hook
