"""``--fp8``: the model flags that run ls_transformer's projections as FP8 GEMMs while training.

The projections of every encoder and decoder layer (self-attention QKV and output, cross-attention query and
output, both FFN layers) and the layer-batched cross-attention K/V take the FP8 path of
ls_fairseq/ops/fp8.py; embeddings, layer norms, attention, the vocabulary projection and the loss keep the
model's bf16/fp16, and ls_adam's fp32 master weights are unchanged. FP8 applies only in training mode:
validation, fairseq-validate and fairseq-generate run in the model's own precision, and checkpoints hold
the usual bf16/fp16/fp32 weights, so a model trained with --fp8 evaluates and loads anywhere.
"""

import torch

from ls_fairseq.modules.attention import CrossAttention, SelfAttention
from ls_fairseq.modules.decoder_layer import BatchedCrossKV
from ls_fairseq.modules.encoder_layer import EncoderLayer
from ls_fairseq.ops.fp8 import FORMATS, fp8_unavailable_reason, mode_of

# chosen by the quality and speed runs of benchmarks/RESULTS.md ("FP8")
DEFAULT_GRAD_FORMAT = "e5m2"


def add_fp8_args(parser):
    parser.add_argument("--fp8", action="store_true", default=False,
                        help="train with the layers' linear projections as FP8 GEMMs (GPUs with FP8 tensor cores: "
                             "Hopper, Ada; with --bf16 or --fp16); evaluation and checkpoints are unaffected")
    parser.add_argument("--fp8-grad-format", choices=sorted(FORMATS), default=DEFAULT_GRAD_FORMAT,
                        help="FP8 format of the output gradients under --fp8 (inputs and weights are e4m3)")


def set_fp8_mode(model, args) -> int:
    """Give every FP8-capable module of ``model`` the mode of ``args`` (0 when --fp8 is off)."""
    mode = mode_of(bool(getattr(args, "fp8", False)), getattr(args, "fp8_grad_format", None) or DEFAULT_GRAD_FORMAT)
    for m in model.modules():
        if isinstance(m, (EncoderLayer, SelfAttention, CrossAttention, BatchedCrossKV)):
            m.fp8 = mode
    return mode


def check_fp8_device(weight: torch.Tensor):
    """Raise a clear error when --fp8 cannot train where ``weight`` (a parameter of the model) lives."""
    reason = fp8_unavailable_reason(weight.device, weight.dtype)
    if reason is not None:
        raise RuntimeError(reason)
