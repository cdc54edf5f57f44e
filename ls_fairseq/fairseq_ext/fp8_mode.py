"""``--fp8``: the model flags that run ls_transformer's projections as FP8 GEMMs while training.

The projections of the encoder and decoder layers (self-attention QKV and output, cross-attention query and
output, both FFN layers), the layer-batched cross-attention K/V and the vocabulary projection take the FP8 path
of ls_fairseq/ops/fp8.py where it pays (:func:`fp8_pays`), each with its slot in one FP8 scaling state per model
(:func:`attach_fp8`); the other projections, embeddings,
layer norms, attention and the loss keep the model's bf16/fp16, and ls_adam's fp32
master weights are unchanged. FP8 applies only in training mode: validation, fairseq-validate and
fairseq-generate run in the model's own precision, and checkpoints hold the usual bf16/fp16/fp32 weights, so a
model trained with --fp8 evaluates and loads anywhere. The scaling state is not part of a checkpoint: a resumed
run starts its amax histories afresh (its first update scales by current maxima).
"""

import logging
from typing import Callable, Iterable, Optional

import torch

from ls_fairseq.modules.decoder_layer import BatchedCrossKV, DecoderLayer
from ls_fairseq.modules.encoder_layer import EncoderLayer
from ls_fairseq.ops.fp8 import FORMATS, Fp8Ref, Fp8State, fp8_unavailable_reason, mode_of, shapes_ok

logger = logging.getLogger(__name__)

# chosen by the quality and speed runs of benchmarks/RESULTS.md ("FP8")
DEFAULT_GRAD_FORMAT = "e5m2"


def add_fp8_args(parser):
    parser.add_argument("--fp8", action="store_true", default=False,
                        help="train with the layers' linear projections as FP8 GEMMs (GPUs with FP8 tensor cores: "
                             "Hopper, Ada; with --bf16 or --fp16); evaluation and checkpoints are unaffected")
    parser.add_argument("--fp8-grad-format", choices=sorted(FORMATS), default=DEFAULT_GRAD_FORMAT,
                        help="FP8 format of the output gradients under --fp8 (inputs and weights are e4m3)")
    parser.add_argument("--fp8-projections", choices=["auto", "all"], default="auto",
                        help="which projections --fp8 runs as FP8 GEMMs: auto, those large enough to run faster "
                             "than in bf16/fp16 (in transformer-big: QKV, both FFN layers and the cross-attention "
                             "K/V); all, every one whose sizes are multiples of 16")


# A projection x [M, K] @ W^T [K, N] saves GEMM time in proportion to M K N and pays for quantising its input
# and output gradient in proportion to M (K + N): FP8 gains where K N / (K + N) is large enough. The threshold lies
# between transformer-big's square 1024 -> 1024 projections (K N / (K + N) = 512), which gained nothing in FP8 over
# bf16 (forward + backward with their casts), and its 1024 -> 3072 / 4096 ones (768, 819), which gained
# (benchmarks/RESULTS.md, "FP8").
MIN_HARMONIC_SIZE = 640


def fp8_pays(weight: torch.Tensor) -> bool:
    """Whether the projection with ``weight`` [N, K] runs faster in FP8 than in bf16/fp16."""
    n, k = weight.shape
    return n * k >= MIN_HARMONIC_SIZE * (n + k)


def _projections(m) -> list:
    """The weights of a layer's projections in its slot order (csrc/torch/layers.cpp): self-attention QKV and
    output 0-1, FFN 2-3, a decoder layer's cross-attention query and output 4-5."""
    w = [m.self_attn.in_proj_weight, m.self_attn.out_proj.weight, m.fc1.weight, m.fc2.weight]
    if isinstance(m, DecoderLayer):
        w += [m.encoder_attn.q_proj.weight, m.encoder_attn.out_proj.weight]
    return w


def attach_fp8(modules: Iterable[torch.nn.Module], grad_format: int,
               select: Callable[[torch.Tensor], bool] = fp8_pays,
               head: Optional[torch.nn.Module] = None) -> Optional[Fp8State]:
    """Give the FP8-capable ``modules`` (layers and the batched cross K/V, in order) their slots in one new
    :class:`Fp8State` and return it. Projections whose weight ``select`` refuses keep their slot but stay in the
    model's precision; None when no projection is left in FP8. ``head``: the vocabulary projection (a module
    with ``weight`` [vocab, C]), which takes the last slot; it stays in the model's precision unless ``select``
    takes it and its sizes are multiples of 16."""
    refs = []
    ahead = []  # (weight, slot) of the body's FP8 projections (Fp8State.cast_ahead)
    n = used = 0
    for m in modules:
        if isinstance(m, EncoderLayer):  # decoder layers too
            weights = _projections(m)
            skip = sum(1 << k for k, w in enumerate(weights) if not select(w))
            used += len(weights) - bin(skip).count("1")
            ahead += [(w, n + k) for k, w in enumerate(weights) if not (skip >> k) & 1 and shapes_ok(w)]
            refs += [(m, n, skip), (m.self_attn, n, skip & 3)]
            if isinstance(m, DecoderLayer):
                refs.append((m.encoder_attn, n + 4, skip >> 4))
            n += 6 if isinstance(m, DecoderLayer) else 4
        elif isinstance(m, BatchedCrossKV):
            refs.append((m, n, 0 if select(m.weight) else 1))
            used += refs[-1][2] == 0
            if refs[-1][2] == 0 and shapes_ok(m.weight):
                ahead.append((m.weight, n))
            n += 1
    if head is not None:
        refs.append((head, n, 0 if shapes_ok(head.weight) and select(head.weight) else 1))
        used += refs[-1][2] == 0
        n += 1
    if used == 0:
        return None
    state = Fp8State(n, grad_format, used)
    state.ahead = ahead
    for m, slot, skip in refs:
        m.fp8 = Fp8Ref(state, slot, skip)
    return state


def set_fp8_mode(model, args) -> int:
    """Attach an FP8 state to ``model``'s layers when --fp8 is on (``model.fp8_state``; None otherwise); returns
    the layers' base mode (0 off, 1 + the gradient format)."""
    mode = mode_of(bool(getattr(args, "fp8", False)), getattr(args, "fp8_grad_format", None) or DEFAULT_GRAD_FORMAT)
    state = None
    if mode:
        everything = getattr(args, "fp8_projections", "auto") == "all"
        # --ls-recompute-logits projects in blocks of rows inside its own autograd function: the vocabulary
        # projection keeps the model's precision there
        blocks = bool(getattr(args, "ls_recompute_logits", False))
        head = None if blocks else getattr(model.decoder, "output_projection", None)
        state = attach_fp8(model.modules(), mode - 1, (lambda w: True) if everything else fp8_pays, head)
        if blocks and state is not None:
            logger.info("--fp8: with --ls-recompute-logits the vocabulary projection stays in the model's precision")
        if state is None:
            logger.warning("--fp8: no projection of this model is large enough to run faster in FP8 (%s); it "
                           "trains in its own precision (--fp8-projections all forces FP8)", _rule())
        else:
            logger.info("--fp8: %d of %d projections run as FP8 GEMMs%s", state.in_fp8, state.linears,
                        "" if everything else f" (--fp8-projections auto: {_rule()})")
    model.encoder.fp8_state = state
    model.decoder.fp8_state = state
    return mode


def _rule() -> str:
    return f"those with out * in / (out + in) >= {MIN_HARMONIC_SIZE}"


def check_fp8_device(weight: torch.Tensor):
    """Raise a clear error when --fp8 cannot train where ``weight`` (a parameter of the model) lives."""
    reason = fp8_unavailable_reason(weight.device, weight.dtype)
    if reason is not None:
        raise RuntimeError(reason)
