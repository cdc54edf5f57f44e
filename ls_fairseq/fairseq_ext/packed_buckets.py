"""Packed shape buckets for the CUDA-graph step: batches of real tokens only, grown to a few fixed sizes.

A packed batch (:mod:`ls_fairseq.fairseq_ext.packing`) lays the real tokens of its sentences back to back,
so its shape is (sentences, source tokens, target tokens, longest sentence) instead of (sentences, longest
source, longest target): no position of it is padding. For a CUDA graph it is grown to a bucket:

- ``src_rows`` / ``tgt_rows``: the rows the graphs compute on each side (multiples of ROW_ALIGN). The rows a
  batch does not fill become padding sentences of at most ``max_len`` tokens each (so they never raise the
  longest length the attention kernels are launched for); every padding sentence has at least one source row,
  so no query of the cross-attention is left without keys. Their target rows are never counted by the loss:
  their gradient, and every gradient through them, is zero.
- ``max_len``: the longest sentence the attention calls are sized for (both sides), a LENGTH_CLASSES entry: up
  to 128 tokens the short-sequence kernels, one launch per class of lengths (ls_fairseq.ops.attention).
- ``sentences``: the entries of the offsets (real sentences, then the padding sentences, then empty ones).

The buckets are planned from the epoch's batches (fairseq freezes them once) with the padded planner's greedy
merge (:func:`ls_fairseq.fairseq_ext.shape_buckets.merge_points`), weighing computed rows by the attention
length they are launched for, so that short sentences stay in buckets of their own length.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from ls_fairseq.fairseq_ext.shape_buckets import distinct_points, merge_points

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
    """(sentences, source tokens, target tokens, longest sentence on either side) of every batch: int64 [n, 4]."""
    src_sizes = np.asarray(src_sizes, dtype=np.int64)
    tgt_sizes = np.asarray(tgt_sizes, dtype=np.int64)
    out = np.zeros((len(batches), 4), dtype=np.int64)
    for i, b in enumerate(batches):
        b = np.asarray(b, dtype=np.int64)
        if b.size:
            s, t = src_sizes[b], tgt_sizes[b]
            out[i] = (b.size, s.sum(), t.sum(), max(s.max(), t.max()))
    return out[out[:, 0] > 0]


def _cost(a):
    return (a[..., 1] + a[..., 2]) * (1.0 + a[..., 3] * ATTENTION_WEIGHT)


def _bucket_cost(src_rows: int, tgt_rows: int, max_len: int) -> float:
    return float(_cost(np.array([0, src_rows, tgt_rows, max_len])))


def plan_packed(points: np.ndarray, max_buckets: int) -> List[PackedBucket]:
    """At most ``max_buckets`` packed buckets holding every batch of ``points`` (:func:`batch_points`), sorted by
    cost (computed rows weighed by their attention length)."""
    if max_buckets < 1:
        raise ValueError(f"the number of shape buckets must be >= 1, got {max_buckets}")
    pts = np.asarray(points, dtype=np.int64).reshape(-1, 4).copy()
    if len(pts) == 0:
        return []
    pts[:, 3] = [length_class(int(m)) for m in pts[:, 3]]
    u, w = distinct_points(pts, slice(1, 3), ROW_ALIGN)  # the row counts rounded up
    kept = merge_points(u, w, max_buckets, _cost).astype(np.int64)
    # each batch goes to the cheapest bucket holding its rows and length; a bucket then gets the source rows
    # that give every target padding sentence of its batches a source row, and the sentences they need (their
    # own plus their padding sentences)
    kept = sorted({(int(r[1]), int(r[2]), int(r[3])) for r in kept}, key=lambda r: _bucket_cost(*r))
    homes = [next(r for r in kept if s <= r[0] and t <= r[1] and L <= r[2]) for _, s, t, L in pts]
    src_rows = {r: r[0] for r in kept}
    for (_, s, t, _), r in zip(pts, homes):
        src_rows[r] = max(src_rows[r], s + -(-(r[1] - t) // r[2]))
    src_rows = {r: _up(v, ROW_ALIGN) for r, v in src_rows.items()}
    sentences = {r: 1 for r in kept}
    for (n, s, t, _), r in zip(pts, homes):
        b = PackedBucket(0, src_rows[r], r[1], r[2])
        sentences[r] = max(sentences[r], int(n) + b.padding_sentences(int(s), int(t)))
    out = [PackedBucket(_up(sentences[r], SENTENCE_ALIGN), src_rows[r], r[1], r[2]) for r in kept]
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
    no bucket) for the batches ``points``."""
    real = real_t = rows = rows_t = 0
    missing = 0
    for n, s, t, m in np.asarray(points, dtype=np.int64).reshape(-1, 4):
        b = choose_packed(buckets, int(n), int(s), int(t), int(m))
        real += int(s + t)
        real_t += int(t)
        if b is None:
            missing += 1
            rows += int(s + t)
            rows_t += int(t)
        else:
            rows += b.tokens
            rows_t += b.tgt_rows
    return rows / max(real, 1) - 1.0, rows_t / max(real_t, 1) - 1.0, missing
