"""The CUDA-graph step over packed buckets, its CPU-side parts: the plan of packed buckets, growing a packing to
a bucket, and the split step over a packed bucket (what the graphs replay) against fairseq's criterion on the
batch as it came. The graphs themselves: tests/gpu/test_graph_step_gpu.py."""

import numpy as np
import pytest
import torch

from ls_fairseq.fairseq_ext.graph.packed_buckets import (PackedBucket, batch_points, choose_packed, length_class,
                                                   length_classes, packed_report, plan_packed)
from ls_fairseq.fairseq_ext.graph.shape_buckets import merge_points
from test_graph_step import _model_and_criterion, _sample, _wmt_like_shapes, check_split_step_equals_the_criterion
from _models import make_dict


def _points(max_tokens=4096):
    batches, src, tgt = _wmt_like_shapes(max_tokens=max_tokens)
    return batch_points(batches, src, tgt), batches, src, tgt


def test_batch_points_are_the_real_tokens_of_each_batch():
    pts, batches, src, tgt = _points()
    assert len(pts) == len(batches) and pts.dtype == np.int64
    for p, b in zip(pts, batches):
        b = np.asarray(b)
        assert p.tolist() == [b.size, src[b].sum(), tgt[b].sum(), max(src[b].max(), tgt[b].max())]
    # empty batches are left out; lists of indices work as well as arrays
    some = [[], list(map(int, batches[3])), np.array([], dtype=np.int64), batches[5]]
    assert batch_points(some, src, tgt).tolist() == pts[[3, 5]].tolist()
    assert batch_points([[]], src, tgt).shape == (0, 4)


def _plain_merge(q, w, max_buckets, cost):
    """The greedy merge of merge_points, the plain way: the whole matrix searched at every merge."""
    q, w = q.astype(np.float64).copy(), w.astype(np.float64).copy()
    alive = np.ones(len(q), dtype=bool)
    own = w * cost(q)
    delta = (w[:, None] + w[None, :]) * cost(np.maximum(q[:, None], q[None, :])) - own[:, None] - own[None, :]
    np.fill_diagonal(delta, np.inf)
    for _ in range(len(q) - max_buckets):
        i, j = divmod(int(np.argmin(delta)), len(q))
        q[i], w[i], alive[j] = np.maximum(q[i], q[j]), w[i] + w[j], False
        own[i] = w[i] * cost(q[i])
        row = (w[i] + w) * cost(np.maximum(q[i], q)) - own[i] - own
        row[~alive] = row[i] = np.inf
        delta[j, :] = delta[:, j] = np.inf
        delta[i, :] = delta[:, i] = row
    return q[alive]


@pytest.mark.parametrize("cost", [lambda a: (a[..., 1] + a[..., 2]) * (1.0 + a[..., 3] / 1024),  # the planners'
                                  lambda a: a[..., 0] * (a[..., 1] + a[..., 2]),
                                  lambda a: a.sum(-1),  # many ties
                                  lambda a: (a[..., 0] / 3 + a[..., 1] * 0.1) * np.sqrt(a[..., 2] + 0.7)])
def test_merge_points_equals_the_plain_greedy_merge(cost):
    """The same points in the same order, ties included (the first pair in the matrix row by row)."""
    rng = np.random.default_rng(0)
    for trial in range(40):
        n = int(rng.integers(1, 80))
        q = rng.integers(0, (3, 20, 1000)[trial % 3], (n, 4)).astype(np.float64)
        w = rng.integers(1, 5, n) if trial % 2 else rng.random(n) * 3
        for k in sorted({1, 2, max(1, n // 3), n, n + 1}):
            ours = merge_points(q, w, k, cost)
            assert ours.shape == (min(n, k), 4) and np.array_equal(ours, _plain_merge(q, w, k, cost)), (trial, k)


@pytest.mark.parametrize("k", [1, 8, 64])
def test_plan_holds_every_batch_and_computes_few_extra_rows(k):
    pts, *_ = _points()
    plan = plan_packed(pts, k)
    assert 1 <= len(plan) <= k
    for n, s, t, m in pts:
        b = choose_packed(plan, int(n), int(s), int(t), int(m))
        assert b is not None and b.holds(int(n), int(s), int(t), int(m))
        assert b.src_rows % 16 == 0 and b.tgt_rows % 16 == 0 and b.sentences % 8 == 0
    extra, extra_tgt, missing = packed_report(plan, pts)
    assert missing == 0
    if k == 64:  # the padded buckets compute 9-13% more positions than real tokens here; packed far fewer
        assert 0 < extra < 0.05 and 0 < extra_tgt < 0.06, (extra, extra_tgt)


def test_packed_report_counts_each_batch_in_the_bucket_choose_packed_gives_it():
    pts, *_ = _points()
    for plan in (plan_packed(pts, 8), plan_packed(pts[::3], 8), plan_packed(pts[:4], 3), []):
        real = real_t = rows = rows_t = missing = 0
        for n, s, t, m in pts.tolist():
            b = choose_packed(plan, n, s, t, m)
            missing += b is None
            real, real_t = real + s + t, real_t + t
            rows, rows_t = rows + (s + t if b is None else b.tokens), rows_t + (t if b is None else b.tgt_rows)
        assert packed_report(plan, pts) == (rows / real - 1.0, rows_t / real_t - 1.0, missing)
    assert packed_report(plan_packed(pts[::3], 8), pts)[2] > 0  # some batches fit none of those


def test_plan_keeps_short_sentences_out_of_long_buckets():
    """Batches of short sentences go to buckets sized for short attention (the kernels' own classes),
    not to a bucket of 200-token sentences with the same row count."""
    pts = np.array([[100, 1500, 1600, 15]] * 20 + [[8, 1500, 1600, 200]] * 20)
    plan = plan_packed(pts, 2)
    assert sorted(b.max_len for b in plan) == [32, 256]
    assert choose_packed(plan, 100, 1500, 1600, 15).max_len == 32


def test_length_classes():
    assert [length_class(n) for n in (1, 32, 33, 64, 65, 128, 129, 256, 257)] == [32, 32, 64, 64, 128, 128, 256,
                                                                                   256, 384]
    n = np.arange(1, 1000)
    assert length_classes(n).tolist() == [length_class(int(v)) for v in n]


def test_a_bucket_holds_a_batch_only_with_room_for_its_padding_sentences():
    b = PackedBucket(sentences=8, src_rows=64, tgt_rows=64, max_len=32)
    assert b.padding_sentences(30, 40) == 2  # 34 source rows and 24 target rows in sentences of <= 32
    assert b.holds(6, 30, 40, 20) and not b.holds(7, 30, 40, 20)
    assert not b.holds(2, 30, 40, 33)  # a longer sentence than the bucket's attention is sized for
    assert not b.holds(2, 63, 0, 10)  # 64 target padding rows (2 sentences) but 1 source row for them


# ----------------------------------------------------------------------------- growing a packing
def test_pad_packing_splits_the_added_rows_into_short_sentences():
    from ls_fairseq.fairseq_ext.packing import pack_batch, pad_packing

    d = make_dict()
    s = _sample(d, [4, 6, 2], [5, 3, 6])
    net, tgt = s["net_input"], s["target"]
    rows = tgt.ne(d.pad()).reshape(-1).nonzero().squeeze(1)
    packed = pack_batch(net["src_tokens"], net["prev_output_tokens"], tgt, rows, d.pad())
    grown = pad_packing(packed, 32, 30, 10, d.pad(), max_len=6)
    # 20 source rows in 4 sentences (5 each), 16 target rows in 4 (4 each); 3 entries left empty
    assert grown["cu_src"].tolist() == [0, 4, 10, 12, 17, 22, 27, 32, 32, 32, 32]
    assert grown["cu_tgt"].tolist() == [0, 5, 8, 14, 18, 22, 26, 30, 30, 30, 30]
    assert grown["max_src"] == 6 and grown["max_tgt"] == 6
    assert grown["src_tokens"][0, 12:].eq(d.pad()).all() and grown["tgt_tokens"][0, 14:].eq(d.pad()).all()
    with pytest.raises(ValueError, match="does not fit"):
        pad_packing(packed, 32, 30, 6, d.pad(), max_len=6)  # 3 + 4 sentences
    with pytest.raises(ValueError, match="source rows"):
        pad_packing(packed, 13, 30, 10, d.pad(), max_len=6)  # one added source row for 3 target sentences


# ----------------------------------------------------------------------------- the split step
@pytest.mark.parametrize("normalize_before", [False, True])
@pytest.mark.parametrize("bucket", [PackedBucket(3, 12, 14, 6), PackedBucket(16, 48, 40, 8),
                                    PackedBucket(8, 32, 32, 32)])
def test_split_step_on_a_packed_bucket_equals_the_criterion_on_the_batch(bucket, normalize_before):
    check_split_step_equals_the_criterion(bucket, normalize_before)


def test_split_step_fails_when_the_padding_rows_join_a_sentence(monkeypatch):
    """The exactness test can fail: padding rows made of words and given to the last real sentence (its
    offsets moved) change the loss."""
    from ls_fairseq.fairseq_ext.graph import split_step as ss

    d = make_dict()
    m, crit = _model_and_criterion(d)
    sample = _sample(d, [4, 6, 2], [5, 3, 6])
    loss, _, _ = crit(m, sample)
    real = ss.packed_inputs

    def leaky(packed, bucket, pad):
        p = real(packed, bucket, d.index("w7"))
        p["cu_src"][3] = p["cu_src"][4]  # the first padding sentence's source rows join sentence 2
        return p

    monkeypatch.setattr(ss, "packed_inputs", leaky)
    loss2, _, _ = ss.split_step(m, crit, sample, PackedBucket(8, 32, 32, 32), d.pad(), d.eos())
    assert not torch.allclose(loss2, loss, rtol=1e-6)
