"""Keeping Python's garbage collector from pausing the training loop.

A collection of the collector's oldest generation walks every object the process tracks. Once torch, fairseq and
the model are loaded that is several hundred thousand objects (mostly the functions, dicts and tuples of the
imported modules), and one such collection holds the host for 0.1-0.3 s. The collector starts one whenever enough
objects have survived the younger generations (after the CUDA-graph step's captures, for one), in the middle of any
update; with that step the host runs only a few updates ahead of the GPU, so the GPU then idles for most of the
pause.

:func:`settle_heap` runs once the trainer is built and again at the start of every epoch: it collects what is
garbage now and moves every object that survives into the collector's permanent generation (``gc.freeze``), which
later collections skip. They then walk only what was created since, and the collection at the next epoch's start
frees what of that has become garbage. An object frozen while alive that later becomes part of unreachable cycles
stays until training ends (a few dozen objects an epoch in lightseq-train); then :func:`release_heap` makes the
frozen objects collectable again, so that what the run leaves behind (its trainer, its model) is freed in a process
that goes on.
"""

import gc
import logging
import time

logger = logging.getLogger(__name__)


def settle_heap() -> None:
    """Collect the garbage, then exempt every surviving object from later collections (module docstring)."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    logger.debug("garbage collected in %.0f ms; %d objects exempt from later collections",
                 1e3 * (time.perf_counter() - t0), gc.get_freeze_count())


def release_heap() -> None:
    """Make every frozen object collectable again (the end of a training run)."""
    gc.unfreeze()
