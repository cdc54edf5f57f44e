"""Shape buckets for the CUDA-graph step: a small set of (sentences, source length, target length)
shapes that every training batch of an epoch is padded up to.

A CUDA graph replays fixed shapes. fairseq's --max-tokens batches come in hundreds of distinct
shapes per epoch (almost every batch its own), so each batch is padded up to one of at most K
bucket shapes. The batches are known before training starts (fairseq freezes them once; epochs
only reorder them), so the buckets are chosen from the actual batch shapes: start with one bucket
per distinct shape and repeatedly merge the two buckets whose merge (their element-wise maximum)
adds the fewest computed tokens over the epoch, until K are left. Computed tokens of a batch in a
bucket (B, S, T) are B * (S + T): the encoder runs over B x S positions and the decoder over B x T.

Padding leaves the loss, the gradients and the logged statistics of the batch unchanged (see
:func:`pad_batch`): padded positions are padding tokens, which the attention masks and the loss
ignore, and padded sentences are one end-of-sentence source token with an all-padding target, so
their loss and every gradient through them are exactly zero.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

MAX_POINTS = 1500  # distinct shapes the merge starts from (quadratic memory): coarser lengths beyond
_MERGE_ROWS = 32  # rows of the merge's cost matrix computed at a time


@dataclass(frozen=True)
class Bucket:
    sentences: int
    src_len: int
    tgt_len: int

    @property
    def tokens(self) -> int:
        """Positions computed by the encoder and the decoder."""
        return self.sentences * (self.src_len + self.tgt_len)

    @property
    def cost(self) -> float:
        """What a batch of this bucket computes (the planner's cost: positions)."""
        return float(self.tokens)

    def holds(self, sentences: int, src_len: int, tgt_len: int) -> bool:
        return sentences <= self.sentences and src_len <= self.src_len and tgt_len <= self.tgt_len


def batch_shapes(batches: Sequence[Sequence[int]], src_sizes, tgt_sizes) -> np.ndarray:
    """(sentences, longest source, longest target) of every batch: int64 [n, 3]."""
    src_sizes = np.asarray(src_sizes)
    tgt_sizes = np.asarray(tgt_sizes)
    out = np.zeros((len(batches), 3), dtype=np.int64)
    for i, b in enumerate(batches):
        b = np.asarray(b, dtype=np.int64)
        if b.size:
            out[i] = (b.size, src_sizes[b].max(), tgt_sizes[b].max())
    return out[out[:, 0] > 0]


def _round_up(x, m):
    return (x + m - 1) // m * m


def distinct_points(shapes: np.ndarray, columns=slice(1, None), step: int = 1):
    """Distinct shapes and their counts; the ``columns`` (lengths or token counts) rounded up to multiples
    of ``step``, coarser ones until at most MAX_POINTS remain (very large corpora)."""
    while True:
        pts = shapes.copy()
        if step > 1:
            pts[:, columns] = _round_up(pts[:, columns], step)
        u, w = np.unique(pts, axis=0, return_counts=True)
        if len(u) <= MAX_POINTS:
            return u, w
        step *= 2


def merge_points(q: np.ndarray, w: np.ndarray, max_buckets: int, cost) -> np.ndarray:
    """Greedy merge of the points ``q`` (float [n, d], weights ``w`` [n]) down to ``max_buckets``: repeatedly
    the two whose merge (their element-wise maximum) adds the least ``w * cost(point)`` summed over the
    points. ``cost`` maps [..., d] to [...] point by point. Returns the surviving points [<= max_buckets, d].

    The added costs of all pairs are kept in a matrix; each merge takes its smallest entry (on a tie, the first
    row by row), and the point of its row takes in the point of its column. Each row also keeps its smallest
    entry and that entry's first column, so that a merge searches again only the rows whose smallest entry was
    in the column of one of the two points."""
    q = np.array(q, dtype=np.float64, order="F")  # each column contiguous: cost reads them one at a time
    w = w.astype(np.float64).copy()
    n = len(q)
    if n <= max_buckets:
        return q
    alive = np.ones(n, dtype=bool)
    own = w * cost(q)  # each point's cost; a merged-away point's is -inf, so that its entries are +inf
    delta = np.empty((n, n))
    for a in range(0, n, _MERGE_ROWS):  # a block of rows at a time: the [rows, n, d] maxima stay small
        b = min(a + _MERGE_ROWS, n)
        merged = np.maximum(q.T[:, a:b, None], q.T[:, None, :]).transpose(1, 2, 0)
        delta[a:b] = (w[a:b, None] + w[None, :]) * cost(merged) - own[a:b, None] - own[None, :]
    np.fill_diagonal(delta, np.inf)
    best = delta.argmin(axis=1)  # each row's smallest entry: its first column (-1: a merged-away point), its value
    best_cost = delta[np.arange(n), best]
    while n > max_buckets:
        i = int(best_cost.argmin())  # the first row holding the matrix's smallest entry
        j = int(best[i])
        q[i] = np.maximum(q[i], q[j])
        w[i] += w[j]
        alive[j] = False
        own[j] = -np.inf
        c = cost(np.maximum(q[i], q))
        own[i] = w[i] * c[i]
        row = (w[i] + w) * c - own[i] - own
        row[i] = np.inf
        delta[:, j] = np.inf  # row j is never read again
        delta[i, :] = row
        delta[:, i] = row
        best[j] = -1
        best_cost[j] = np.inf
        # the rows whose smallest entry was in column i or j (row i among them) are searched again; the others
        # compare it with their new entry in column i
        again = ((best == i) | (best == j)).nonzero()[0]
        lower = (row < best_cost) | ((row == best_cost) & (best > i))
        best[lower] = i
        best_cost[lower] = row[lower]
        best[again] = delta[again].argmin(axis=1)
        best_cost[again] = delta[again, best[again]]
        n -= 1
    return q[alive]


def plan_buckets(shapes: np.ndarray, max_buckets: int) -> List[Bucket]:
    """At most ``max_buckets`` bucket shapes covering every shape in ``shapes`` (int [n, 3]), chosen
    greedily to add the fewest computed tokens (module docstring). Sorted by computed tokens."""
    if max_buckets < 1:
        raise ValueError(f"the number of shape buckets must be >= 1, got {max_buckets}")
    shapes = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
    if len(shapes) == 0:
        return []
    q, w = distinct_points(shapes)
    kept = merge_points(q, w, max_buckets, lambda a: a[..., 0] * (a[..., 1] + a[..., 2]))
    out = [Bucket(*(int(v) for v in s)) for s in kept]
    return sorted(out, key=lambda b: (b.tokens, b.sentences, b.src_len, b.tgt_len))


def choose(buckets: Sequence[Bucket], sentences: int, src_len: int, tgt_len: int) -> Optional[Bucket]:
    """The bucket with the fewest computed tokens that holds the shape, or None."""
    for b in buckets:  # sorted by computed tokens
        if b.holds(sentences, src_len, tgt_len):
            return b
    return None


def plan_report(buckets: Sequence[Bucket], shapes: np.ndarray) -> Tuple[int, float, float]:
    """(distinct batch shapes, extra computed tokens over the batches as fairseq pads them, extra
    target positions alone), the extras as fractions, for ``shapes`` assigned by :func:`choose`."""
    shapes = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
    base = tgt_base = padded = tgt_padded = 0
    for s in shapes:
        b = choose(buckets, *(int(v) for v in s))
        if b is None:
            b = Bucket(*(int(v) for v in s))
        base += int(s[0] * (s[1] + s[2]))
        tgt_base += int(s[0] * s[2])
        padded += b.tokens
        tgt_padded += b.sentences * b.tgt_len
    distinct = len(np.unique(shapes, axis=0)) if len(shapes) else 0
    return distinct, padded / max(base, 1) - 1.0, tgt_padded / max(tgt_base, 1) - 1.0


# ------------------------------------------------------------------------------ padding a batch
def pad_batch(src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor, target: torch.Tensor,
              bucket: Bucket, pad: int, eos: int, left_pad_source: bool = True):
    """The batch padded to ``bucket``: (src_tokens [B', S'], src_lengths [B'], prev_output_tokens
    [B', T'], target [B', T']) on the host, int64.

    Source rows gain padding on their padded side (left by default: fairseq's positions count
    real tokens, so they do not move), targets gain padding on the right (after the last real
    token: the causal mask hides it from every real position). Added sentences are one
    end-of-sentence source token and an all-padding target: the loss counts none of their
    positions, so every gradient through them is zero."""
    B, S = src_tokens.shape
    T = prev_output_tokens.shape[1]
    if not bucket.holds(B, S, T) or target.shape != prev_output_tokens.shape:
        raise ValueError(f"batch of shape ({B}, {S}, {T}) does not fit the bucket {bucket}")
    Bb, Sb, Tb = bucket.sentences, bucket.src_len, bucket.tgt_len
    src = torch.full((Bb, Sb), pad, dtype=torch.int64)
    if left_pad_source:
        src[:B, Sb - S:] = src_tokens
        src[B:, Sb - 1] = eos
    else:
        src[:B, :S] = src_tokens
        src[B:, 0] = eos
    lengths = torch.ones(Bb, dtype=torch.int64)
    lengths[:B] = src_tokens.ne(pad).sum(1)
    prev = torch.full((Bb, Tb), pad, dtype=torch.int64)
    prev[:B, :T] = prev_output_tokens
    prev[B:, 0] = eos
    tgt = torch.full((Bb, Tb), pad, dtype=torch.int64)
    tgt[:B, :T] = target
    return src, lengths, prev, tgt
