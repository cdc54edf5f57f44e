"""ls_transformer's encoder: a FairseqEncoder over ls_fairseq.modules (batch-major inside).

The output dict has fairseq's keys and layouts: encoder_out [T, B, C] (a transposed view
of the batch-major activations), encoder_padding_mask [B, T] (an empty list when the batch has no padding).
"""

from typing import Dict, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fairseq.models import FairseqEncoder

from ls_fairseq import ops
from ls_fairseq.fairseq_ext import weights
from ls_fairseq.fairseq_ext.config import OptionError, activation_dropout_of, setup_embeddings
from ls_fairseq.fairseq_ext.fp8_mode import check_fp8_device
from ls_fairseq.fairseq_ext.packing import self_varlen
from ls_fairseq.modules.encoder_layer import EncoderLayer
from ls_fairseq.modules.layer_norm import LayerNorm
from ls_fairseq.modules.positional import make_positions


class LSTransformerEncoder(FairseqEncoder):
    def __init__(self, cfg, dictionary, embed_tokens):
        super().__init__(dictionary)
        C, self.max_source_positions = setup_embeddings(self, cfg, embed_tokens, "encoder")
        self.layers = nn.ModuleList([
            EncoderLayer(C, cfg.encoder.ffn_embed_dim, cfg.encoder.attention_heads, cfg.dropout,
                         cfg.attention_dropout, activation_dropout_of(cfg), str(cfg.activation_fn),
                         cfg.encoder.normalize_before)
            for _ in range(cfg.encoder.layers)
        ])
        self.num_layers = len(self.layers)
        self.layer_norm = LayerNorm(C) if cfg.encoder.normalize_before else None
        self.fp8_state = None  # the layers' FP8 scaling state under --fp8 (fp8_mode.set_fp8_mode)
        self.fp8_checked = False  # --fp8 checked against the device
        self._register_state_dict_hook(_save_hook)
        self.register_load_state_dict_pre_hook(_load_hook)

    def max_positions(self):
        if self.embed_positions is None:
            return self.max_source_positions
        return min(self.max_source_positions, self.embed_positions.max_positions)

    def forward_embedding(self, src_tokens, token_embedding: Optional[torch.Tensor] = None):
        """fairseq's: (the embedding with positions and dropout [B, T, C], pads not zeroed; the scaled token
        embedding [B, T, C]) in plain PyTorch, with ``token_embedding`` (precomputed [B, T, C]) in place of
        the lookup. The forward itself takes the fused embedding (:meth:`_embed`)."""
        if token_embedding is None:
            token_embedding = self.embed_tokens(src_tokens)
        x = embed = self.embed_scale * token_embedding
        if self.embed_positions is not None:
            table = self.embed_positions.weight_as(x.dtype, x.device)
            x = embed + F.embedding(make_positions(src_tokens, self.padding_idx), table, self.padding_idx)
        return F.dropout(x, self.dropout, self.training), embed

    def _embed(self, src_tokens, positions=None):
        """Token and position embeddings [B, T, C], pads zeroed; ``positions`` (optional): fairseq's position
        numbers of the tokens (a packed batch's, whose padding is gone)."""
        pos = None
        if self.embed_positions is not None:
            if positions is None:
                positions = make_positions(src_tokens, self.padding_idx)
            pos = self.embed_positions.weight_as(self.embed_tokens.weight.dtype, src_tokens.device)
        else:
            positions = None
        return ops.embedding(src_tokens, self.embed_tokens.weight, pos, positions, scale=self.embed_scale,
                             p=self.dropout, training=self.training, padding_idx=self.padding_idx,
                             zero_pad=True)

    def forward(self, src_tokens, src_lengths: Optional[torch.Tensor] = None, return_all_hiddens: bool = False,
                token_embeddings: Optional[torch.Tensor] = None, src_has_padding: Optional[bool] = None,
                packed: Optional[dict] = None):
        """fairseq's encoder forward. ``src_has_padding`` (optional): whether ``src_tokens`` holds any
        padding, when the caller already knows it from the batch on the host (lightseq-train's trainer
        does); without it the encoder tests the tokens on the GPU, which makes the host wait.
        ``packed`` (:mod:`ls_fairseq.fairseq_ext.packing`): run over the batch's real tokens only; the
        output is then packed too ("encoder_out" [tokens, 1, C], no padding mask)."""
        if token_embeddings is not None and (packed is not None or token_embeddings.shape[:2] != src_tokens.shape):
            raise OptionError(f"ls_transformer: token_embeddings must be [batch, length, dim] of src_tokens "
                              f"{tuple(src_tokens.shape)} (and not with a packed batch), got "
                              f"{tuple(token_embeddings.shape)}")
        if self.training and self.fp8_state is not None:  # a training forward begins: the FP8 scales for it
            if not self.fp8_checked:
                check_fp8_device(self.embed_tokens.weight)
                self.fp8_checked = True
            self.fp8_state.begin_forward(self.embed_tokens.weight.device)
        T = int(packed["max_src"]) if packed is not None else src_tokens.shape[1]  # a packing: its longest sentence
        if T > self.max_positions():
            raise ValueError(
                f"source sequence of length {T} exceeds the model's maximum of {self.max_positions()} positions "
                "(--max-source-positions; fairseq skips such samples with --skip-invalid-size-inputs-valid-test)"
            )
        if packed is not None:
            return self._forward_packed(packed, src_lengths, return_all_hiddens)
        padding_mask = src_tokens.eq(self.padding_idx)
        # fairseq sorts batches by length, so many have no source padding at all; without a
        # mask attention takes the flash kernels. This is the forward pass's only host-side
        # test of GPU data, made first, while the GPU queue is short; the decoder reuses it
        # (an empty "encoder_padding_mask" list means: no padding).
        has_pads = bool(padding_mask.any()) if src_has_padding is None else bool(src_has_padding)
        key_padding_mask = padding_mask if has_pads else None
        if token_embeddings is None:
            x = self._embed(src_tokens)  # [B, T, C], pads zeroed
        else:  # fairseq's precomputed embeddings: the plain PyTorch embedding, pads zeroed as fairseq does
            x = self.forward_embedding(src_tokens, token_embeddings)[0]
            x = x.masked_fill(padding_mask.unsqueeze(-1), 0.0) if has_pads else x
        x, states = self._layers(x, key_padding_mask, None, return_all_hiddens)
        return _output(x, [padding_mask] if has_pads else [], states, src_lengths)

    def _forward_packed(self, packed, src_lengths, return_all_hiddens: bool):
        x = self._embed(packed["src_tokens"], packed["src_positions"])  # [1, N, C]
        x, states = self._layers(x, None, self_varlen(packed, "src"), return_all_hiddens)
        return _output(x, [], states, src_lengths)

    def _layers(self, x, key_padding_mask, varlen, return_all_hiddens: bool):
        """The layers (over padded sentences with their mask, or packed ones with varlen) and the final layer
        norm: (x, the embedding's and each layer's output [T, B, C] when return_all_hiddens, as fairseq's)."""
        states: List[torch.Tensor] = [x.transpose(0, 1)] if return_all_hiddens else []
        for layer in self.layers:
            if self.checkpoint_activations and self.training:
                x = checkpoint(layer, x, key_padding_mask, varlen, use_reentrant=False)
            else:
                x = layer(x, key_padding_mask, varlen)
            if return_all_hiddens:
                states.append(x.transpose(0, 1))
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return x, states

    @torch.jit.export
    def reorder_encoder_out(self, encoder_out: Dict[str, List[torch.Tensor]], new_order):
        def bm_select(t):  # [T, B, C] view of batch-major data: select on the batch-major tensor
            return t.transpose(0, 1).index_select(0, new_order).transpose(0, 1)

        out = dict(encoder_out)
        out["encoder_out"] = [bm_select(t) for t in encoder_out["encoder_out"]]
        out["encoder_padding_mask"] = [t.index_select(0, new_order) for t in encoder_out["encoder_padding_mask"]]
        out["encoder_embedding"] = [t.index_select(0, new_order) for t in encoder_out["encoder_embedding"]]
        out["encoder_states"] = [bm_select(t) for t in encoder_out["encoder_states"]]
        out["src_tokens"] = [t.index_select(0, new_order) for t in encoder_out.get("src_tokens", [])]
        out["src_lengths"] = [t.index_select(0, new_order) for t in encoder_out.get("src_lengths", [])]
        return out

    def upgrade_state_dict_named(self, state_dict, name):
        return state_dict


def _output(x, padding_mask: List[torch.Tensor], states: List[torch.Tensor], src_lengths):
    return {
        "encoder_out": [x.transpose(0, 1)],  # T x B x C
        "encoder_padding_mask": padding_mask,  # B x T
        "encoder_embedding": [],
        "encoder_states": states,
        "fc_results": [],
        "src_tokens": [],
        "src_lengths": [src_lengths] if src_lengths is not None else [],
    }


def _save_hook(module, state_dict, prefix, local_metadata):
    weights.fused_to_native_self_attn(state_dict, prefix, module.num_layers)
    return state_dict


def _load_hook(module, state_dict, prefix, *args):
    weights.check_vocab(state_dict, prefix, module.embed_tokens.num_embeddings, "source")
    weights.native_to_fused_self_attn(state_dict, prefix, module.num_layers)
