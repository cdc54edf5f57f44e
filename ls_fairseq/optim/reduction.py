"""GradReduction: the one owner of the data-parallel gradient reduction of ls_adam.

Under ``--ddp-backend legacy_ddp`` ls_adam averages the gradients itself: the flat workspace holds them
in one buffer per dtype, so they are reduced in place, without the staging copies of fairseq's wrapper.
The optimizer asks only "reduce now, or wait for it" (:meth:`GradReduction.reduce`). What happens is
decided here, once, after the first update (docs/optimizer.md, section "Choosing the reduction").
Every rank takes the same decisions from the same inputs (the peer mappings vote), so every rank
issues the same collectives in the same order.
"""

import logging
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ls_fairseq.optim.buckets import bucket_order, shardable
from ls_fairseq.optim.gather_waits import GatherWaits
from ls_fairseq.optim.peer import map_peer_inboxes, map_peer_weights
from ls_fairseq.optim.reduction_strategies import (
    OverlappedAllReduce,
    PeerCopyReduce,
    ReduceAfterBackward,
    ReductionStrategy,
    ShardedReduceScatter,
)
from ls_fairseq.optim.workspace import FlatWorkspace

logger = logging.getLogger(__name__)


class GradReduction:
    """Average the gradients of ``optimizer`` (an :class:`~ls_fairseq.optim.adam.LSAdam`) over the ranks of
    ``ddp``, update after update.

    ``ddp``: fairseq's legacy DDP wrapper, or anything with its ``accumulate_grads`` (True inside
    ``no_sync()``), ``world_size``, ``process_group`` and ``module``. ``all_reduce(tensor)`` sums a tensor
    over those ranks in place. ``can_overlap``: whether ``process_group`` takes torch.distributed's
    asynchronous collectives (not under XLA). ``shard``: shard the optimizer state (True), only where the
    ranks write each other's weights ("p2p"), or not (False); read when the strategy is chosen.
    """

    def __init__(self, optimizer, ddp, all_reduce: Callable, can_overlap: bool, bucket_bytes: int, shard=False):
        self.optimizer = optimizer
        self.ddp = ddp
        self.workspaces = list(optimizer.workspaces)
        self._buffers = [buf for ws in self.workspaces for buf in ws.buffers]
        self.bucket_bytes = bucket_bytes
        self.shard = shard
        self.can_overlap = can_overlap
        self.strategy: ReductionStrategy = ReduceAfterBackward(self.workspaces, ddp.world_size, all_reduce)
        self._chosen = False
        self._gather_waits = None
        self.after_backward_only = None  # why every update reduces after the backward (None: the choice decides)

    def reduce(self) -> None:
        """``all_reduce_grads``: average this update's gradients, or make the stream wait for the average
        the backward started (the host does not wait)."""
        if self.ddp.accumulate_grads:
            return  # inside no_sync() (--update-freq): fairseq's wrapper waits too
        self.strategy.reduce()
        if not self._chosen:
            self._chosen = True
            self.strategy = self._choose()

    def reduce_after_backward_only(self, reason: str) -> None:
        """Reduce after the backward in every update from now on (one all-reduce per flat buffer), with
        the whole optimizer state on every rank: for a backward whose post-accumulate-grad hooks do not run
        (``reason``, logged once). Hooks already installed are taken off as :meth:`remove` does (collective
        where the state was sharded: every rank calls this at the same update)."""
        if self.after_backward_only is not None:
            return
        self.after_backward_only = reason
        if self._chosen and not isinstance(self.strategy, ReduceAfterBackward):
            after_backward = self.strategy.after_backward
            self.remove()
            self.strategy = after_backward
        logger.info("ls_adam: gradients all-reduced after the backward pass, whole buffers (%s)%s", reason,
                    "; optimizer state not sharded" if self.shard else "")

    def finish(self) -> None:
        """Close a round that a backward started and nobody waited for (an error between the backward and
        the step)."""
        self.strategy.finish()

    @property
    def in_flight(self) -> bool:
        return self.strategy.in_flight

    def covers(self, workspaces: Sequence[FlatWorkspace]) -> bool:
        """Whether this reduction was set up for exactly these workspaces' buffers."""
        return [buf for ws in workspaces for buf in ws.buffers] == self._buffers

    def remove(self) -> None:
        """Take the hooks off (after waiting for a round in flight) and keep the whole optimizer state on
        every rank again (collective; every rank removes its reduction at the same update)."""
        if self._gather_waits is not None:
            self._gather_waits.remove()
            self._gather_waits = None
        self.strategy.remove()
        if self.optimizer.sharded:
            self.optimizer.unshard_()

    # ------------------------------------------------------------------ the choice
    def _overlap_applies(self) -> bool:
        """Overlap needs two or more ranks, a group that takes asynchronous collectives and
        post-accumulate-grad hooks (torch >= 2.1) that run in the backward (not so for a replayed CUDA
        graph: :meth:`reduce_after_backward_only`)."""
        if self.after_backward_only is not None or self.ddp.world_size < 2:
            return False
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return False
        return self.can_overlap

    def _choose(self) -> ReductionStrategy:
        """The strategy of every update after the first (see the module docstring), set up: hooks, peer
        mappings (collective), sharded optimizer state, layer-by-layer waits."""
        after_backward = self.strategy
        if not self._overlap_applies():
            return after_backward
        ddp, world, group = self.ddp, self.ddp.world_size, self.ddp.process_group
        buckets = bucket_order(self.workspaces, self.bucket_bytes)
        shard, peers = self.shard, None
        if shard and not shardable(buckets, world):
            logger.info("ls_adam: optimizer state not sharded: the gradient buckets do not split into %d equal "
                        "parts (a world size that is a power of two does)", world)
            shard = False
        if shard:
            rank = dist.get_rank(group)
            only_p2p = shard == "p2p"
            peers = map_peer_weights(self.workspaces, rank, world, group,
                                     fallback="optimizer state not sharded" if only_p2p else
                                     "sharded weights are all-gathered")
            shard = not (only_p2p and peers is None)
        if not shard:
            strategy = OverlappedAllReduce(buckets, world, group, ddp, after_backward)
            self._log_overlap(strategy, "all-reduce")
            return strategy

        inboxes = map_peer_inboxes(self.workspaces, rank, world, group) if peers else None
        if isinstance(inboxes, str):
            logger.info("ls_adam: gradient parts reduce-scattered by NCCL (no peer copies: %s)", inboxes)
            inboxes = None
        if inboxes is None:
            strategy = ShardedReduceScatter(buckets, world, group, ddp, after_backward, rank)
        else:
            strategy = PeerCopyReduce(buckets, world, group, ddp, after_backward, rank, inboxes)
        self._log_overlap(strategy, "reduce-scatter")
        if inboxes is not None:
            logger.info("ls_adam: gradient parts copied to the other GPU by a copy engine (no NCCL reduce-scatter)")
        # the gradients of this update were all-reduced whole: its step may already be sharded
        self.optimizer.shard_(buckets, rank, world, group, peers=peers)
        logger.info("ls_adam: optimizer state sharded over %d ranks (Adam on 1/%d of it per rank, %s)", world, world,
                    "writing the new weights on both GPUs" if peers else "then an all-gather of the weights")
        if peers is None and getattr(ddp.module, "ls_gather_waits", False):
            self._gather_waits = GatherWaits(self.optimizer, ddp.module)
        return strategy

    def _log_overlap(self, strategy, collective: str) -> None:
        logger.info("ls_adam: gradient %s overlapped with the backward pass (%d buckets of ~%.1f MB, %s hooks)",
                    collective, len(strategy.buckets), self.bucket_bytes / 2**20,
                    "C++" if strategy.native_hooks else "Python")


__all__ = ["GradReduction"]
