"""The training step: fairseq's Trainer with the host kept off the GPU's path.

Read in this order; each file holds one class whose state is declared in its ``__init__``:

* ``trainer.py``: :class:`LSTrainer`, the entry (which step runs, fairseq's hooks that settle first);
* ``deferred_step.py``: :class:`DeferredStep`, one update as a list of named phases;
* ``sample_prep.py``: :class:`SamplePrep`, a batch's host-side marking and pinned copy;
* ``pending_update.py``: :class:`PendingUpdates`, the updates still on the GPU and their settling;
* ``step_stats.py``: :class:`StepStats`, the statistics summed across ranks and logged;
* ``step_timing.py``: :class:`StepTimer` (``LS_FAIRSEQ_STEP_TIMING=1``);
* ``takeover.py``: when ``fairseq-train --user-dir`` builds :class:`LSTrainer`, and what it adjusts;
* ``settings.py``: the configuration values the step reads every update, read once.

The CUDA-graph micro-batch is :mod:`ls_fairseq.fairseq_ext.graph`; docs/step.md draws the whole.
"""
