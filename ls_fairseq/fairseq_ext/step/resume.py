"""Exact resume: the batches of a resumed run are those of the run it continues.

fairseq makes the batches once and reuses them every epoch, but makes them with the random order of
``--seed`` + the epoch the iterator is created in (the length sort breaks ties at random): epoch 1 in a
run from scratch, the checkpoint's epoch in a resumed run, so a run resumed in epoch 2 or later trained on
other batches than the run it continues. Within :func:`batches_as_first_made` an iterator made afresh for
a later epoch takes the batches of epoch 1 and counts from the epoch asked for. Runs that remake their
batches every epoch (--update-epoch-batch-itr, sharded data) already agree and are left as they are.
"""

import contextlib


@contextlib.contextmanager
def batches_as_first_made(task, cfg, epoch):
    """Within the block, ``task.get_batch_iterator`` makes a later epoch's batches as epoch 1's (module
    docstring)."""
    if (epoch is None or int(epoch) <= 1 or cfg.dataset.update_epoch_batch_itr
            or getattr(task.cfg, "rebuild_batches", False) or task.has_sharded_data("train")):
        yield
        return
    make = task.get_batch_iterator

    def get_batch_iterator(*a, **kw):
        dataset = kw.get("dataset", a[0] if a else None)
        reused = dataset in getattr(task, "dataset_to_epoch_iter", {})
        if reused or kw.get("disable_iterator_cache") or a or not task.can_reuse_epoch_itr(dataset):
            return make(*a, **kw)
        itr = make(**{**kw, "epoch": 1})
        itr.epoch = max(int(kw.get("epoch", 1)), 1)
        return itr

    task.get_batch_iterator = get_batch_iterator
    try:
        yield
    finally:
        del task.get_batch_iterator  # the task's own method again
