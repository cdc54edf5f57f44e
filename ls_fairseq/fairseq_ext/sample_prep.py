"""A batch on its way to the GPU: what LSTrainer does to it while it is still on the host.

The batch is copied from pinned memory (a copy from pageable memory waits for the whole stream to
drain), and, with an ls_transformer, the target positions ls_label_smoothed_cross_entropy counts and
whether the source has padding are found on the host copy (on the GPU either would make the forward
wait for the device). :class:`SamplePrepMixin` holds methods of
:class:`~ls_fairseq.fairseq_ext.trainer.LSTrainer`.
"""

import torch
from fairseq import utils

from ls_fairseq.fairseq_ext.criterion import (
    COUNTED_ROWS_KEY,
    LSLabelSmoothedCrossEntropyCriterion,
    takes_logit_rows,
)

SRC_PADDING_KEY = "src_has_padding"  # net_input entry the ls_transformer encoder reads


def pin_sample(sample):
    """Pin every CPU tensor of a (nested) sample so its copy to the GPU is asynchronous."""

    def _pin(t):
        if t.device.type == "cpu" and not t.is_pinned():
            return t.pin_memory()
        return t

    return utils.apply_to_sample(_pin, sample)


class SamplePrepMixin:
    """LSTrainer's preparation of a sample (fairseq's ``_prepare_sample`` and its fp16/bf16 conversion)."""

    def _fp_convert_sample(self, sample):
        """fairseq's conversion of float32 sample tensors to fp16 / bf16, with the flags read once."""
        knobs = self._knobs()
        if knobs.fp16:
            sample = utils.apply_to_sample(lambda t: t.to(dtype=torch.half) if t.dtype is torch.float32 else t, sample)
        if knobs.bf16:
            sample = utils.apply_to_sample(
                lambda t: t.to(dtype=torch.bfloat16) if t.dtype is torch.float32 else t, sample)
        return sample

    def _prepare_sample(self, sample, is_dummy=False):
        if self.cuda and not self.pipeline_model_parallel and isinstance(sample, dict) and len(sample) > 0:
            self._mark_on_host(sample)
            sample = pin_sample(sample)  # the counted rows too
        return super()._prepare_sample(sample, is_dummy)

    def _mark_on_host(self, sample):
        """Add to the host ``sample`` what is found there before it moves: the counted target positions and
        whether the source has padding."""
        rows = self._counted_rows(sample)
        self._mark_source_padding(sample)
        if rows is not None:
            sample[COUNTED_ROWS_KEY] = rows

    def _host_marked(self, sample):
        """A shallow copy of the host ``sample``, marked as :meth:`_prepare_sample` marks it (``sample`` itself is
        not changed)."""
        sample = dict(sample)
        if isinstance(sample.get("net_input"), dict):
            sample["net_input"] = dict(sample["net_input"])
        self._mark_on_host(sample)
        return sample

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

    def _mark_source_padding(self, sample):
        """Tell an ls_transformer whether the source has padding, read from the host copy of the batch."""
        net_input = sample.get("net_input")
        if not isinstance(net_input, dict) or SRC_PADDING_KEY in net_input:
            return
        src = net_input.get("src_tokens")
        if not torch.is_tensor(src) or src.device.type != "cpu" or not takes_logit_rows(self._model):
            return
        net_input[SRC_PADDING_KEY] = bool(src.eq(self.task.source_dictionary.pad()).any())
