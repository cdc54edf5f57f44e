"""Memory modes: model flags that trade a little compute for activation memory, exactly.

``--ls-invertible-layernorm``: every layer norm keeps its output for the backward instead of its input and
recovers the normalised input as (y - bias) / weight (ls_fairseq/ops/layer_norm.py). A checkpoint with a
weight of exactly 0 is refused at load; a weight that reaches 0 while training makes that step's gradients
NaN, which stops training with an error naming it.
``--ls-recompute-activation``: a gelu FFN recomputes its activation output in the backward instead of
keeping it (ls_fairseq/ops/bias_act_linear.py); a relu FFN keeps a single tensor already.
``--ls-recompute-logits``: the vocabulary projection and the loss run in blocks of rows and keep no logits
for the backward, which makes each block's logits again (ls_fairseq/ops/linear_cross_entropy.py).

None of the flags changes the weights or the checkpoints. docs/memory.md says what each keeps and costs.
"""

from typing import List, Optional

from ls_fairseq.modules.encoder_layer import EncoderLayer
from ls_fairseq.modules.layer_norm import LayerNorm


def add_memory_args(parser):
    parser.add_argument("--ls-invertible-layernorm", action="store_true", default=False,
                        help="layer norms keep their output for the backward, not their input: one "
                             "[tokens, embed_dim] tensor less per layer norm (their weights must not be 0)")
    parser.add_argument("--ls-recompute-activation", action="store_true", default=False,
                        help="gelu FFNs recompute their activation in the backward instead of keeping it: one "
                             "[tokens, ffn_dim] tensor less per layer for one elementwise pass (relu keeps one "
                             "tensor already)")
    parser.add_argument("--ls-recompute-logits", action="store_true", default=False,
                        help="the vocabulary projection and the loss keep no logits for the backward and make them "
                             "again there, in blocks: one [target tokens, vocab] tensor less for one more GEMM")


def set_memory_modes(model, args):
    """Give the model's layer norms and layers the memory modes of ``args``."""
    invertible = bool(getattr(args, "ls_invertible_layernorm", False))
    recompute = bool(getattr(args, "ls_recompute_activation", False))
    for m in model.modules():
        if isinstance(m, LayerNorm):
            m.invertible = invertible
        elif isinstance(m, EncoderLayer):
            m.recompute_activation = recompute
    decoder = getattr(model, "decoder", None)
    if decoder is not None:
        decoder.recompute_logits = bool(getattr(args, "ls_recompute_logits", False))
    if invertible:
        model.register_load_state_dict_post_hook(_check_after_load)


def invertible_layer_norms(model):
    """(name, module) of the layer norms of ``model`` that run invertible (--ls-invertible-layernorm)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LayerNorm) and m.invertible]


def zero_weight_report(model) -> Optional[str]:
    """A message naming the invertible layer norms whose weight has an element equal to 0, else None."""
    bad: List[str] = []
    for name, m in invertible_layer_norms(model):
        zeros = int((m.weight == 0).sum())
        if zeros:
            bad.append(f"{name}.weight ({zeros} of {m.weight.numel()} elements)")
    if not bad:
        return None
    return ("--ls-invertible-layernorm recovers a layer norm's input from its output by dividing by the weight, "
            "which is 0 in " + ", ".join(bad) + ": train without --ls-invertible-layernorm")


def _check_after_load(model, incompatible_keys):
    report = zero_weight_report(model)
    if report is not None:
        raise ValueError(report)
