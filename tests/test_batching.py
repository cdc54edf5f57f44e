"""Grouped shuffling (ls_fairseq/fairseq_ext/step/batching.py): the batches of one update are
neighbours in fairseq's length-sorted order, on every rank and every micro-batch.

Checked on fairseq's own EpochBatchIterator over a dataset whose batch k stands for the k-th
shortest batch, then end to end: two gloo ranks of lightseq-train --grouped-shuffling train
exactly like one process with --update-freq 2 --grouped-shuffling."""

import os

import pytest
import torch

from _models import lightseq_train_two_ranks
from test_end_to_end import TRAIN_FLAGS, _params, inner_by_update, train

from ls_fairseq.fairseq_ext.step.batching import (
    GroupedShuffleEpochBatchIterator,
    group_batches_by_update,
    grouped_order,
)


def _cyclic_run(positions, n):
    """Whether ``positions`` are consecutive batches of the sorted list, wrapping from the last to the first."""
    return all((b - a) % n == 1 for a, b in zip(positions, positions[1:]))


@pytest.mark.parametrize("n", [1, 2, 5, 17, 40])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_grouped_order_keeps_whole_groups_and_loses_no_batch(n, group):
    for seed in range(5):
        order = grouped_order(n, group, seed)
        assert sorted(order) == list(range(n))
        full = n // group
        for g in range(full):
            assert _cyclic_run(order[g * group:(g + 1) * group], n), (order, g)
        assert _cyclic_run(order[full * group:], n)  # the incomplete group, last


def test_grouped_order_is_seeded_and_moves_its_boundaries():
    assert grouped_order(50, 4, 7) == grouped_order(50, 4, 7)
    # the first batch of each group: the boundaries move with the epoch seed
    offsets = {min(grouped_order(50, 4, seed)[0:4]) % 4 for seed in range(40)}
    assert len(offsets) > 1
    orders = {tuple(grouped_order(50, 4, seed)) for seed in range(10)}
    assert len(orders) == 10


def test_grouped_order_rejects_an_empty_group():
    with pytest.raises(ValueError, match="at least one batch"):
        grouped_order(10, 0, 1)
    assert grouped_order(0, 3, 1) == []


class _Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


def _iterator(num_batches, num_shards, shard_id, update_freq, grouped=True, epoch=1, **kw):
    from fairseq.data.iterators import EpochBatchIterator

    # batch k holds item k: "the k-th shortest batch"
    itr = EpochBatchIterator(_Items(num_batches), collate_fn=lambda xs: xs[0] if xs else None,
                             batch_sampler=[[k] for k in range(num_batches)], seed=3,
                             num_shards=num_shards, shard_id=shard_id, epoch=epoch, **kw)
    return group_batches_by_update(itr, update_freq) if grouped else itr


def _epoch(itr, **kw):
    return list(itr.next_epoch_itr(**kw))


def _updates(num_batches, ranks, update_freq, epoch_count=2):
    """Per epoch, the list of updates, each the sorted batch ids of all ranks and micro-batches."""
    itrs = [_iterator(num_batches, ranks, r, [update_freq]) for r in range(ranks)]
    out = []
    for _ in range(epoch_count):
        per_rank = [_epoch(it) for it in itrs]
        steps = len(per_rank[0])
        assert all(len(p) == steps for p in per_rank)  # fairseq pads short ranks with empty batches
        ups = []
        for u in range(0, steps, update_freq):
            ups.append(sorted(b for p in per_rank for b in p[u:u + update_freq] if b is not None))
        out.append(ups)
    return out


@pytest.mark.parametrize("ranks,update_freq", [(2, 1), (2, 2), (3, 1), (4, 1)])
def test_every_update_gets_neighbouring_batches_on_all_ranks(ranks, update_freq):
    n = 41
    for ups in _updates(n, ranks, update_freq):
        seen = [b for u in ups for b in u]
        assert sorted(seen) == list(range(n))  # no batch lost, none twice
        not_neighbours = [u for u in ups if not _cyclic_run(u, n)]
        # only the group that wraps from the longest to the shortest batches mixes lengths
        assert len(not_neighbours) <= 1, not_neighbours
        if not_neighbours:
            assert min(not_neighbours[0]) == 0 and max(not_neighbours[0]) == n - 1


def test_plain_shuffle_puts_unrelated_batches_together():
    """The problem grouped shuffling solves: fairseq's shuffle pairs any two batches."""
    n = 41
    itrs = [_iterator(n, 2, r, [1], grouped=False) for r in range(2)]
    a, b = (_epoch(it) for it in itrs)
    gaps = [abs(x - y) for x, y in zip(a, b) if x is not None and y is not None]
    assert max(gaps) > 10


@pytest.mark.parametrize("ranks,update_freq", [(2, 1), (2, 2)])
def test_one_rank_with_more_micro_batches_sees_the_same_updates(ranks, update_freq):
    one = _updates(33, 1, ranks * update_freq)
    many = _updates(33, ranks, update_freq)
    assert one == many


def test_a_group_of_one_batch_is_fairseqs_own_shuffle():
    ours, theirs = _iterator(30, 1, 0, [1]), _iterator(30, 1, 0, [1], grouped=False)
    assert isinstance(ours, GroupedShuffleEpochBatchIterator)
    for _ in range(2):
        assert _epoch(ours) == _epoch(theirs)


def test_update_freq_per_epoch_follows_fairseqs_list():
    itr = _iterator(24, 1, 0, [2, 4])
    first, second, third = (_epoch(itr) for _ in range(3))
    for order, g in ((first, 2), (second, 4), (third, 4)):
        for k in range(0, 24 - 24 % g, g):
            assert _cyclic_run(order[k:k + g], 24), (g, order)


def test_resume_in_the_middle_of_an_epoch_continues_the_same_batches():
    itr = _iterator(29, 2, 1, [2])
    _epoch(itr)
    full = list(itr.next_epoch_itr())  # epoch 2 from the start
    itr2 = _iterator(29, 2, 1, [2])
    _epoch(itr2)
    live = itr2.next_epoch_itr()
    head = [next(live) for _ in range(5)]
    state = itr2.state_dict()
    resumed = _iterator(29, 2, 1, [2])
    resumed.load_state_dict(state)
    assert head + list(resumed.next_epoch_itr()) == full


def test_unshuffled_or_pinned_batches_keep_fairseqs_order():
    ours, theirs = _iterator(20, 2, 0, [1]), _iterator(20, 2, 0, [1], grouped=False)
    assert _epoch(ours, shuffle=False) == _epoch(theirs, shuffle=False)


def test_other_iterators_are_left_alone(caplog):
    from fairseq.data.iterators import GroupedEpochBatchIterator

    itr = GroupedEpochBatchIterator.__new__(GroupedEpochBatchIterator)
    with caplog.at_level("WARNING"):
        assert group_batches_by_update(itr, [1]) is itr
    assert type(itr) is GroupedEpochBatchIterator
    assert "left to fairseq" in caplog.text
    with pytest.raises(ValueError, match="update-freq"):
        group_batches_by_update(_iterator(4, 1, 0, [1], grouped=False), [0])


_RANK_FLAGS = ["--dropout", "0", "--max-update", "8", "--log-interval", "1"]


def test_two_ranks_train_like_one_process_with_update_freq_2(data_bin, tmp_path):
    """lightseq-train --grouped-shuffling on two gloo processes and on one process with
    --update-freq 2 takes the same updates (same losses, same weights)."""
    save2 = str(tmp_path / "two")
    two = lightseq_train_two_ranks(data_bin, save2, tmp_path, [*TRAIN_FLAGS, *_RANK_FLAGS, "--grouped-shuffling"])
    one = inner_by_update(train(data_bin, str(tmp_path / "one"), *_RANK_FLAGS, "--update-freq", "2",
                                "--grouped-shuffling"))
    assert sorted(one) == sorted(two) == list(range(1, 9))
    for u in one:
        for k in ("loss", "nll_loss", "wpb", "bsz"):
            assert float(one[u][k]) == pytest.approx(float(two[u][k]), rel=2e-3, abs=2e-3), (u, k, one[u], two[u])
    # without grouping the same single process takes other updates after the first epoch
    plain = inner_by_update(train(data_bin, str(tmp_path / "plain"), *_RANK_FLAGS, "--update-freq", "2"))
    assert [plain[u]["bsz"] for u in plain] != [one[u]["bsz"] for u in one]
    p1 = _params(os.path.join(tmp_path, "one", "checkpoint_last.pt"))
    p2 = _params(os.path.join(save2, "checkpoint_last.pt"))
    for k in p1:
        if k.endswith("k_proj.bias"):
            # the attention softmax does not depend on the key bias: its gradient is rounding noise,
            # which Adam's normalisation turns into lr-sized steps of either sign
            continue
        torch.testing.assert_close(p2[k], p1[k], rtol=1e-4, atol=1e-5, msg=k)
