"""A batch on its way to the GPU: what is done to it while it is still on the host.

The batch is copied from pinned memory (a copy from pageable memory waits for the whole stream to
drain), and, with an ls_transformer, the target positions ls_label_smoothed_cross_entropy counts and
whether the source has padding are found on the host copy (on the GPU either would make the forward
wait for the device).
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


class SamplePrep:
    """The host-side preparation of a training batch for ``model`` and ``criterion``.

    ``pad``: the source dictionary's padding index; ``fp16`` / ``bf16``: the precision the float
    tensors of a batch are converted to."""

    def __init__(self, model, criterion, pad: int, fp16: bool = False, bf16: bool = False):
        self.criterion = criterion
        self.pad = pad
        self.fp16, self.bf16 = bool(fp16), bool(bf16)
        self.marks = takes_logit_rows(model)  # an ls_transformer: it reads the host marks
        self.counts_rows = self.marks and isinstance(criterion, LSLabelSmoothedCrossEntropyCriterion)

    def to_precision(self, sample):
        """fairseq's conversion of float32 sample tensors to fp16 / bf16."""
        if self.fp16:
            sample = utils.apply_to_sample(lambda t: t.to(dtype=torch.half) if t.dtype is torch.float32 else t, sample)
        if self.bf16:
            sample = utils.apply_to_sample(
                lambda t: t.to(dtype=torch.bfloat16) if t.dtype is torch.float32 else t, sample)
        return sample

    def for_copy(self, sample):
        """The host ``sample`` marked (:meth:`mark`) and pinned, ready for an asynchronous copy."""
        self.mark(sample)
        return pin_sample(sample)  # the counted rows too

    def mark(self, sample) -> None:
        """Add to the host ``sample`` what is found there before it moves: the counted target positions and
        whether the source has padding."""
        rows = self.counted_rows(sample)
        self.mark_source_padding(sample)
        if rows is not None:
            sample[COUNTED_ROWS_KEY] = rows

    def marked_copy(self, sample):
        """A shallow copy of the host ``sample``, marked as :meth:`mark` marks it (``sample`` is not changed)."""
        sample = dict(sample)
        if isinstance(sample.get("net_input"), dict):
            sample["net_input"] = dict(sample["net_input"])
        self.mark(sample)
        return sample

    def counted_rows(self, sample):
        """The target positions ls_label_smoothed_cross_entropy counts, found on the host while the
        target is still there (on the GPU the dynamic size would make the forward wait for the device)."""
        target = sample.get("target")
        if not self.counts_rows or not torch.is_tensor(target):
            return None
        if target.device.type != "cpu" or COUNTED_ROWS_KEY in sample:
            return None
        return self.criterion.counted_rows(target)

    def mark_source_padding(self, sample) -> None:
        """Tell an ls_transformer whether the source has padding, read from the host copy of the batch."""
        net_input = sample.get("net_input")
        if not self.marks or not isinstance(net_input, dict) or SRC_PADDING_KEY in net_input:
            return
        src = net_input.get("src_tokens")
        if torch.is_tensor(src) and src.device.type == "cpu":
            net_input[SRC_PADDING_KEY] = bool(src.eq(self.pad).any())
