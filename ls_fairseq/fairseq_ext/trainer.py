"""LSTrainer: fairseq's Trainer without the per-step host stalls that do not change training.

lightseq-train runs fairseq's own training loop with this subclass in place of
``fairseq.trainer.Trainer``. Every update is computed exactly as fairseq computes it; what
changes is only when the host waits for the GPU:

* batches are copied to the GPU from pinned memory. fairseq's ``move_to_cuda`` asks for a
  non-blocking copy, but from ordinary (pageable) memory the CUDA driver first waits for the
  whole stream to drain, so every step began with an empty GPU queue;
* the per-step statistics stay on the GPU. fairseq turns every meter of the step into a
  Python float (one device-to-host copy each) to build the dictionary ``train_step``
  returns, which fairseq's loop only tests against ``None``; the dictionary is now built when
  something reads it. The meters themselves are logged exactly as before and are read at
  ``--log-interval`` as usual;
* the model is not walked module by module to set training mode on every step. fairseq calls
  ``model.train()`` and ``criterion.train()`` at the start of each step (a recursive walk over
  hundreds of modules, ~1 ms of host time); once a step has done so and both roots still report
  training mode, the next steps skip the walk. Anything that switches the model to evaluation
  through its root (validation, generation) clears the root flag and the walk happens again;
* with ls_label_smoothed_cross_entropy and an ls_transformer, the target positions the loss
  counts are found while the batch is still on the host, so that the logits of exactly those
  rows can be computed without the forward waiting for the device to report their number.

Nothing else differs; ``LS_FAIRSEQ_PLAIN_TRAINER=1`` makes lightseq-train use fairseq's
Trainer unchanged (for comparisons).
"""

import contextlib
import logging
import os
from collections.abc import Mapping

import torch
from fairseq import metrics, utils
from fairseq.trainer import Trainer

from ls_fairseq.fairseq_ext.criterion import (
    COUNTED_ROWS_KEY,
    LSLabelSmoothedCrossEntropyCriterion,
    takes_logit_rows,
)

logger = logging.getLogger("fairseq.trainer")  # fairseq's own logger: the same lines as its Trainer


def plain_trainer_requested() -> bool:
    return os.environ.get("LS_FAIRSEQ_PLAIN_TRAINER") == "1"


def pin_sample(sample):
    """Pin every CPU tensor of a (nested) sample so its copy to the GPU is asynchronous."""

    def _pin(t):
        if t.device.type == "cpu" and not t.is_pinned():
            return t.pin_memory()
        return t

    return utils.apply_to_sample(_pin, sample)


class DeferredLoggingOutput(Mapping):
    """The dictionary ``train_step`` returns, computed from the step's meters on first read."""

    def __init__(self, agg, sample_size):
        self._agg = agg
        self._sample_size = sample_size
        self._values = None

    def _get(self):
        if self._values is None:
            values = self._agg.get_smoothed_values()
            values["sample_size"] = self._sample_size
            for key in ("ppl", "wps", "wpb", "bsz"):
                values.pop(key, None)
            self._values = values
            self._agg = None
        return self._values

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self):
        return len(self._get())

    def __repr__(self):
        return repr(self._get())


@contextlib.contextmanager
def _train_mode_kept(*modules):
    """Within the block, ``m.train()`` returns ``m`` without walking its submodules."""
    for m in modules:
        object.__setattr__(m, "train", lambda mode=True, _m=m: _m if mode else type(_m).train(_m, mode))
    try:
        yield
    finally:
        for m in modules:
            m.__dict__.pop("train", None)


class LSTrainer(Trainer):
    def train_step(self, samples, raise_oom=False):
        model, criterion = self.model, self.criterion
        if self.__dict__.get("_ls_train_mode_set") and model.training and criterion.training:
            with _train_mode_kept(model, criterion):
                return super().train_step(samples, raise_oom)
        out = super().train_step(samples, raise_oom)
        self._ls_train_mode_set = True
        return out

    def _prepare_sample(self, sample, is_dummy=False):
        if self.cuda and not self.pipeline_model_parallel and isinstance(sample, dict) and len(sample) > 0:
            rows = self._counted_rows(sample)
            sample = pin_sample(sample)
            if rows is not None:
                sample[COUNTED_ROWS_KEY] = rows.pin_memory()
        return super()._prepare_sample(sample, is_dummy)

    def _counted_rows(self, sample):
        """The target positions ls_label_smoothed_cross_entropy counts, found on the host while the
        target is still there (on the GPU the dynamic size would make the forward wait for the device)."""
        criterion = self.__dict__.get("_criterion")
        target = sample.get("target")
        if not isinstance(criterion, LSLabelSmoothedCrossEntropyCriterion) or not torch.is_tensor(target):
            return None
        if target.device.type != "cpu" or COUNTED_ROWS_KEY in sample or not takes_logit_rows(self._model):
            return None
        return criterion.counted_rows(target)

    def _reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        if self.tpu:
            return super()._reduce_and_log_stats(logging_outputs, sample_size, grad_norm)
        if grad_norm is not None:
            # Outside --amp a non-finite norm never gets here (fp16: OverflowError, which sets it
            # to 0; otherwise FloatingPointError), so fairseq's host-side test is needed only then.
            finite = True
            if torch.is_tensor(grad_norm) and self.cfg.common.amp:
                finite = bool(torch.isfinite(grad_norm))
            if finite:
                metrics.log_speed("ups", 1.0, priority=100, round=2)
                metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
                clip = self.cfg.optimization.clip_norm
                if clip > 0:
                    if torch.is_tensor(grad_norm):
                        clipped = torch.where(grad_norm > clip, grad_norm.new_tensor(100), grad_norm.new_tensor(0))
                    else:
                        clipped = 100.0 if grad_norm > clip else 0.0
                    metrics.log_scalar("clip", clipped, priority=500, round=1)

        with metrics.aggregate() as agg:
            if logging_outputs is not None:
                self.task.reduce_metrics(logging_outputs, self.get_criterion())
                del logging_outputs
            if "loss" not in agg:
                if "loss" not in self._warn_once:
                    self._warn_once.add("loss")
                    logger.warning("the criterion's reduce_metrics logged no 'loss'; logging -1 in its place "
                                   "(progress lines and best-checkpoint selection read it)")
                metrics.log_scalar("loss", -1)
        return DeferredLoggingOutput(agg, sample_size)
