"""Transformer decoder layer and the layer-batched cross-attention key/value projection.

The encoder output is the same input to every decoder layer's key/value projection, so
:class:`BatchedCrossKV` holds all layers' K/V weights as one [n_layers * 2C, C] matrix
(rows per layer: k then v) and computes them with ONE GEMM; a single split op cuts the
result into 2 * n_layers head-split tensors. In backward, every layer's dK/dV lands in
one buffer and one GEMM produces the encoder-output gradient.
"""

import math
from typing import Dict, List, Optional

import torch
import torch.nn as nn

from ls_fairseq import ops
from ls_fairseq.modules.attention import (CrossAttention, SelfAttention, check_heads, linear_bias_init_,
                                          xavier_block_)
from ls_fairseq.modules.encoder_layer import EncoderLayer, _attention_p
from ls_fairseq.modules.layer_norm import LayerNorm
from ls_fairseq.ops.fp8 import fp8_now


class BatchedCrossKV(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, num_layers: int):
        super().__init__()
        check_heads(embed_dim, num_heads, "encoder-decoder attention")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.fp8 = None  # Fp8Ref: the projection's slot in the model's FP8 state under --fp8 (ls_fairseq/ops/fp8.py)
        self.weight = nn.Parameter(torch.empty(num_layers * 2 * embed_dim, embed_dim))
        self.bias = nn.Parameter(torch.empty(num_layers * 2 * embed_dim))
        C = embed_dim
        for j in range(2 * num_layers):
            xavier_block_(self.weight[j * C:(j + 1) * C], 1 / math.sqrt(2))
        linear_bias_init_(self.bias, C)

    def forward(self, encoder_out) -> List[torch.Tensor]:
        """encoder_out [B, S, C] -> [k_0, v_0, k_1, v_1, ...], each [B, H, S, D]."""
        return ops.linear_split(encoder_out, self.weight, self.bias, 2 * self.num_layers, self.num_heads,
                                fp8_now(self))


class DecoderLayer(EncoderLayer):
    """Causal self-attention, cross-attention on precomputed K/V, then the FFN."""

    def __init__(self, embed_dim: int, ffn_dim: int, num_heads: int, dropout: float = 0.1,
                 attention_dropout: float = 0.0, activation_dropout: float = 0.0,
                 activation: str = "relu", normalize_before: bool = False):
        super().__init__(embed_dim, ffn_dim, num_heads, dropout, attention_dropout, activation_dropout,
                         activation, normalize_before)
        self.self_attn = SelfAttention(embed_dim, num_heads, attention_dropout, causal=True)
        self.encoder_attn = CrossAttention(embed_dim, num_heads, attention_dropout)
        self.encoder_attn_layer_norm = LayerNorm(embed_dim)

    def forward(self, x, cross_k, cross_v, encoder_padding_mask=None, self_attn_padding_mask=None,
                cache: Optional[Dict[str, torch.Tensor]] = None, varlen=None):
        """``varlen`` (:class:`ls_fairseq.ops.attention.Varlen` of the cross-attention: the targets' rows as
        queries, the sources' as keys; no masks, no cache): x [1, Nt, C] and cross_k, cross_v [1, H, Ns, D]
        hold packed sentences."""
        mod = self.cpp_module(x) if cache is None else None
        if mod is not None:  # the same nodes as below, recorded by one C++ call (csrc/torch/layers.cpp)
            args = (x, cross_k, cross_v, encoder_padding_mask, self_attn_padding_mask, *self.cpp_args())
            if varlen is None:
                return mod.decoder_layer_fwd(*args)
            return mod.decoder_layer_fwd(*args, varlen.cu_q, varlen.max_q, varlen.cu_k, varlen.max_k)
        self_varlen = None if varlen is None else varlen._replace(cu_k=varlen.cu_q, max_k=varlen.max_q)
        h, residual = self.self_attn_layer_norm.with_input(x) if self.normalize_before else (x, x)
        x = self.attention_end(self.self_attn, self.self_attn.attend(h, self_attn_padding_mask, cache, self_varlen),
                               residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        h, residual = self.encoder_attn_layer_norm.with_input(x) if self.normalize_before else (x, x)
        x = self.attention_end(self.encoder_attn,
                               self.encoder_attn.attend(h, cross_k, cross_v, encoder_padding_mask, varlen), residual)
        if not self.normalize_before:
            x = self.encoder_attn_layer_norm(x)
        return self.ffn(x)

    def forward_with_attn(self, x, cross_k, cross_v, encoder_padding_mask=None, self_attn_padding_mask=None,
                          cache: Optional[Dict[str, torch.Tensor]] = None, causal: bool = True,
                          need_attn: bool = True):
        """:meth:`forward` through the Python ops, returning (x, the cross-attention weights [B, H, T, S] in
        fp32 with ``need_attn``, else None); ``causal=False``: self-attention without the causal mask
        (fairseq's full_context_alignment). For alignments only: training and decoding take :meth:`forward`."""
        h, residual = self.self_attn_layer_norm.with_input(x) if self.normalize_before else (x, x)
        x = self.attention_end(self.self_attn, self.self_attn.attend(h, self_attn_padding_mask, cache, causal=causal),
                               residual)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        h, residual = self.encoder_attn_layer_norm.with_input(x) if self.normalize_before else (x, x)
        probs = None
        if need_attn:
            h, probs = self.encoder_attn.attend_with_probs(h, cross_k, cross_v, encoder_padding_mask)
        else:
            h = self.encoder_attn.attend(h, cross_k, cross_v, encoder_padding_mask)
        x = self.attention_end(self.encoder_attn, h, residual)
        if not self.normalize_before:
            x = self.encoder_attn_layer_norm(x)
        return self.ffn(x), probs

    def cpp_weights(self):
        e = self.encoder_attn
        return super().cpp_weights() + [self.encoder_attn_layer_norm.weight, self.encoder_attn_layer_norm.bias,
                                        e.q_proj.weight, e.q_proj.bias, e.out_proj.weight, e.out_proj.bias]

    def cpp_eps(self):
        return super().cpp_eps() + [self.encoder_attn_layer_norm.eps]

    def cpp_dropouts(self):
        """The encoder layer's three, then the encoder-attention's dropout."""
        return (*super().cpp_dropouts(), _attention_p(self.encoder_attn))
