"""settle_heap (ls_fairseq/fairseq_ext/step/heap.py): garbage collected, survivors exempt from later collections."""

import gc
import weakref

from ls_fairseq.fairseq_ext.step.heap import settle_heap


class _Node:
    pass


def test_settle_heap_collects_garbage_and_freezes_the_survivors():
    gc.unfreeze()
    try:
        garbage = _Node()
        garbage.self = garbage  # a reference cycle: only the collector frees it
        dead = weakref.ref(garbage)
        del garbage
        kept = [_Node() for _ in range(1000)]
        before = gc.get_freeze_count()
        settle_heap()
        assert dead() is None, "the cycle left before settle_heap was not collected"
        assert gc.get_freeze_count() >= before + len(kept), "the surviving objects were not frozen"
        frozen = gc.get_freeze_count()
        fresh = [_Node() for _ in range(10)]
        assert gc.get_freeze_count() == frozen, "objects created later must stay collectable"
        del fresh
    finally:
        gc.unfreeze()


def test_lightseq_train_settles_each_epoch_and_releases_the_heap_at_the_end(data_bin, tmp_path, monkeypatch):
    """Two epochs of lightseq-train in this process: the heap is settled when the trainer is built and at each
    epoch's start, with objects frozen then, and nothing stays frozen once training returns (what the run leaves is
    collectable in a process that goes on)."""
    from _models import lightseq_train

    from ls_fairseq.fairseq_ext.step import heap
    from ls_fairseq.fairseq_ext.step import trainer as ls_trainer

    frozen = []

    def settle():
        heap.settle_heap()
        frozen.append(gc.get_freeze_count())

    monkeypatch.setattr(ls_trainer, "settle_heap", settle)
    gc.unfreeze()
    lightseq_train([data_bin, "--arch", "ls_transformer_tiny", "--share-all-embeddings", "--optimizer", "ls_adam",
                    "--lr", "1e-3", "--criterion", "ls_label_smoothed_cross_entropy", "--max-tokens", "512",
                    "--max-epoch", "2", "--num-workers", "0", "--save-dir", str(tmp_path / "ck"), "--no-save",
                    "--no-progress-bar", "--cpu"])
    assert len(frozen) == 3 and all(n > 1000 for n in frozen), frozen  # built, epoch 1, epoch 2
    assert gc.get_freeze_count() == 0
