"""``--criterion ls_label_smoothed_cross_entropy``: fairseq's label-smoothed cross-entropy
computed from the raw decoder logits by one fused op.

fairseq's criterion first materialises fp32 log-probabilities of the whole [tokens, vocab] output
(``model.get_normalized_probs``) and then gathers from them; here
``ls_fairseq.ops.label_smoothed_cross_entropy`` takes the logits directly, so on GPU the fused kernel
never stores the log-probabilities. Values (loss, nll_loss, accuracy), metrics and flags are fairseq's
(--label-smoothing, --report-accuracy, --ignore-prefix-size, --sentence-avg).

With an ``ls_transformer`` model the decoder returns logits only for the target positions that count
(not padding, not the ignored prefix), so the model's largest GEMM and its two backward GEMMs skip
padding; the loss is the same sum over the same tokens. Per-token losses (``reduce=False``) take
fairseq's own path. Adaptive-softmax decoders are rejected: their output is not one logit tensor.
"""

import logging
from dataclasses import dataclass

import torch

from fairseq import utils
from fairseq.criterions import register_criterion
from fairseq.criterions.label_smoothed_cross_entropy import (
    LabelSmoothedCrossEntropyCriterion,
    LabelSmoothedCrossEntropyCriterionConfig,
)

from ls_fairseq.fairseq_ext.model import LSTransformerModel
from ls_fairseq.fairseq_ext.wrappers import wrapper_chain
from ls_fairseq.ops import label_smoothed_cross_entropy
from ls_fairseq.ops.linear_cross_entropy import linear_cross_entropy

logger = logging.getLogger(__name__)


@dataclass
class LSLabelSmoothedCrossEntropyConfig(LabelSmoothedCrossEntropyCriterionConfig):
    pass


def _check_model(model):
    decoder = getattr(model, "decoder", None)
    if getattr(decoder, "adaptive_softmax", None) is not None:
        raise ValueError(
            "ls_label_smoothed_cross_entropy needs full-vocabulary logits, but the decoder uses adaptive "
            "softmax (--adaptive-softmax-cutoff); use --criterion adaptive_loss or drop adaptive softmax"
        )


# A sample may carry the result of counted_rows(sample["target"]) under this key, computed on the
# host before the batch is copied to the GPU (LSTrainer does): the forward then needs no device sync.
COUNTED_ROWS_KEY = "ls_counted_rows"
ROW_ALIGN = 8  # counted rows are padded to this multiple (see counted_rows)


def takes_logit_rows(model) -> bool:
    """Whether ``model``'s forward accepts ``logit_rows`` (ls_transformer and its subclasses)."""
    *_, inner = wrapper_chain(model, 4)
    return isinstance(inner, LSTransformerModel)


def _check_prefix(ignore_prefix_size: int, target) -> None:
    if ignore_prefix_size > 0 and ignore_prefix_size >= target.shape[-1]:
        raise ValueError(f"--ignore-prefix-size {ignore_prefix_size} covers every target position (the batch's targets "
                         f"have {target.shape[-1]}): the loss would count nothing and nothing would train")


@register_criterion("ls_label_smoothed_cross_entropy", dataclass=LSLabelSmoothedCrossEntropyConfig)
class LSLabelSmoothedCrossEntropyCriterion(LabelSmoothedCrossEntropyCriterion):
    def __init__(self, task, sentence_avg, label_smoothing, ignore_prefix_size=0, report_accuracy=False):
        super().__init__(task, sentence_avg, label_smoothing, ignore_prefix_size, report_accuracy)
        if not (0.0 <= float(label_smoothing) < 1.0):
            raise ValueError(f"--label-smoothing must be in [0, 1), got {label_smoothing}")
        if ignore_prefix_size < 0:
            raise ValueError(f"--ignore-prefix-size must be >= 0, got {ignore_prefix_size}")

    def forward(self, model, sample, reduce=True):
        """fairseq's (loss, sample_size, logging_output); with an ls_transformer model the logits
        are computed for the counted target positions only."""
        if not reduce or not takes_logit_rows(model):
            return super().forward(model, sample, reduce=reduce)
        _check_model(model)
        target = model.get_targets(sample, None)
        _check_prefix(self.ignore_prefix_size, target)
        rows = sample.get(COUNTED_ROWS_KEY)
        if rows is None:
            rows = self.counted_rows(target)  # on the GPU this waits for the device (dynamic size)
        *_, inner = wrapper_chain(model, 4)
        decoder = inner.decoder
        if getattr(decoder, "recompute_logits", False) and model.training and torch.is_grad_enabled():
            return self._forward_recomputing_logits(model, sample, rows, target, decoder)
        logits, _ = model(**sample["net_input"], logit_rows=rows)
        if logits.dim() != 2 or logits.shape[0] != rows.numel():
            raise ValueError(
                f"ls_label_smoothed_cross_entropy: decoder returned {tuple(logits.shape)} for {rows.numel()} "
                "requested target positions (expected [positions, vocab])"
            )
        target = target.reshape(-1).index_select(0, rows)
        best = logits.argmax(1) if self.report_accuracy else None  # before the backward reuses the logits
        loss, nll_loss = label_smoothed_cross_entropy(logits, target, self.eps, ignore_index=self.padding_idx,
                                                      reuse_logits=True)
        return self._outputs(sample, loss, nll_loss, target, best)

    def _forward_recomputing_logits(self, model, sample, rows, target, decoder):
        """--ls-recompute-logits: the features of the counted rows, then the projection and the loss in blocks
        that keep no logits (ls_fairseq/ops/linear_cross_entropy.py)."""
        features, _ = model(**sample["net_input"], logit_rows=rows, features_only=True)
        target = target.reshape(-1).index_select(0, rows)
        loss, nll_loss, best = linear_cross_entropy(features, decoder.output_projection.weight, target, self.eps,
                                                    ignore_index=self.padding_idx, argmax=self.report_accuracy)
        return self._outputs(sample, loss, nll_loss, target, best)

    def _outputs(self, sample, loss, nll_loss, target, best):
        """fairseq's (loss, sample_size, logging_output); ``best``: each row's best token (with --report-accuracy)."""
        sample_size = sample["target"].size(0) if self.sentence_avg else sample["ntokens"]
        logging_output = {
            "loss": loss.data,
            "nll_loss": nll_loss.data,
            "ntokens": sample["ntokens"],
            "nsentences": sample["target"].size(0),
            "sample_size": sample_size,
        }
        if self.report_accuracy:
            counted = target.ne(self.padding_idx)  # without the alignment rows (see counted_rows)
            logging_output["n_correct"] = utils.item((best.eq(target) & counted).sum().data)
            logging_output["total"] = utils.item(counted.sum().data)
        return loss, sample_size, logging_output

    def counted_rows(self, target):
        """Indices into the flattened target of the positions the loss counts (int64 [N]).

        The count is rounded up to a multiple of ROW_ALIGN with padding positions when the batch
        has enough of them: their target is the padding index, so the loss ignores them (zero loss,
        zero gradient), and the vocabulary GEMMs get a row count that tensor-core kernels prefer."""
        flat = target.reshape(-1)
        keep = target.ne(self.padding_idx)
        if self.ignore_prefix_size > 0:
            keep[:, : self.ignore_prefix_size] = False
        rows = keep.reshape(-1).nonzero().squeeze(1)
        short = (-rows.numel()) % ROW_ALIGN
        if short:
            fill = flat.eq(self.padding_idx).nonzero().squeeze(1)[:short]
            if fill.numel() == short:
                rows = torch.cat([rows, fill])
        return rows

    def get_logits_and_target(self, model, net_output, sample):
        """Raw logits [N, V] and targets [N], after --ignore-prefix-size."""
        _check_model(model)
        logits = net_output[0]
        target = model.get_targets(sample, net_output)
        _check_prefix(self.ignore_prefix_size, target)
        if logits.shape[:-1] != target.shape:
            raise ValueError(
                f"ls_label_smoothed_cross_entropy: decoder output {tuple(logits.shape)} does not match "
                f"target {tuple(target.shape)} (expected [batch, length, vocab] and [batch, length])"
            )
        if self.ignore_prefix_size > 0:
            logits = logits[:, self.ignore_prefix_size:, :]
            target = target[:, self.ignore_prefix_size:]
        return logits.reshape(-1, logits.size(-1)), target.reshape(-1)

    def compute_loss(self, model, net_output, sample, reduce=True):
        if not reduce:
            return super().compute_loss(model, net_output, sample, reduce=False)
        logits, target = self.get_logits_and_target(model, net_output, sample)
        return label_smoothed_cross_entropy(logits, target, self.eps, ignore_index=self.padding_idx)

    def compute_accuracy(self, model, net_output, sample):
        # argmax of the logits is argmax of the log-probabilities: no log_softmax needed
        logits, target = self.get_logits_and_target(model, net_output, sample)
        mask = target.ne(self.padding_idx)
        n_correct = torch.sum(logits.argmax(1).masked_select(mask).eq(target.masked_select(mask)))
        total = torch.sum(mask)
        return n_correct, total


__all__ = ["LSLabelSmoothedCrossEntropyCriterion", "LSLabelSmoothedCrossEntropyConfig"]
