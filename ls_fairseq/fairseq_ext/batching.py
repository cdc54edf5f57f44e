"""Grouped shuffling: the batches of one update have similar lengths on every GPU.

In a multi-GPU run every update waits for the slowest rank. fairseq builds its batches from
sentences sorted by length, so at the same --max-tokens a batch of long sentences can cost more
GPU time than one of short sentences, and the random shuffle puts unrelated batches on the
ranks of an update. On two H200s (benchmarks/RESULTS.md, "Multi-GPU") grouping the updates
changed the throughput by +0.5% at 8192 and +1.0% at 16384 tokens per GPU: most of what a
2-GPU update costs over one GPU's is the gradient all-reduce, not a wait for the rank with the
costlier batch. It is therefore an option, not a default. Its other use: with it, one GPU
reproduces the updates of several.

fairseq's ``--grouped-shuffling`` shuffles groups of ``num_shards`` consecutive batches of the
length-sorted list instead of single batches, so the ranks of an update get neighbouring (similar)
batches. LSTrainer keeps that idea and changes three details:

* a group holds ``num_shards x update_freq`` batches: all micro-batches of one update, on every
  rank. A run on 1 GPU with ``--update-freq N*k --grouped-shuffling`` therefore sees exactly the
  data order of N GPUs with ``--update-freq k``, so the two can be compared update by update;
* the batches that do not fill a last group are kept (fairseq drops them) and go at the end of
  the epoch, where they cannot shift the later groups off their ranks;
* the group boundaries move by a random offset every epoch, so the same batches are not grouped
  together in every epoch. The one group that wraps around mixes the longest and the shortest
  batches.

``LS_FAIRSEQ_GROUPING=cost`` groups batches of similar estimated GPU cost instead of length
neighbours (:func:`batch_costs`: padded source and target tokens plus the attention terms). At the
same --max-tokens, neighbours in length still differ: fairseq sorts by target length, so the
source lengths of two neighbouring batches can differ by 10%, and batch sizes are rounded to a
multiple of 8. Where the dataset has no sizes the length order is kept.

The order is a function of ``--seed``, the epoch, the group size and the batches only, so a
restart from a checkpoint continues with the same batches. With a group of one batch (1 GPU, update-freq 1),
without shuffling and with ``--fix-batches-to-gpus`` fairseq's own order is used unchanged.
"""

import logging
import os
from typing import Callable, List, Sequence

import numpy as np
from fairseq.data import data_utils
from fairseq.data.iterators import EpochBatchIterator, ShardedIterator

logger = logging.getLogger("ls_fairseq.batching")

GROUPINGS = ("length", "cost")

# Weights of the cost estimate, from the multiply-adds of a Transformer layer stack per token: a
# target token costs ~1.4 source tokens (a decoder layer has a second attention and the output
# projection comes on top), and one query-key pair of attention ~1/7000 of a token's linear layers
# at d_model 1024.
_TARGET_WEIGHT = 1.4
_ATTENTION_WEIGHT = 1.0 / 7000.0


def grouping() -> str:
    """What grouped shuffling groups by: ``LS_FAIRSEQ_GROUPING`` (length, the default, or cost)."""
    value = os.environ.get("LS_FAIRSEQ_GROUPING", "length").strip().lower() or "length"
    if value not in GROUPINGS:
        raise ValueError(f"LS_FAIRSEQ_GROUPING={value!r}: expected one of {', '.join(GROUPINGS)}")
    return value


def _sizes(dataset):
    """Per-item source and target lengths of ``dataset`` as arrays (target None), or None."""
    src, tgt = getattr(dataset, "src_sizes", None), getattr(dataset, "tgt_sizes", None)
    if src is None:
        sizes = getattr(dataset, "sizes", None)
        if sizes is None:
            return None
        sizes = np.asarray(sizes)
        if sizes.ndim == 1:
            src = sizes
        elif sizes.ndim == 2 and sizes.shape[1] >= 1:
            src, tgt = sizes[:, 0], (sizes[:, 1] if sizes.shape[1] > 1 else None)
        else:
            return None
    src = np.asarray(src, dtype=np.float64)
    tgt = None if tgt is None else np.asarray(tgt, dtype=np.float64)
    if src.ndim != 1 or (tgt is not None and tgt.shape != src.shape):
        return None
    return src, tgt


def batch_costs(dataset, batches: Sequence[Sequence[int]]):
    """Estimated GPU cost of each batch (arbitrary units), or None when ``dataset`` has no sizes.

    A batch is padded to its longest source and target: cost = n * (S + 1.4 T) for the linear
    layers plus n * (S^2 + T^2 + S T) / 7000 for self- and cross-attention, with n sentences, S and
    T the longest source and target. Empty batches cost 0."""
    sizes = _sizes(dataset)
    if sizes is None:
        return None
    src, tgt = sizes
    counts = np.array([len(b) for b in batches], dtype=np.int64)
    costs = np.zeros(len(batches), dtype=np.float64)
    full = np.flatnonzero(counts)
    if len(full) == 0:
        return costs
    flat = np.concatenate([np.asarray(batches[i], dtype=np.int64) for i in full])
    if flat.min() < 0 or flat.max() >= len(src):
        return None
    starts = np.concatenate([[0], np.cumsum(counts[full])[:-1]])
    n = counts[full].astype(np.float64)
    s = np.maximum.reduceat(src[flat], starts)
    t = np.zeros_like(s) if tgt is None else np.maximum.reduceat(tgt[flat], starts)
    costs[full] = n * (s + _TARGET_WEIGHT * t) + n * (s * s + t * t + s * t) * _ATTENTION_WEIGHT
    return costs


def grouped_order(num_batches: int, group: int, seed: int) -> List[int]:
    """Positions of ``num_batches`` length-sorted batches in the shuffled order: groups of
    ``group`` neighbours stay together, the groups are shuffled, an incomplete group goes last."""
    if group < 1:
        raise ValueError(f"grouped shuffling needs a group of at least one batch, got {group}")
    if num_batches == 0:
        return []
    with data_utils.numpy_seed(seed):
        start = int(np.random.randint(group)) if group > 1 else 0
        rotated = list(range(start, num_batches)) + list(range(min(start, num_batches)))
        full = len(rotated) // group
        groups = [rotated[i * group:(i + 1) * group] for i in range(full)]
        np.random.shuffle(groups)
    return [i for g in groups for i in g] + rotated[full * group:]


class GroupedShuffleEpochBatchIterator(EpochBatchIterator):
    """fairseq's EpochBatchIterator whose shuffle keeps the batches of each update together.

    Made from an existing iterator by :func:`group_batches_by_update` (the task builds the
    iterator; this only replaces how an epoch's batches are ordered)."""

    _ls_group_for_epoch: Callable[[int], int]
    _ls_grouping: str = "length"

    def ordered_batches(self, epoch, fix_batches_to_gpus, shuffle):
        group = self._ls_group_for_epoch(epoch)
        if not shuffle or fix_batches_to_gpus or group <= 1:
            return self._plain_ordered_batches(epoch, fix_batches_to_gpus, shuffle)
        frozen = self.frozen_batches
        base = self._ls_base_order(frozen)
        batches = [frozen[base[i]] for i in grouped_order(len(frozen), group, self.seed + epoch)]
        batches = list(ShardedIterator(batches, self.num_shards, self.shard_id, fill_value=[]))
        if self._supports_prefetch:
            self.dataset.prefetch([i for s in batches for i in s])
        return batches

    def _ls_base_order(self, frozen):
        """The order whose neighbours are grouped: fairseq's (length) or by estimated cost."""
        if self._ls_grouping != "cost":
            return range(len(frozen))
        cached = getattr(self, "_ls_cost_order", None)
        if cached is not None and len(cached) == len(frozen):
            return cached
        costs = batch_costs(self.dataset, frozen)
        if costs is None:
            logger.warning("LS_FAIRSEQ_GROUPING=cost: %s has no per-item sizes; grouping length "
                           "neighbours", type(self.dataset).__name__)
            order = np.arange(len(frozen))
        else:
            order = np.argsort(costs, kind="stable")  # ties keep fairseq's length order
        self._ls_cost_order = order
        return order

    def _plain_ordered_batches(self, epoch, fix_batches_to_gpus, shuffle):
        # fairseq's own order: its grouped variant is replaced by ours, never combined with it
        grouped, self.grouped_shuffling = self.grouped_shuffling, False
        try:
            return super().ordered_batches(epoch, fix_batches_to_gpus, shuffle)
        finally:
            self.grouped_shuffling = grouped


def update_freq_for_epoch(update_freq: Sequence[int], epoch: int) -> int:
    """fairseq's rule: --update-freq lists one value per epoch, the last one holds afterwards."""
    return int(update_freq[epoch - 1] if epoch <= len(update_freq) else update_freq[-1])


def group_batches_by_update(itr, update_freq: Sequence[int]):
    """Switch ``itr`` (a fairseq EpochBatchIterator) to grouped shuffling with groups of
    ``num_shards x update_freq`` batches. Returns the iterator; other iterator types (for
    example the multi-corpus GroupedEpochBatchIterator) are returned unchanged, with a warning."""
    if isinstance(itr, GroupedShuffleEpochBatchIterator):
        return itr
    if type(itr) is not EpochBatchIterator:
        logger.warning("--grouped-shuffling: %s is left to fairseq (LSTrainer groups the batches of "
                       "fairseq's EpochBatchIterator only)", type(itr).__name__)
        return itr
    freqs = [int(f) for f in update_freq] or [1]
    if min(freqs) < 1:
        raise ValueError(f"--update-freq must be positive, got {list(update_freq)}")
    mode = grouping()
    itr.__class__ = GroupedShuffleEpochBatchIterator
    itr._ls_grouping = mode
    itr._ls_group_for_epoch = lambda epoch: itr.num_shards * update_freq_for_epoch(freqs, epoch)
    return itr
