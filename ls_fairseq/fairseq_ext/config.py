"""Which fairseq transformer options ls_transformer honours, and clear errors for the rest."""

import math

import torch

from ls_fairseq.fairseq_ext.data_checks import InputError
from ls_fairseq.modules.positional import build_positions
from ls_fairseq.ops._checks import ACTIVATIONS, check_dropout


class OptionError(InputError):
    """An option (a flag, or an argument of a fairseq call) ls_transformer cannot honour: the message names it."""


def activation_dropout_of(cfg):
    p = getattr(cfg, "activation_dropout", 0.0) or 0.0
    if p == 0.0:
        p = getattr(cfg, "relu_dropout", 0.0) or 0.0
    return p


def _get(cfg, path, default=None):
    cur = cfg
    for part in path.split("."):
        cur = getattr(cur, part, None) if cur is not None else None
    return default if cur is None else cur


# (config path, predicate that means "in use", the flag a user passed, why it is refused)
_UNSUPPORTED = [
    ("encoder.layerdrop", lambda v: v > 0, "--encoder-layerdrop", "LayerDrop"),
    ("decoder.layerdrop", lambda v: v > 0, "--decoder-layerdrop", "LayerDrop"),
    ("encoder.layers_to_keep", bool, "--encoder-layers-to-keep", "layer pruning"),
    ("decoder.layers_to_keep", bool, "--decoder-layers-to-keep", "layer pruning"),
    ("adaptive_input", bool, "--adaptive-input", "adaptive input embeddings"),
    ("adaptive_softmax_cutoff", bool, "--adaptive-softmax-cutoff", "adaptive softmax"),
    ("tie_adaptive_weights", bool, "--tie-adaptive-weights", "adaptive softmax"),
    ("layernorm_embedding", bool, "--layernorm-embedding", "a layer norm after the embedding"),
    ("quant_noise.pq", lambda v: v > 0, "--quant-noise-pq", "quantization noise"),
    # fairseq's task quantizes the model's nn.Linear modules in place, which the fused layers never call
    ("quant_noise.scalar", lambda v: v > 0, "--quant-noise-scalar", "quantization noise"),
    ("cross_self_attention", bool, "--cross-self-attention", "cross+self attention"),
    ("no_cross_attention", bool, "--no-cross-attention", "a decoder without cross-attention"),
    ("char_inputs", bool, "--char-inputs", "character inputs"),
    ("offload_activations", bool, "--offload-activations", "activation offloading (use --checkpoint-activations)"),
    ("encoder.xformers_att_config", bool, "--encoder-xformers-att-config", "xformers attention"),
    ("decoder.xformers_att_config", bool, "--decoder-xformers-att-config", "xformers attention"),
    ("base_layers", lambda v: v > 0, "--base-layers", "BASE layers"),
]


def check_supported(cfg):
    """Raise ValueError naming the flag for every option ls_transformer cannot honour."""
    problems = []
    for path, used, flag, what in _UNSUPPORTED:
        v = _get(cfg, path)
        try:
            in_use = v is not None and used(v)
        except TypeError:
            in_use = bool(v)
        if in_use:
            problems.append(f"{flag} ({what}) is not supported by ls_transformer")
    act = str(_get(cfg, "activation_fn", "relu"))
    if act not in ACTIVATIONS:
        problems.append(f"--activation-fn {act} is not supported by ls_transformer (choose from {', '.join(ACTIVATIONS)})")
    enc_dim, dec_dim = _get(cfg, "encoder.embed_dim"), _get(cfg, "decoder.embed_dim")
    if enc_dim != dec_dim:
        problems.append(f"--encoder-embed-dim {enc_dim} must equal --decoder-embed-dim {dec_dim} for ls_transformer")
    for path, flag in (("decoder.output_dim", "--decoder-output-dim"), ("decoder.input_dim", "--decoder-input-dim")):
        v = _get(cfg, path)
        if v is not None and int(v) != dec_dim:
            problems.append(f"{flag} {v} must equal --decoder-embed-dim {dec_dim} for ls_transformer")
    for side in ("encoder", "decoder"):
        dim, heads = _get(cfg, f"{side}.embed_dim"), _get(cfg, f"{side}.attention_heads")
        if dim is not None and heads and dim % heads != 0:
            problems.append(
                f"--{side}-embed-dim {dim} is not divisible by --{side}-attention-heads {heads}"
            )
    for name, flag in (("dropout", "--dropout"), ("attention_dropout", "--attention-dropout"),
                       ("activation_dropout", "--activation-dropout"), ("relu_dropout", "--relu-dropout")):
        v = _get(cfg, name, 0.0)
        try:
            check_dropout(v, flag)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise OptionError("ls_transformer: " + "; ".join(problems))


def setup_embeddings(module, cfg, embed_tokens, side: str):
    """The state an encoder or decoder ("encoder" / "decoder") keeps about its input embedding."""
    module.register_buffer("version", torch.Tensor([3]))
    module.cfg = cfg
    module.dropout = cfg.dropout
    module.padding_idx = embed_tokens.padding_idx
    module.embed_tokens = embed_tokens
    dim = embed_tokens.embedding_dim
    module.embed_dim = dim
    module.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(dim)
    max_positions = cfg.max_source_positions if side == "encoder" else cfg.max_target_positions
    module.embed_positions = (
        build_positions(max_positions, dim, module.padding_idx, getattr(cfg, side).learned_pos)
        if not cfg.no_token_positional_embeddings else None
    )
    module.checkpoint_activations = cfg.checkpoint_activations
    return dim, max_positions
