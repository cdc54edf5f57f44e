"""Packed shape buckets for the CUDA-graph step: batches of real tokens only, grown to a few fixed sizes.

A packed batch (:mod:`ls_fairseq.fairseq_ext.packing`) lays the real tokens of its sentences back to back,
so its shape is (sentences, source tokens, target tokens, longest sentence): no position of it is padding.
For a CUDA graph it is grown to a :class:`PackedBucket` (``src_rows`` / ``tgt_rows``, ``max_len``,
``sentences``): the rows a batch does not fill become padding sentences that the loss never counts.
The buckets are planned from the epoch's batches with the padded planner's greedy merge
(:func:`ls_fairseq.fairseq_ext.graph.shape_buckets.merge_points`), weighing computed rows by the attention
length they are launched for. docs/graph_step.md ("Packed buckets") has the details.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ls_fairseq.fairseq_ext.graph.shape_buckets import distinct_points, merge_points

ROW_ALIGN = 16  # rows per side: a multiple of this (tensor-core GEMM tiles, FP8 GEMM row counts)
SENTENCE_ALIGN = 8
LENGTH_CLASSES = (32, 64, 128)  # the short-sequence kernels' classes; beyond: multiples of LONG_STEP
LONG_STEP = 128
ATTENTION_WEIGHT = 1.0 / 1024  # a computed row costs (1 + max_len * this): attention grows with the length


def length_class(n: int) -> int:
    """The attention length a sentence of ``n`` tokens is launched for."""
    for c in LENGTH_CLASSES:
        if n <= c:
            return c
    return -(-n // LONG_STEP) * LONG_STEP


def length_classes(n: np.ndarray) -> np.ndarray:
    """:func:`length_class` of every entry of the int array ``n``."""
    out = _up(n, LONG_STEP)
    for c in reversed(LENGTH_CLASSES):
        out = np.where(n <= c, c, out)
    return out


def _up(x, m):
    return -(-x // m) * m


@dataclass(frozen=True)
class PackedBucket:
    sentences: int
    src_rows: int
    tgt_rows: int
    max_len: int

    @property
    def tokens(self) -> int:
        """Rows computed by the encoder and the decoder."""
        return self.src_rows + self.tgt_rows

    @property
    def cost(self) -> float:
        """Computed rows weighed by the attention length they are launched for (the planner's cost)."""
        return _bucket_cost(self.src_rows, self.tgt_rows, self.max_len)

    def padding_sentences(self, src_tokens: int, tgt_tokens: int) -> int:
        """Sentences the rows a batch of ``src_tokens`` + ``tgt_tokens`` leaves free are split into."""
        L = self.max_len
        return max(-(-(self.src_rows - src_tokens) // L), -(-(self.tgt_rows - tgt_tokens) // L))

    def holds(self, sentences: int, src_tokens: int, tgt_tokens: int, longest: int) -> bool:
        if longest > self.max_len or src_tokens > self.src_rows or tgt_tokens > self.tgt_rows:
            return False
        extra_s = self.src_rows - src_tokens
        need_src = -(-(self.tgt_rows - tgt_tokens) // self.max_len)  # one source row per target padding sentence
        return extra_s >= need_src and sentences + self.padding_sentences(src_tokens, tgt_tokens) <= self.sentences


def batch_points(batches: Sequence[Sequence[int]], src_sizes, tgt_sizes) -> np.ndarray:
    """(sentences, source tokens, target tokens, longest sentence on either side) of every batch that is not
    empty: int64 [n, 4]."""
    src_sizes = np.asarray(src_sizes, dtype=np.int64)
    tgt_sizes = np.asarray(tgt_sizes, dtype=np.int64)
    batches = [b for b in batches if len(b)]
    if not batches:
        return np.zeros((0, 4), dtype=np.int64)
    sentences = np.array([len(b) for b in batches], dtype=np.int64)
    starts = np.cumsum(sentences) - sentences
    idx = np.concatenate(batches).astype(np.int64, copy=False)  # every batch's indices, one after the other
    s, t = src_sizes[idx], tgt_sizes[idx]
    longest = np.maximum.reduceat(np.maximum(s, t), starts)
    return np.stack([sentences, np.add.reduceat(s, starts), np.add.reduceat(t, starts), longest], axis=1)


def _cost(a):
    return (a[..., 1] + a[..., 2]) * (1.0 + a[..., 3] * ATTENTION_WEIGHT)


def _bucket_cost(src_rows: int, tgt_rows: int, max_len: int) -> float:
    return float(_cost(np.array([0, src_rows, tgt_rows, max_len])))


def _holding(buckets: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Which of the ``buckets`` (int [k, 4]: sentences, source rows, target rows, attention length) hold which
    of the ``points`` (int [n, 4]), as :meth:`PackedBucket.holds`: bool [n, k]."""
    n, s, t, m = (points[:, c, None] for c in range(4))
    B, S, T, L = buckets.T
    pad_s, pad_t = -(-(S - s) // L), -(-(T - t) // L)  # the padding sentences each side's free rows need
    return (m <= L) & (s <= S) & (t <= T) & (S - s >= pad_t) & (n + np.maximum(pad_s, pad_t) <= B)


def plan_packed(points: np.ndarray, max_buckets: int) -> List[PackedBucket]:
    """At most ``max_buckets`` packed buckets holding every batch of ``points`` (:func:`batch_points`), sorted by
    cost (computed rows weighed by their attention length)."""
    if max_buckets < 1:
        raise ValueError(f"the number of shape buckets must be >= 1, got {max_buckets}")
    pts = np.asarray(points, dtype=np.int64).reshape(-1, 4).copy()
    if len(pts) == 0:
        return []
    pts[:, 3] = length_classes(pts[:, 3])
    u, w = distinct_points(pts, slice(1, 3), ROW_ALIGN)  # the row counts rounded up
    kept = merge_points(u, w, max_buckets, _cost).astype(np.int64)
    # each batch goes to the cheapest bucket holding its rows and length; a bucket then gets the source rows
    # that give every target padding sentence of its batches a source row, and the sentences they need (their
    # own plus their padding sentences)
    kept = sorted({(int(r[1]), int(r[2]), int(r[3])) for r in kept}, key=lambda r: _bucket_cost(*r))
    S, T, L = np.array(kept, dtype=np.int64).T
    n, s, t, m = pts.T
    home = ((s[:, None] <= S) & (t[:, None] <= T) & (m[:, None] <= L)).argmax(axis=1)  # the first that holds it
    T_home, L_home = T[home], L[home]
    src_rows = S.copy()
    np.maximum.at(src_rows, home, s + -(-(T_home - t) // L_home))
    src_rows = _up(src_rows, ROW_ALIGN)
    sentences = np.ones(len(kept), dtype=np.int64)
    padding = np.maximum(-(-(src_rows[home] - s) // L_home), -(-(T_home - t) // L_home))
    np.maximum.at(sentences, home, n + padding)
    out = [PackedBucket(int(_up(b, SENTENCE_ALIGN)), int(sr), r[1], r[2])
           for b, sr, r in zip(sentences, src_rows, kept)]
    return sorted(out, key=lambda b: (_bucket_cost(b.src_rows, b.tgt_rows, b.max_len), b.sentences))


def choose_packed(buckets: Sequence[PackedBucket], sentences: int, src_tokens: int, tgt_tokens: int,
                  longest: int) -> Optional[PackedBucket]:
    """The cheapest bucket that holds the batch, or None."""
    for b in buckets:
        if b.holds(sentences, src_tokens, tgt_tokens, longest):
            return b
    return None


def packed_report(buckets: Sequence[PackedBucket], points: np.ndarray) -> Tuple[float, float, int]:
    """(extra rows computed over the real tokens, the same for the target side, as fractions; batches fitting
    no bucket) for the batches ``points``, each in the bucket :func:`choose_packed` gives it."""
    pts = np.asarray(points, dtype=np.int64).reshape(-1, 4)
    B = np.array([(b.sentences, b.src_rows, b.tgt_rows, b.max_len) for b in buckets], dtype=np.int64).reshape(-1, 4)
    holding = _holding(B, pts)
    held = holding.any(axis=1)
    home = B[holding.argmax(axis=1)] if len(B) else np.zeros_like(pts)  # the first bucket holding each batch
    s, t = pts[:, 1], pts[:, 2]
    rows_t = np.where(held, home[:, 2], t)  # a batch fitting no bucket counts its own rows
    rows = np.where(held, home[:, 1], s) + rows_t
    real, real_t = int((s + t).sum()), int(t.sum())
    return int(rows.sum()) / max(real, 1) - 1.0, int(rows_t.sum()) / max(real_t, 1) - 1.0, int((~held).sum())
