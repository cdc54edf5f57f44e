"""settle_heap (ls_fairseq/fairseq_ext/heap.py): garbage collected, survivors exempt from later collections."""

import gc
import weakref

from ls_fairseq.fairseq_ext.heap import settle_heap


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


def test_lightseq_trains_trainer_settles_the_heap_when_built_and_at_each_epoch(monkeypatch):
    from fairseq.trainer import Trainer

    from ls_fairseq.fairseq_ext import trainer as ls_trainer

    calls = []
    monkeypatch.setattr(ls_trainer, "settle_heap", lambda: calls.append("settle"))
    monkeypatch.setattr(ls_trainer.LSTrainer, "_ls_resolve", lambda self: calls.append("resolve"))
    monkeypatch.setattr(Trainer, "begin_epoch", lambda self, epoch: calls.append(f"fairseq {epoch}"))
    monkeypatch.setattr(Trainer, "__init__", lambda self, *a, **k: calls.append("fairseq init"))
    t = ls_trainer.LSTrainer("cfg", "task", "model", "criterion")
    assert calls == ["fairseq init", "settle"]
    t.begin_epoch(3)
    assert calls[2:] == ["resolve", "settle", "fairseq 3"]
