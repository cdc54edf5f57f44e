"""GradReduction's choice of strategy (ls_fairseq.optim.reduction), in one process: the collectives are
recorded instead of run, and the peer mappings (two GPUs of one host) are stood in for, so that every
branch of the choice runs on the CPU, the peer-copy one included. The strategies themselves are checked
on two gloo ranks in test_distributed.py, test_overlap.py and test_shard.py."""

import pytest
import torch
import torch.distributed as dist

from _models import log_lines
from ls_fairseq.optim import overlap, reduction
from ls_fairseq.optim.adam import LSAdam
from ls_fairseq.optim.reduction import GradReduction
from ls_fairseq.optim.reduction_strategies import (
    OverlappedAllReduce,
    PeerCopyReduce,
    ReduceAfterBackward,
    ShardedReduceScatter,
)


class _Layers(torch.nn.Module):
    ls_gather_waits = True  # the forward may wait for the weights layer by layer

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _DDP:
    """Stands in for fairseq's legacy DDP wrapper."""

    def __init__(self, module, world_size):
        self.module, self.world_size, self.process_group, self.accumulate_grads = module, world_size, None, False


@pytest.fixture
def log():
    with log_lines(("ls_fairseq.optim.reduction",)) as lines:
        yield lines


def _peer_stand_ins(monkeypatch, weights: bool, inboxes):
    """map_peer_weights / map_peer_inboxes as on two GPUs of one host (``inboxes``: True, or the reason why
    not), or as where the ranks cannot map each other's memory (``weights`` False)."""

    def map_weights(workspaces, rank, world_size, group=None, fallback=""):
        if not weights:
            return None
        return {id(buf): torch.zeros_like(buf.param) for ws in workspaces for buf in ws.buffers}

    def map_inboxes(workspaces, rank, world_size, group=None):
        if inboxes is not True:
            return inboxes
        return {id(buf): (torch.zeros_like(buf.grad), torch.zeros_like(buf.grad), None)
                for ws in workspaces for buf in ws.buffers}

    monkeypatch.setattr(reduction, "map_peer_weights", map_weights)
    monkeypatch.setattr(reduction, "map_peer_inboxes", map_inboxes)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(overlap, "_grad_buckets_class", lambda: None)  # the Python hooks, which tests can see


def _reduction(world_size=2, shard=False, can_overlap=True):
    model = _Layers()
    opt = LSAdam(model.parameters(), lr=0.1)
    reduced = []
    ddp = _DDP(model, world_size)
    red = GradReduction(opt, ddp, lambda t: reduced.append(t.data_ptr()), can_overlap=can_overlap,
                        bucket_bytes=1024, shard=shard)
    return red, opt, ddp, model, reduced


# (world size, shard request, peer weights, peer inboxes, post-accumulate-grad hooks, can overlap) -> strategy,
# sharded, peer writes, waits layer by layer
CASES = {
    "one_rank": ((1, True, True, True, True, True), ReduceAfterBackward, False, False, False),
    "no_grad_hooks": ((2, True, True, True, False, True), ReduceAfterBackward, False, False, False),
    "xla": ((2, True, True, True, True, False), ReduceAfterBackward, False, False, False),
    "whole_state": ((2, False, True, True, True, True), OverlappedAllReduce, False, False, False),
    "uneven_buckets": ((3, True, True, True, True, True), OverlappedAllReduce, False, False, False),
    "p2p_without_peers": ((2, "p2p", False, True, True, True), OverlappedAllReduce, False, False, False),
    "sharded_all_gathers": ((2, True, False, True, True, True), ShardedReduceScatter, True, False, True),
    "p2p_peer_copies": ((2, "p2p", True, True, True, True), PeerCopyReduce, True, True, False),
    "sharded_peer_copies": ((2, True, True, True, True, True), PeerCopyReduce, True, True, False),
    "peer_writes_nccl_scatter": ((2, "p2p", True, "symmetric memory allocation failed (out of memory)", True, True),
                                 ShardedReduceScatter, True, True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_strategy_is_chosen_once_after_the_first_update(case, monkeypatch, log):
    (world, shard, weights, inboxes, hooks, can_overlap), kind, sharded, peer_writes, waits = CASES[case]
    if not hooks:  # a torch before 2.1: the reduction cannot overlap the backward
        monkeypatch.delattr(torch.Tensor, "register_post_accumulate_grad_hook")
    _peer_stand_ins(monkeypatch, weights, inboxes)
    red, opt, ddp, model, reduced = _reduction(world, shard, can_overlap)
    buffers = [buf.grad.data_ptr() for ws in opt.workspaces for buf in ws.buffers]
    first = red.strategy
    assert isinstance(first, ReduceAfterBackward)

    ddp.accumulate_grads = True  # inside no_sync(): nothing happens
    red.reduce()
    assert reduced == [] and red.strategy is first
    ddp.accumulate_grads = False
    red.reduce()  # the first update: one all-reduce per flat buffer, then the choice
    assert reduced == buffers
    chosen = red.strategy
    assert type(chosen) is kind
    assert opt.sharded == sharded
    assert (opt.sharded and bool(opt._shard.peers)) == peer_writes
    assert (red._gather_waits is not None) == waits
    if sharded:
        assert f"optimizer state sharded over {world} ranks" in " ".join(log)
        assert ("writing the new weights on both GPUs" in " ".join(log)) == peer_writes
    if kind is PeerCopyReduce:
        assert "copied to the other GPU by a copy engine" in " ".join(log)
    if isinstance(inboxes, str) and peer_writes:
        assert f"no peer copies: {inboxes}" in " ".join(log)

    # no armed backward since: the chosen strategy reduces after the backward again; chosen once
    red.reduce()
    assert reduced == buffers * 2 and red.strategy is chosen
    assert any(p._post_accumulate_grad_hooks for p in model.parameters()) == (kind is not ReduceAfterBackward)
    red.remove()
    assert not opt.sharded and not any(p._post_accumulate_grad_hooks for p in model.parameters())


def test_a_reduction_covers_the_buffers_it_was_set_up_for():
    red, opt, _, _, _ = _reduction()
    assert red.covers(opt.workspaces)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(8))]})
    assert not red.covers(opt.workspaces)  # the optimizer wrapper then sets up a new reduction


@pytest.mark.parametrize("when", ["before_the_first_update", "after_the_hooks"])
def test_reduce_after_backward_only_keeps_or_takes_back_the_whole_buffer_reduction(when, monkeypatch, log):
    """For a backward whose hooks do not run (the CUDA-graph step's replays): every update all-reduces the
    whole flat buffers after the backward and the optimizer state stays whole, whether the reduction is told
    before its first update or after it installed hooks and sharded the state (then it takes both back)."""
    _peer_stand_ins(monkeypatch, True, True)
    red, opt, ddp, model, reduced = _reduction(2, shard=True)
    buffers = [buf.grad.data_ptr() for ws in opt.workspaces for buf in ws.buffers]
    hooked = lambda: any(p._post_accumulate_grad_hooks for p in model.parameters())  # noqa: E731
    if when == "before_the_first_update":
        red.reduce_after_backward_only("replayed backward")
    red.reduce()
    assert opt.sharded == hooked() == (when == "after_the_hooks")
    if when == "after_the_hooks":
        red.reduce_after_backward_only("replayed backward")
    red.reduce_after_backward_only("replayed backward")  # said once
    assert isinstance(red.strategy, ReduceAfterBackward) and not opt.sharded and not hooked()
    said = [x for x in log if "gradients all-reduced after the backward pass" in x]
    assert said == ["ls_adam: gradients all-reduced after the backward pass, whole buffers (replayed backward); "
                    "optimizer state not sharded"]
    reduced.clear()
    ddp.accumulate_grads = True  # inside no_sync(): nothing happens
    red.reduce()
    assert reduced == []
    ddp.accumulate_grads = False
    red.reduce()
    assert reduced == buffers
