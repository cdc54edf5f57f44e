"""``--fp8``: the model flags that run ls_transformer's projections as FP8 GEMMs while training.

The projections of every encoder and decoder layer (self-attention QKV and output, cross-attention query and
output, both FFN layers) and the layer-batched cross-attention K/V take the FP8 path of
ls_fairseq/ops/fp8.py, each with its slot in one FP8 scaling state per model (:func:`attach_fp8`); embeddings,
layer norms, attention, the vocabulary projection and the loss keep the model's bf16/fp16, and ls_adam's fp32
master weights are unchanged. FP8 applies only in training mode: validation, fairseq-validate and
fairseq-generate run in the model's own precision, and checkpoints hold the usual bf16/fp16/fp32 weights, so a
model trained with --fp8 evaluates and loads anywhere. The scaling state is not part of a checkpoint: a resumed
run starts its amax histories afresh (its first update scales by current maxima).
"""

from typing import Iterable, Optional

import torch

from ls_fairseq.modules.decoder_layer import BatchedCrossKV, DecoderLayer
from ls_fairseq.modules.encoder_layer import EncoderLayer
from ls_fairseq.ops.fp8 import FORMATS, Fp8Ref, Fp8State, fp8_unavailable_reason, mode_of

# chosen by the quality and speed runs of benchmarks/RESULTS.md ("FP8")
DEFAULT_GRAD_FORMAT = "e5m2"


def add_fp8_args(parser):
    parser.add_argument("--fp8", action="store_true", default=False,
                        help="train with the layers' linear projections as FP8 GEMMs (GPUs with FP8 tensor cores: "
                             "Hopper, Ada; with --bf16 or --fp16); evaluation and checkpoints are unaffected")
    parser.add_argument("--fp8-grad-format", choices=sorted(FORMATS), default=DEFAULT_GRAD_FORMAT,
                        help="FP8 format of the output gradients under --fp8 (inputs and weights are e4m3)")


def attach_fp8(modules: Iterable[torch.nn.Module], grad_format: int) -> Optional[Fp8State]:
    """Give the FP8-capable ``modules`` (layers and the batched cross K/V, in order) their slots in one new
    :class:`Fp8State` and return it (None when there are none). A layer's slots follow csrc/torch/layers.cpp:
    self-attention 0-1, FFN 2-3, a decoder layer's cross-attention 4-5."""
    refs = []
    n = 0
    for m in modules:
        if isinstance(m, EncoderLayer):  # decoder layers too
            refs += [(m, n), (m.self_attn, n)]
            if isinstance(m, DecoderLayer):
                refs.append((m.encoder_attn, n + 4))
            n += 6 if isinstance(m, DecoderLayer) else 4
        elif isinstance(m, BatchedCrossKV):
            refs.append((m, n))
            n += 1
    if not refs:
        return None
    state = Fp8State(n, grad_format)
    for m, slot in refs:
        m.fp8 = Fp8Ref(state, slot)
    return state


def set_fp8_mode(model, args) -> int:
    """Attach an FP8 state to ``model``'s layers when --fp8 is on (``model.fp8_state``; None otherwise); returns
    the layers' base mode (0 off, 1 + the gradient format)."""
    mode = mode_of(bool(getattr(args, "fp8", False)), getattr(args, "fp8_grad_format", None) or DEFAULT_GRAD_FORMAT)
    state = attach_fp8(model.modules(), mode - 1) if mode else None
    model.encoder.fp8_state = state
    return mode


def check_fp8_device(weight: torch.Tensor):
    """Raise a clear error when --fp8 cannot train where ``weight`` (a parameter of the model) lives."""
    reason = fp8_unavailable_reason(weight.device, weight.dtype)
    if reason is not None:
        raise RuntimeError(reason)
