"""The buckets of the overlapped gradient reduction (:mod:`ls_fairseq.optim.overlap`).

Each flat gradient buffer of a :class:`~ls_fairseq.optim.workspace.FlatWorkspace` is cut into
contiguous :class:`Bucket` ranges of about ``bucket_bytes`` at parameter boundaries, from the end of
the buffer (:func:`plan_buckets`), since the backward produces the last layers' gradients first;
:func:`bucket_order` puts the buckets of all buffers in one launch order, and :func:`shardable` says
whether every bucket splits into equal, aligned parts, one per rank, for sharded optimizer state.
"""

from typing import Dict, List, Sequence, Tuple

from ls_fairseq.optim.workspace import FlatBuffer, FlatWorkspace

DEFAULT_BUCKET_MB = 25


class Bucket:
    """One contiguous range ``[start, end)`` of a flat gradient buffer and the parameters in it."""

    __slots__ = ("buffer", "start", "end", "members", "flat")

    def __init__(self, buffer: FlatBuffer, start: int, end: int, members: List[int]):
        self.buffer = buffer
        self.start, self.end = start, end
        self.members = members  # parameter indices in ``buffer``, last in layout first
        self.flat = buffer.grad[start:end]

    def own(self, rank: int, world_size: int) -> Tuple[int, int]:
        """The range ``[lo, hi)`` of the flat buffer that ``rank`` owns when the bucket is sharded."""
        part = (self.end - self.start) // world_size
        lo = self.start + rank * part
        return lo, lo + part

    def __repr__(self):
        return f"Bucket({self.buffer.dtype}, [{self.start}, {self.end}), params {self.members})"


def plan_buckets(buf: FlatBuffer, bucket_bytes: int) -> List[Bucket]:
    """Cut ``buf``'s flat gradient into contiguous buckets of at least ``bucket_bytes`` (the last
    one may be smaller), at parameter boundaries, starting from the end of the buffer.

    The buckets tile ``[0, buf.numel)`` exactly once, padding included: bucket 0 ends at
    ``buf.numel``, each next one ends where the previous one starts, the last starts at 0.
    """
    cap = max(1, int(bucket_bytes) // buf.grad.element_size())
    buckets, members, end = [], [], buf.numel
    for i in reversed(range(len(buf.params))):
        members.append(i)
        start = buf.offsets[i][0]
        if end - start >= cap or i == 0:
            buckets.append(Bucket(buf, start, end, members))
            members, end = [], start
    return buckets


def bucket_order(workspaces: Sequence[FlatWorkspace], bucket_bytes: int) -> List[Bucket]:
    """All buckets of all buffers in launch order: the bucket whose first parameter comes latest
    in the optimizer's parameter order goes first (within one buffer: reverse layout order)."""
    position: Dict[int, int] = {}
    for ws in workspaces:
        for p in ws.params:
            position.setdefault(id(p), len(position))
    buckets = [bk for ws in workspaces for buf in ws.buffers for bk in plan_buckets(buf, bucket_bytes)]
    buckets.sort(key=lambda bk: -position[id(bk.buffer.params[bk.members[-1]])])
    return buckets


# the smallest part of a sharded bucket, in elements: keeps every part 16-byte aligned for the
# vectorised kernels (parameters start on 256-byte boundaries, so bucket lengths are multiples of it)
SHARD_ALIGN_ELEMENTS = 8


def shardable(buckets: Sequence[Bucket], world_size: int) -> bool:
    """Whether every bucket splits into ``world_size`` equal parts of a multiple of
    :data:`SHARD_ALIGN_ELEMENTS` elements (true for world sizes that are powers of two up to 8, up
    to 16 for fp16 / bf16 buffers)."""
    return world_size >= 2 and all((bk.end - bk.start) % (world_size * SHARD_ALIGN_ELEMENTS) == 0 for bk in buckets)
