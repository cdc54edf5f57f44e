"""Transformer encoder layer (post-LN or pre-LN, relu or gelu) over the fused ops.

Parameter names follow fairseq's TransformerEncoderLayer except the fused
``self_attn.in_proj_weight/bias`` (translated to q_proj/k_proj/v_proj on save/load).
"""

import torch.nn as nn

from ls_fairseq import ops
from ls_fairseq.modules.attention import SelfAttention
from ls_fairseq.modules.layer_norm import LayerNorm
from ls_fairseq.ops._checks import check_activation, check_dropout


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
        self.self_attn = SelfAttention(embed_dim, num_heads, attention_dropout, causal=False)
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.final_layer_norm = LayerNorm(embed_dim)

    def forward(self, x, key_padding_mask=None):
        """x [B, T, C]; key_padding_mask [B, T] (True = pad) or None."""
        h, residual = self.self_attn_layer_norm.with_input(x) if self.normalize_before else (x, x)
        h = self.self_attn(h, key_padding_mask=key_padding_mask)
        x = ops.bias_dropout_residual(h, self.self_attn.out_proj.bias, residual, self.dropout, self.training)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)
        return self.ffn(x)

    def ffn(self, x):
        h, residual = self.final_layer_norm.with_input(x) if self.normalize_before else (x, x)
        h = ops.linear(h, self.fc1.weight)
        h = ops.bias_act_dropout(h, self.fc1.bias, self.activation, self.activation_dropout, self.training)
        h = ops.linear(h, self.fc2.weight)
        x = ops.bias_dropout_residual(h, self.fc2.bias, residual, self.dropout, self.training)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x
