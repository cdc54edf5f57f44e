"""Self-attention and cross-attention blocks over the public ops (batch-major).

SelfAttention keeps q, k, v projections as ONE weight ``in_proj_weight`` [3C, C] (rows:
q, k, v) so a single GEMM feeds the fused bias-add + head split. CrossAttention owns only
its query and output projections: the key/value projections of all decoder layers live
in the decoder as one batched weight (see ls_fairseq.modules.decoder_layer).
"""

import math
from typing import Dict, Optional

import torch
import torch.nn as nn

from ls_fairseq import ops
from ls_fairseq.ops.attention import attention_probs
from ls_fairseq.ops.fp8 import fp8_now


def xavier_block_(w, gain: float):
    """xavier_uniform_ over a [out, in] block, as if it were its own nn.Linear."""
    fan_out, fan_in = w.shape
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    with torch.no_grad():
        w.uniform_(-bound, bound)


def linear_bias_init_(b, fan_in: int):
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        b.uniform_(-bound, bound)


def check_heads(embed_dim: int, num_heads: int, what: str):
    if num_heads < 1 or embed_dim % num_heads != 0:
        raise ValueError(
            f"{what}: embed_dim {embed_dim} must be divisible by the number of attention heads {num_heads} "
            f"(--encoder-attention-heads / --decoder-attention-heads)"
        )


class SelfAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, attention_dropout: float = 0.0, causal: bool = False):
        super().__init__()
        check_heads(embed_dim, num_heads, "self-attention")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.attention_dropout = attention_dropout
        self.causal = causal
        self.fp8 = None  # Fp8Ref: the projections' slots in the model's FP8 state under --fp8 (ls_fairseq/ops/fp8.py)
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim))
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        self.reset_parameters()

    def reset_parameters(self):
        C = self.embed_dim
        for i in range(3):  # fairseq: each of q, k, v xavier_uniform with gain 1/sqrt(2)
            xavier_block_(self.in_proj_weight[i * C:(i + 1) * C], 1 / math.sqrt(2))
        linear_bias_init_(self.in_proj_bias, C)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x, key_padding_mask=None, cache: Optional[Dict[str, torch.Tensor]] = None, varlen=None):
        """x [B, T, C] -> attention output before out_proj's bias: [B, T, C].

        ``cache`` (incremental decoding): holds prev_key / prev_value [B, H, t, D]; new keys
        and values are appended and stored back. ``varlen`` (:class:`ls_fairseq.ops.attention.Varlen`):
        x [1, N, C] holds packed sequences (no padding).
        """
        return ops.linear(self.attend(x, key_padding_mask, cache, varlen), self.out_proj.weight, fp8=fp8_now(self, 1))

    def attend(self, x, key_padding_mask=None, cache: Optional[Dict[str, torch.Tensor]] = None, varlen=None,
               causal: Optional[bool] = None):
        """The heads' outputs merged, [B, T, C]: what out_proj projects (the layers project it together with the
        block's residual dropout, ops.linear_dropout_residual). ``causal``: overrides the module's own mask
        (fairseq's full_context_alignment attends without it)."""
        q, k, v = ops.linear_split(x, self.in_proj_weight, self.in_proj_bias, 3, self.num_heads, fp8_now(self, 0))
        if cache is not None:
            if "prev_key" in cache:
                k = torch.cat([cache["prev_key"], k], dim=2)
                v = torch.cat([cache["prev_value"], v], dim=2)
            cache["prev_key"], cache["prev_value"] = k, v
        causal = self.causal if causal is None else causal
        out = ops.attention(q, k, v, key_padding_mask=key_padding_mask, causal=causal, p=self.attention_dropout,
                            training=self.training, varlen=varlen)
        return ops.merge_heads(out)


class CrossAttention(nn.Module):
    def __init__(self, embed_dim: int, num_heads: int, attention_dropout: float = 0.0):
        super().__init__()
        check_heads(embed_dim, num_heads, "encoder-decoder attention")
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.attention_dropout = attention_dropout
        self.fp8 = None  # Fp8Ref: the projections' slots in the model's FP8 state under --fp8 (ls_fairseq/ops/fp8.py)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)
        xavier_block_(self.q_proj.weight, 1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def forward(self, x, k, v, key_padding_mask=None, varlen=None):
        """x [B, T, C]; k, v [B, H, S, D] -> output before out_proj's bias [B, T, C]. ``varlen``: packed
        sequences, x [1, Nt, C] and k, v [1, H, Ns, D]."""
        return ops.linear(self.attend(x, k, v, key_padding_mask, varlen), self.out_proj.weight, fp8=fp8_now(self, 1))

    def attend(self, x, k, v, key_padding_mask=None, varlen=None):
        """The heads' outputs merged, [B, T, C]: what out_proj projects."""
        # one node on CUDA: the bias added in the projection's GEMM, the query a view of its output (as in SelfAttention)
        q, = ops.linear_split(x, self.q_proj.weight, self.q_proj.bias, 1, self.num_heads, fp8_now(self, 0))
        out = ops.attention(q, k, v, key_padding_mask=key_padding_mask, causal=False,
                            p=self.attention_dropout, training=self.training, varlen=varlen)
        return ops.merge_heads(out)

    def attend_with_probs(self, x, k, v, key_padding_mask=None):
        """:meth:`attend` (the same output, the same op) and the attention weights [B, H, T, S] in fp32, for
        alignments: computed apart from the fused attention, which never forms them."""
        q, = ops.linear_split(x, self.q_proj.weight, self.q_proj.bias, 1, self.num_heads, fp8_now(self, 0))
        out = ops.attention(q, k, v, key_padding_mask=key_padding_mask, causal=False,
                            p=self.attention_dropout, training=self.training)
        return ops.merge_heads(out), attention_probs(q, k, key_padding_mask)
