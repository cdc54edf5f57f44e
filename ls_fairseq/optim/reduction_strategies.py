"""The ways :class:`~ls_fairseq.optim.reduction.GradReduction` averages the gradients over the ranks.
Each is a small object with one interface (:class:`ReductionStrategy`): ``reduce()`` when the optimizer
wants this update's average, ``finish()`` to close what a backward started, ``remove()`` to take its hooks
off. Each does its own collectives, in place on the flat gradient buffers of a FlatWorkspace:

* :class:`ReduceAfterBackward`: one all-reduce per flat buffer once the backward is over;
* :class:`OverlappedAllReduce`: buckets of the buffers all-reduced while the backward runs;
* :class:`ShardedReduceScatter`: buckets reduce-scattered while the backward runs (each rank receives the
  average of its own part only: ls_adam's state is sharded);
* :class:`PeerCopyReduce`: the same on two GPUs that map each other's memory, by copy engines.

The last three share :class:`~ls_fairseq.optim.overlap.OverlappedReducer` and differ only in the collective
of a complete bucket (``_launch``) and what follows the round's collectives (``_settle``). Every element is
divided by the world size before it is summed over the ranks, so the overlapped reduction's averages equal
those after the backward bit for bit.
"""

from typing import Callable, Dict, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

from ls_fairseq.optim.buckets import Bucket, shardable
from ls_fairseq.optim.overlap import OverlappedReducer
from ls_fairseq.optim.workspace import FlatWorkspace


class ReductionStrategy(Protocol):
    """What :class:`~ls_fairseq.optim.reduction.GradReduction` asks of a strategy."""

    in_flight: bool  # a backward started collectives that finish() has not waited for

    def reduce(self) -> None:
        """This update's gradients, averaged: wait for what the backward started, or reduce them now."""

    def finish(self) -> bool:
        """Wait for the collectives a backward started; False when none did."""

    def remove(self) -> None:
        """Take the hooks off (after finish())."""


class ReduceAfterBackward:
    """One all-reduce per flat gradient buffer after the backward. It serves the first update (the
    hooks of the others are set up after it), every update where the reduction cannot overlap the
    backward (one process, XLA, no post-accumulate-grad hooks, the CUDA-graph step's replays), and
    the overlapped strategies for an update whose backward did not arm them.

    ``all_reduce(tensor)`` sums a tensor over the ranks in place (fairseq's, which also serves XLA)."""

    in_flight = False

    def __init__(self, workspaces: Sequence[FlatWorkspace], world_size: int, all_reduce: Callable):
        self.workspaces = list(workspaces)
        self.world_size = world_size
        self.all_reduce = all_reduce

    @torch.no_grad()
    def reduce(self) -> None:
        """Divide each flat gradient buffer by the world size first (as fairseq's DDP wrappers do, which
        also keeps fp16 sums in range), then sum it over the ranks."""
        for ws in self.workspaces:
            ws.sync()
            for buf in ws.buffers:
                if self.world_size > 1:
                    buf.grad.div_(self.world_size)
                self.all_reduce(buf.grad)

    def finish(self) -> bool:
        return False  # nothing runs during the backward

    def remove(self) -> None:
        pass


class OverlappedAllReduce(OverlappedReducer):
    """Each complete bucket goes out as an asynchronous ``all_reduce(SUM)`` while the backward runs:
    every rank ends with the whole average."""

    def _launch(self, n: int):
        return dist.all_reduce(self.buckets[n].flat, group=self.group, async_op=True)


class ShardedReduceScatter(OverlappedReducer):
    """Each bucket is split into ``world_size`` equal parts and rank ``rank`` owns part ``rank``
    (:meth:`~ls_fairseq.optim.buckets.Bucket.own`). A complete bucket goes out as a
    ``reduce_scatter(SUM)`` in place: only the owned part receives the average, which is all that the
    sharded :class:`~ls_fairseq.optim.adam.LSAdam` reads when it updates that part and all-gathers (or
    peer-writes) the weights afterwards. It moves half the bytes of an all-reduce while the backward runs.
    The buckets must split evenly (:func:`~ls_fairseq.optim.buckets.shardable`)."""

    def __init__(self, buckets: Sequence[Bucket], world_size: int, group, arm, after_backward, rank: int):
        if not shardable(buckets, world_size):
            raise ValueError(f"overlapped reduce-scatter: the buckets do not split into {world_size} equal, "
                             "aligned parts (see shardable())")
        super().__init__(buckets, world_size, group, arm, after_backward)
        self.rank = rank
        self.owned = [bk.buffer.grad[slice(*bk.own(rank, world_size))] for bk in self.buckets]

    def _launch(self, n: int):
        return dist.reduce_scatter_tensor(self.owned[n], self.buckets[n].flat, group=self.group, async_op=True)


class PeerCopyReduce(ShardedReduceScatter):
    """The sharded reduction on two ranks whose GPUs map each other's memory, without NCCL in the backward.

    Each complete bucket's part that the other rank owns is copied into that rank's "inbox" by a copy
    engine, from a stream of this strategy's own. ``inboxes``: ``{id(flat buffer): (this rank's inbox,
    the other rank's inbox as addressable from this device, an object to keep alive with them or None)}``,
    gradient-sized tensors (:func:`~ls_fairseq.optim.peer.map_peer_inboxes`). :meth:`finish` waits for
    both ranks' copies (a one-element all-reduce: each rank enters it after its own copies) and adds the
    inbox to the owned parts.

    Why: NCCL's kernels wait on the GPU for the other rank's matching call, holding SMs that the
    backward's kernels need while they wait, which slows the backward (benchmarks/RESULTS.md, section
    'scaling'); a copy engine holds none. The sums are those of the reduce-scatter.

    Rounds alternate between two halves of the inbox (the part this rank owns, and the other, otherwise
    unused), so a rank's copies never overwrite what the other has not added yet: its copies of round
    k + 2 follow its all-reduce of round k + 1, which the other rank enters after its additions of round
    k. CPU tensors (tests with gloo and shared memory) are copied synchronously, without a stream."""

    def __init__(self, buckets: Sequence[Bucket], world_size: int, group, arm, after_backward, rank: int,
                 inboxes: Dict[int, Tuple[torch.Tensor, torch.Tensor, object]]):
        if world_size != 2:
            raise ValueError("peer copies: the reduction must be sharded over two ranks")
        buffers = {id(bk.buffer): bk.buffer for bk in buckets}
        if set(inboxes) != set(buffers):
            raise ValueError(f"peer copies: {len(inboxes)} inboxes for {len(buffers)} flat gradient buffers")
        for key, (mine, theirs, _) in inboxes.items():
            grad = buffers[key].grad
            for t in (mine, theirs):
                if t.shape != grad.shape or t.dtype != grad.dtype or t.device != grad.device:
                    raise ValueError("peer copies: an inbox must match its flat gradient buffer")
        super().__init__(buckets, world_size, group, arm, after_backward, rank)
        # per round parity (even rounds use the receiver's own range of its inbox, odd rounds the other):
        # incoming[parity][n] = what the other rank copied for our part of bucket n;
        # outgoing[parity][n] = (where our copy of its part goes, that part)
        peer = 1 - rank
        self._incoming, self._outgoing = ([], []), ([], [])
        for bk in self.buckets:
            mine, theirs, _ = inboxes[id(bk.buffer)]
            olo, ohi = bk.own(rank, 2)
            plo, phi = bk.own(peer, 2)
            self._incoming[0].append(mine[olo:ohi])
            self._incoming[1].append(mine[plo:phi])
            self._outgoing[0].append((theirs[plo:phi], bk.buffer.grad[plo:phi]))
            self._outgoing[1].append((theirs[olo:ohi], bk.buffer.grad[plo:phi]))
        self._keep = [keep for _, _, keep in inboxes.values()]
        device = self.buckets[0].buffer.grad.device
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.rounds = 0  # rounds received (their parity picks the inbox half)

    def _launch(self, n: int):
        """Copy bucket ``n``'s part of the other rank into its inbox (after the work queued so far)."""
        dst, src = self._outgoing[self.rounds % 2][n]
        if self._stream is None:
            dst.copy_(src)
            return None
        self._stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src)
        return None

    def _settle(self) -> None:
        """Wait (on the GPU) until both ranks' copies are done, then add the inbox to the owned parts. This
        rank's copies are on its copy stream, which the current stream waits for before it enters a
        one-element all-reduce; the other rank enters it after its own copies. So past it this round's
        half of the inbox holds the other rank's parts of this update."""
        if self._stream is not None:
            torch.cuda.current_stream(self._flag.device).wait_stream(self._stream)
        dist.all_reduce(self._flag, group=self.group)
        torch._foreach_add_(self.owned, self._incoming[self.rounds % 2])
        self.rounds += 1


__all__ = ["OverlappedAllReduce", "PeerCopyReduce", "ReduceAfterBackward", "ReductionStrategy",
           "ShardedReduceScatter"]
