"""Grouped shuffling (ls_fairseq/fairseq_ext/batching.py): the batches of one update are
neighbours in fairseq's length-sorted order, on every rank and every micro-batch.

Checked on fairseq's own EpochBatchIterator over a dataset whose batch k stands for the k-th
shortest batch, then end to end: two gloo ranks of lightseq-train --grouped-shuffling train
exactly like one process with --update-freq 2 --grouped-shuffling."""

import os

import numpy as np
import pytest
import torch

from _models import lightseq_train_two_ranks
from test_end_to_end import TRAIN_FLAGS, _params, data_bin, inner_by_update, train  # noqa: F401  (fixture)

from ls_fairseq.fairseq_ext.batching import (
    GroupedShuffleEpochBatchIterator,
    batch_costs,
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


class _Pairs(_Items):
    """Items with source and target lengths, like fairseq's LanguagePairDataset."""

    def __init__(self, src, tgt):
        super().__init__(len(src))
        self.src_sizes, self.tgt_sizes = np.asarray(src), np.asarray(tgt)


def _length_sorted_batches(num_batches, seed=0):
    """Batches as fairseq builds them at one --max-tokens: sorted by target length, about 4096
    padded tokens each, sources of unrelated length. Returns (dataset, batches)."""
    rng = np.random.RandomState(seed)
    src, tgt, batches = [], [], []
    for k in range(num_batches):
        t = 8 + k  # neighbours in target length
        n = 4096 // t
        batches.append(list(range(len(src), len(src) + n)))
        tgt += [t] * n
        longest = rng.randint(t // 2, 2 * t)  # the batch's longest source
        src += [longest] + list(rng.randint(1, longest + 1, size=n - 1))
    return _Pairs(src, tgt), batches


def _sized_iterator(dataset, batches, num_shards, shard_id, update_freq):
    from fairseq.data.iterators import EpochBatchIterator

    itr = EpochBatchIterator(dataset, collate_fn=lambda xs: xs, batch_sampler=batches, seed=5,
                             num_shards=num_shards, shard_id=shard_id)
    return group_batches_by_update(itr, [update_freq])


def test_batch_costs_pad_every_sentence_to_the_longest():
    ds = _Pairs(src=[3, 5, 2, 4], tgt=[6, 1, 2, 2])
    costs = batch_costs(ds, [[0, 1], [], [2, 3]])
    # n * (S + 1.4 T) + n * (S^2 + T^2 + S T) / 7000
    assert costs[0] == pytest.approx(2 * (5 + 1.4 * 6) + 2 * (25 + 36 + 30) / 7000)
    assert costs[1] == 0
    assert costs[2] == pytest.approx(2 * (4 + 1.4 * 2) + 2 * (16 + 4 + 8) / 7000)
    one_d = _Items(3)
    one_d.sizes = np.array([4, 9, 1])
    assert batch_costs(one_d, [[0, 2], [1]]).tolist() == pytest.approx([2 * 4 + 2 * 16 / 7000, 9 + 81 / 7000])
    assert batch_costs(_Items(3), [[0], [1, 2]]) is None  # no sizes
    assert batch_costs(one_d, [[0, 7]]) is None  # indices outside the dataset


def _pair_spread(dataset, batches, ranks):
    """Mean over updates of (costliest batch - mean) / mean, and every batch seen once."""
    costs = batch_costs(dataset, batches)
    per_rank = [list(_sized_iterator(dataset, batches, ranks, r, 1).next_epoch_itr()) for r in range(ranks)]
    ids = {tuple(b): i for i, b in enumerate(batches)}
    seen, spreads = [], []
    for step in zip(*per_rank):
        c = [costs[ids[tuple(x)]] for x in step if x]
        seen += [ids[tuple(x)] for x in step if x]
        if len(c) == ranks:
            spreads.append(max(c) / np.mean(c) - 1)
    assert sorted(seen) == list(range(len(batches)))
    return float(np.mean(spreads))


def test_cost_grouping_gives_the_ranks_of_an_update_batches_of_equal_cost(monkeypatch):
    dataset, batches = _length_sorted_batches(60)
    length = _pair_spread(dataset, batches, 2)
    monkeypatch.setenv("LS_FAIRSEQ_GROUPING", "cost")
    cost = _pair_spread(dataset, batches, 2)
    assert length > 0.02  # length neighbours: sources of unrelated length make unequal batches
    assert cost < length / 5, (cost, length)


@pytest.mark.parametrize("ranks,update_freq", [(2, 1), (2, 2)])
def test_cost_grouping_one_rank_with_more_micro_batches_sees_the_same_updates(monkeypatch, ranks, update_freq):
    monkeypatch.setenv("LS_FAIRSEQ_GROUPING", "cost")
    dataset, batches = _length_sorted_batches(37)

    def updates(n_ranks, freq):
        per_rank = [list(_sized_iterator(dataset, batches, n_ranks, r, freq).next_epoch_itr())
                    for r in range(n_ranks)]
        return [sorted(x[0] for p in per_rank for x in p[u:u + freq] if x)
                for u in range(0, len(per_rank[0]), freq)]

    assert updates(1, ranks * update_freq) == updates(ranks, update_freq)


def test_cost_grouping_without_sizes_keeps_length_neighbours(monkeypatch, caplog):
    length = _epoch(_iterator(30, 2, 0, [1]))
    monkeypatch.setenv("LS_FAIRSEQ_GROUPING", "cost")
    with caplog.at_level("WARNING"):
        assert _epoch(_iterator(30, 2, 0, [1])) == length
    assert "no per-item sizes" in caplog.text


def test_an_unknown_grouping_is_refused(monkeypatch):
    monkeypatch.setenv("LS_FAIRSEQ_GROUPING", "tokens")
    with pytest.raises(ValueError, match="LS_FAIRSEQ_GROUPING='tokens': expected one of length, cost"):
        _iterator(4, 2, 0, [1])


_RANK_FLAGS = ["--dropout", "0", "--max-update", "8", "--log-interval", "1"]


def test_two_ranks_train_like_one_process_with_update_freq_2(data_bin, tmp_path):  # noqa: F811
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
