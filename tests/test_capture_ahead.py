"""The order in which the CUDA-graph step captures buckets ahead of their first batch (while the GPU is busy):
every bucket the epoch's batches use, the most used first. The captures themselves:
tests/gpu/test_graph_step_gpu.py."""

from collections import Counter

import pytest

from ls_fairseq.fairseq_ext.graph_step import buckets_by_use
from ls_fairseq.fairseq_ext.packed_buckets import batch_points, choose_packed, packed_homes, plan_packed
from ls_fairseq.fairseq_ext.shape_buckets import batch_shapes, choose, plan_buckets
from test_graph_step import _wmt_like_shapes


@pytest.mark.parametrize("packed", [False, True])
def test_buckets_are_captured_ahead_most_used_first(packed):
    batches, src, tgt = _wmt_like_shapes(max_tokens=4096)
    if packed:
        rows, fits = batch_points(batches, src, tgt), choose_packed
        buckets = plan_packed(rows, 16)
    else:
        rows, fits = batch_shapes(batches, src, tgt), choose
        buckets = plan_buckets(rows, 16)
    used = Counter(fits(buckets, *map(int, r)) for r in rows)
    homes = packed_homes(buckets, rows) if packed else [buckets.index(fits(buckets, *map(int, r))) for r in rows]
    if packed:  # the vectorised search finds the bucket choose_packed finds
        assert [buckets[h] for h in homes] == [fits(buckets, *map(int, r)) for r in rows]
    order = buckets_by_use(buckets, homes)
    assert None not in used and len(order) == len(used) > 1 and set(order) == set(used)
    counts = [used[b] for b in order]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]
    # a bucket no batch uses is never captured ahead
    spare = buckets_by_use(buckets, list(homes[:3]) + [-1])
    assert 1 <= len(spare) <= 3 and set(spare) <= set(order)
