"""Grouped shuffling: the batches of one update have similar lengths on every GPU.

In a multi-GPU run every update waits for the slowest rank, and fairseq's random shuffle puts unrelated
batches (of long and of short sentences) on the ranks of an update. fairseq's ``--grouped-shuffling``
shuffles groups of ``num_shards`` consecutive batches of the length-sorted list instead; LSTrainer keeps
the idea with three changes: a group holds ``num_shards x update_freq`` batches (all micro-batches of one
update, so 1 GPU with ``--update-freq N*k`` sees exactly the data order of N GPUs with ``--update-freq k``),
the batches that do not fill a last group are kept at the end of the epoch, and the group boundaries move
by a random offset every epoch. The order depends on ``--seed``, the epoch and the group size only, so a
restart continues with the same batches. It is an option, not a default: an update's extra cost on
several GPUs is mostly the gradient all-reduce, not a wait for the costlier batch
(benchmarks/RESULTS.md, "Scaling"). docs/step.md ("Grouped shuffling") has the details.
"""

import logging
from typing import Callable, List, Sequence

import numpy as np
from fairseq.data import data_utils
from fairseq.data.iterators import EpochBatchIterator, ShardedIterator

logger = logging.getLogger("ls_fairseq.batching")


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

    def ordered_batches(self, epoch, fix_batches_to_gpus, shuffle):
        group = self._ls_group_for_epoch(epoch)
        if not shuffle or fix_batches_to_gpus or group <= 1:
            return self._plain_ordered_batches(epoch, fix_batches_to_gpus, shuffle)
        frozen = self.frozen_batches
        batches = [frozen[i] for i in grouped_order(len(frozen), group, self.seed + epoch)]
        batches = list(ShardedIterator(batches, self.num_shards, self.shard_id, fill_value=[]))
        if self._supports_prefetch:
            self.dataset.prefetch([i for s in batches for i in s])
        return batches

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
    itr.__class__ = GroupedShuffleEpochBatchIterator
    itr._ls_group_for_epoch = lambda epoch: itr.num_shards * update_freq_for_epoch(freqs, epoch)
    return itr
