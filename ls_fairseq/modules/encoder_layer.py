"""Transformer encoder layer (post-LN or pre-LN, relu or gelu) over the fused ops.

Parameter names follow fairseq's TransformerEncoderLayer except the fused
``self_attn.in_proj_weight/bias`` (translated to q_proj/k_proj/v_proj on save/load).
"""

import importlib

import torch.nn as nn

from ls_fairseq import ops
from ls_fairseq.modules.attention import SelfAttention
from ls_fairseq.modules.layer_norm import LayerNorm
from ls_fairseq.ops._checks import check_activation, check_dropout
from ls_fairseq.ops._dispatch import cpp_layers
from ls_fairseq.ops.fp8 import fp8_ffn_node, fp8_now, layer_fp8_args
from ls_fairseq.ops.layer_norm import KERNEL_MAX_C

_attention_ops = importlib.import_module("ls_fairseq.ops.attention")  # the module; ops.attention is the op


def _attention_p(attn) -> float:
    """An attention block's dropout probability as it applies it (0 outside training)."""
    return float(attn.attention_dropout) if attn.training else 0.0


class EncoderLayer(nn.Module):
    def __init__(self, embed_dim: int, ffn_dim: int, num_heads: int, dropout: float = 0.1,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 activation: str = "relu", normalize_before: bool = False):
        super().__init__()
        check_activation(activation)
        check_dropout(dropout, "--dropout")
        check_dropout(attention_dropout, "--attention-dropout")
        check_dropout(activation_dropout, "--activation-dropout")
        self.embed_dim = embed_dim
        self.dropout = dropout
        self.activation_dropout = activation_dropout
        self.activation = activation
        self.normalize_before = normalize_before
        # Fp8Ref under --fp8 (ls_fairseq/ops/fp8.py): the layer's slots in the model's FP8 state, in the order of
        # csrc/torch/layers.cpp (self-attention 0-1, FFN 2-3, a decoder's cross-attention 4-5)
        self.fp8 = None
        self.recompute_activation = False  # --ls-recompute-activation (ls_fairseq/ops/bias_act_linear.py)
        self.self_attn = SelfAttention(embed_dim, num_heads, attention_dropout, causal=False)
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)

    def forward(self, x, key_padding_mask=None, varlen=None):
        """x [B, T, C]; key_padding_mask [B, T] (True = pad) or None. ``varlen``
        (:class:`ls_fairseq.ops.attention.Varlen`, no mask): x [1, N, C] holds packed sentences."""
        mod = self.cpp_module(x)
        if mod is not None:  # the same nodes as below, recorded by one C++ call (csrc/torch/layers.cpp)
            if varlen is None:
                return mod.encoder_layer_fwd(x, key_padding_mask, *self.cpp_args())
            return mod.encoder_layer_fwd(x, key_padding_mask, *self.cpp_args(), varlen.cu_q, varlen.max_q)
        h, residual = self.self_attn_layer_norm.with_input(x) if self.normalize_before else (x, x)
        x = self.attention_end(self.self_attn, self.self_attn.attend(h, key_padding_mask, varlen=varlen), residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        return self.ffn(x)

    def attention_end(self, attn, h, residual):
        """residual + dropout(attn.out_proj(h)) for the merged heads h of attention module ``attn``."""
        return ops.linear_dropout_residual(h, attn.out_proj.weight, attn.out_proj.bias, residual, self.dropout,
                                           self.training, fp8_now(attn, 1))

    def cpp_module(self, x):
        """The extension when this layer's forward on ``x`` runs as one C++ call, else None."""
        return cpp_layers(x) if 0 < self.embed_dim <= KERNEL_MAX_C else None

    def cpp_args(self):
        """The C++ layer call's arguments after its inputs and masks (csrc/torch/layers.cpp)."""
        return (self.cpp_weights(), self.cpp_eps(), self.self_attn.num_heads, *self.cpp_dropouts(), self.activation,
                self.normalize_before, _attention_ops.SHORT_ATTENTION_LEN, *layer_fp8_args(self),
                self.memory_bits())

    def memory_bits(self) -> int:
        """The memory modes as the C++ layer takes them (csrc/torch/ops.h: 1 invertible layer norms,
        2 recomputed activation)."""
        return (1 if self.final_layer_norm.invertible else 0) | (2 if self.recomputes_activation() else 0)

    def recomputes_activation(self) -> bool:
        """Whether the FFN recomputes its activation output in the backward (gelu only: a relu FFN keeps
        one tensor for the backward already)."""
        return self.recompute_activation and self.activation == "gelu"

    def cpp_weights(self):
        """The weights in the order csrc/torch/layers.cpp takes them."""
        a = self.self_attn
        return [self.self_attn_layer_norm.weight, self.self_attn_layer_norm.bias, a.in_proj_weight, a.in_proj_bias,
                a.out_proj.weight, a.out_proj.bias, self.final_layer_norm.weight, self.final_layer_norm.bias,
                self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias]

    def cpp_eps(self):
        return [self.self_attn_layer_norm.eps, self.final_layer_norm.eps]

    def cpp_dropouts(self):
        """(dropout, activation dropout, attention dropout) as the ops below apply them: each with the
        training flag of the module that applies it."""
        on = self.training
        return (float(self.dropout) if on else 0.0, float(self.activation_dropout) if on else 0.0,
                _attention_p(self.self_attn))

    def ffn(self, x):
        h, residual = self.final_layer_norm.with_input(x) if self.normalize_before else (x, x)
        f1, f2 = fp8_now(self, 2), fp8_now(self, 3)
        node = fp8_ffn_node(h, self.fc1.weight, self.fc2.weight, f1, f2)
        if node is not None:
            # both projections in FP8: one node with the residual's dropout, the activation and the gradients
            # reaching the projections only as codes
            p_out, p_act = self.cpp_dropouts()[:2]
            x = node.ag_fp8_ffn(h, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, residual,
                                self.activation, p_act, p_out, f1.mode, f1.state, f1.slot, f2.slot,
                                not self.recomputes_activation())[0]
        else:
            if self.recomputes_activation():
                h = ops.bias_act_linear(ops.linear(h, self.fc1.weight, fp8=f1), self.fc1.bias, self.fc2.weight,
                                        self.activation, self.activation_dropout, self.training, fp8=f2)
            else:
                h = ops.bias_act_dropout(ops.linear(h, self.fc1.weight, fp8=f1), self.fc1.bias, self.activation,
                                         self.activation_dropout, self.training)
                h = ops.linear(h, self.fc2.weight, fp8=f2)
            x = ops.bias_dropout_residual(h, self.fc2.bias, residual, self.dropout, self.training)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x
