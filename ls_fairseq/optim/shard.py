"""This rank's share of ls_adam's optimizer state when it is sharded over the data-parallel ranks.

The sharded gradient reduction (:class:`~ls_fairseq.optim.reduction_strategies.ShardedReduceScatter`)
leaves on rank r the average of part r of every bucket (:meth:`~ls_fairseq.optim.buckets.Bucket.own`),
and :class:`~ls_fairseq.optim.adam.LSAdam` then reads and writes only those parts of its state.
:class:`Shard` records where they lie in each flat buffer, checked once to tile every buffer exactly (a
part missed or counted twice would leave weights that no rank updates, or two ranks that disagree).
"""

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ls_fairseq.optim.workspace import FlatBuffer


class Shard:
    """The parts rank ``rank`` of ``world_size`` owns of every bucket in ``buckets``, which must tile each
    of ``buffers`` exactly and split into equal parts.

    ``parts[id(buffer)]``: ``[(start, end, lo, hi)]``, one per bucket: the bucket's range and the owned part
    of it, in the order the step updates them (:meth:`order_by`). ``ranges[id(buffer)]``: the owned
    ``(lo, hi)`` in ascending order (one norm / one update call per buffer). ``peers`` (two ranks;
    :func:`~ls_fairseq.optim.peer.map_peer_weights`): ``{id(buffer): the other rank's copy of its weights}``,
    which the update writes too; ``flag`` is the one-element tensor whose all-reduce then ends a step.
    """

    __slots__ = ("rank", "world_size", "group", "parts", "ranges", "defer", "peers", "flag")

    def __init__(self, buckets: Sequence, rank: int, world_size: int, group, buffers: Sequence[FlatBuffer],
                 peers: Optional[Dict[int, torch.Tensor]] = None):
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"ls_adam: cannot shard over world size {world_size} as rank {rank}")
        parts: Dict[int, List[Tuple[int, int, int, int]]] = {}
        for bk in buckets:
            lo, hi = bk.own(rank, world_size)
            parts.setdefault(id(bk.buffer), []).append((bk.start, bk.end, lo, hi))
        by_key = {id(buf): buf for buf in buffers}
        if set(parts) != set(by_key):
            raise ValueError("ls_adam: the shard buckets do not cover exactly this optimizer's flat buffers")
        for key, ranges in parts.items():
            covered = sorted((s, e) for s, e, _, _ in ranges)
            ends = [0] + [e for _, e in covered]
            if [s for s, _ in covered] != ends[:-1] or ends[-1] != by_key[key].numel:
                raise ValueError("ls_adam: the shard buckets do not tile a flat buffer exactly")
            for s, e, lo, hi in ranges:
                if (e - s) != world_size * (hi - lo):
                    raise ValueError(f"ls_adam: bucket [{s}, {e}) does not split into {world_size} equal parts")
        if peers:
            if world_size != 2:
                raise ValueError(f"ls_adam: peer writes serve two ranks, not {world_size}")
            for key, t in peers.items():
                buf = by_key.get(key)
                if buf is None or t.shape != buf.param.shape or t.dtype != buf.param.dtype:
                    raise ValueError("ls_adam: a peer weight buffer does not match this optimizer's flat buffers")
        self.rank, self.world_size, self.group, self.parts = rank, world_size, group, parts
        self.ranges = {key: sorted((lo, hi) for _, _, lo, hi in ranges) for key, ranges in parts.items()}
        self.defer = False  # leave the step's all-gathers in flight (LSAdam.defer_gathers)
        self.peers = peers or None
        self.flag = None
        if self.peers:
            self.flag = torch.zeros(1, dtype=torch.int32, device=next(iter(self.peers.values())).device)

    def bucket_key(self, buf: FlatBuffer, offset: int):
        """The key ``(id(buf), start)`` of the bucket of ``buf`` that holds element ``offset``, or None."""
        for start, end, _, _ in self.parts.get(id(buf), ()):
            if start <= offset < end:
                return (id(buf), start)
        return None

    def order_by(self, need: Dict) -> None:
        """Update the buckets in the order of ``need[key]`` (smaller first; missing keys last) and leave
        their all-gathers in flight."""
        big = float("inf")
        for key_buf, ranges in self.parts.items():
            ranges.sort(key=lambda r, b=key_buf: (need.get((b, r[0]), big), r[0]))
        self.defer = True


__all__ = ["Shard"]
