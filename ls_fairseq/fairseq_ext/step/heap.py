"""Keeping Python's garbage collector from pausing the training loop.

A collection of the collector's oldest generation walks every object the process tracks (once torch,
fairseq and the model are loaded, mostly the imported modules' functions, dicts and tuples) and holds the
host for a long moment, in the middle of any update; with the CUDA-graph step the host runs only a few
updates ahead of the GPU, so the GPU then idles. :func:`settle_heap` runs once the trainer is built and at
the start of every epoch: it collects and moves every survivor into the permanent generation
(``gc.freeze``), which later collections skip. :func:`release_heap` makes the frozen objects collectable
again when training ends, so that what the run leaves behind is freed in a process that goes on.
docs/step.md ("The garbage collector") has the details.
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
