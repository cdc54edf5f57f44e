"""ls_transformer's decoder: a FairseqIncrementalDecoder over ls_fairseq.modules.

Cross-attention keys/values of ALL layers come from one GEMM (BatchedCrossKV). During
incremental decoding they are computed once per sentence, kept in the incremental state
with each layer's self-attention cache, and reordered with the beam. fairseq's alignments (the "attn"
output) are formed only when asked for (docs/interface.md): other calls keep the fused layers.
"""

from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fairseq.models import FairseqIncrementalDecoder

from ls_fairseq import ops
from ls_fairseq.fairseq_ext import weights
from ls_fairseq.fairseq_ext.config import OptionError, activation_dropout_of, setup_embeddings
from ls_fairseq.fairseq_ext.packing import cross_varlen
from ls_fairseq.modules.decoder_layer import BatchedCrossKV, DecoderLayer
from ls_fairseq.modules.layer_norm import LayerNorm
from ls_fairseq.modules.positional import make_positions
from ls_fairseq.ops.fp8 import fp8_now


def _right_padded_only(pad_mask):
    """True when every row's padding sits after its last real token."""
    return bool((pad_mask[:, 1:].int() - pad_mask[:, :-1].int()).ge(0).all())


class LSTransformerDecoder(FairseqIncrementalDecoder):
    def __init__(self, cfg, dictionary, embed_tokens):
        super().__init__(dictionary)
        C, self.max_target_positions = setup_embeddings(self, cfg, embed_tokens, "decoder")
        L = cfg.decoder.layers
        self.num_layers = L
        self.layers = nn.ModuleList([
            DecoderLayer(C, cfg.decoder.ffn_embed_dim, cfg.decoder.attention_heads, cfg.dropout,
                         cfg.attention_dropout, activation_dropout_of(cfg), str(cfg.activation_fn),
                         cfg.decoder.normalize_before)
            for _ in range(L)
        ])
        self.encoder_attn_kv = BatchedCrossKV(C, cfg.decoder.attention_heads, L)
        self.fp8_state = None  # the model's FP8 scaling state under --fp8 (fp8_mode.set_fp8_mode), as the encoder's
        self.layer_norm = (
            LayerNorm(C) if cfg.decoder.normalize_before and not cfg.no_decoder_final_norm else None
        )
        # True when the task right-pads targets (fairseq's default, --left-pad-target False):
        # then the causal mask alone hides every pad key from every real query and no
        # padding mask (nor a host-side test for padding) is needed. None = test each batch.
        self.right_padded_targets = None
        self.recompute_logits = False  # --ls-recompute-logits: the criterion projects and scores in blocks
        # fairseq's need_attn (prepare_for_inference_ with --print-alignment): return the alignment layer's
        # cross-attention weights in evaluation; otherwise they are computed only when a caller names
        # alignment_layer / alignment_heads / full_context_alignment (docs/interface.md)
        self.need_attn = False
        self.share_input_output_embed = cfg.share_decoder_input_output_embed
        self.output_projection = nn.Linear(C, len(dictionary), bias=False)
        if self.share_input_output_embed:
            self.output_projection.weight = self.embed_tokens.weight
        else:
            nn.init.normal_(self.output_projection.weight, mean=0, std=C ** -0.5)
        self._register_state_dict_hook(_save_hook)
        self.register_load_state_dict_pre_hook(_load_hook)

    def max_positions(self):
        if self.embed_positions is None:
            return self.max_target_positions
        return min(self.max_target_positions, self.embed_positions.max_positions)

    # ------------------------------------------------------------------ forward
    def forward(self, prev_output_tokens, encoder_out: Optional[Dict[str, List[torch.Tensor]]] = None,
                incremental_state: Optional[Dict[str, Dict[str, Optional[torch.Tensor]]]] = None,
                features_only: bool = False, full_context_alignment: bool = False,
                alignment_layer: Optional[int] = None, alignment_heads: Optional[int] = None,
                src_lengths: Optional[Any] = None, return_all_hiddens: bool = False,
                logit_rows: Optional[torch.Tensor] = None, packed: Optional[dict] = None):
        """Logits [B, T, V], or with ``logit_rows`` (int64 [N] indices into the B * T flattened
        positions) logits [N, V] of those positions only: the vocabulary projection, its two
        backward GEMMs and the loss then skip padding. ``features_only``: the features before the
        vocabulary projection (of those rows, with ``logit_rows``). ``packed``
        (:mod:`ls_fairseq.fairseq_ext.packing`, with the encoder's packed output): over the real tokens
        only; needs ``logit_rows``, whose rows it holds in packed numbering."""
        if logit_rows is not None and incremental_state is not None:
            raise ValueError("logit_rows is for training and scoring, not incremental decoding")
        if packed is not None:
            if logit_rows is None or incremental_state is not None:
                raise ValueError("a packed batch is for training and scoring with logit_rows")
            if logit_rows.shape != packed["rows"].shape:
                raise ValueError(f"logit_rows {tuple(logit_rows.shape)} and the packing's rows "
                                 f"{tuple(packed['rows'].shape)} differ: the packing is of another batch")
            if full_context_alignment or alignment_layer is not None or alignment_heads is not None:
                raise ValueError("ls_transformer: alignments (alignment_layer, alignment_heads, "
                                 "full_context_alignment) are not computed over a packed batch")
            x, extra = self.extract_packed_features(packed, encoder_out, return_all_hiddens)
            return (x if features_only else self.output_layer(x)), extra
        x, extra = self.extract_features(prev_output_tokens, encoder_out, incremental_state, full_context_alignment,
                                         alignment_layer, alignment_heads, rows=logit_rows)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def _embed(self, prev_output_tokens, incremental: bool, positions=None):
        pos = None
        if self.embed_positions is not None:
            if positions is None:
                positions = make_positions(prev_output_tokens, self.padding_idx)
            if incremental:
                positions = positions[:, -1:]
            pos = self.embed_positions.weight_as(self.embed_tokens.weight.dtype, prev_output_tokens.device)
        else:
            positions = None
        tokens = prev_output_tokens[:, -1:] if incremental else prev_output_tokens
        return ops.embedding(tokens, self.embed_tokens.weight, pos, positions, scale=self.embed_scale,
                             p=self.dropout, training=self.training, padding_idx=self.padding_idx,
                             zero_pad=False)

    def _cross_kv(self, encoder_out, state):
        if state is not None and "cross_kv" in state:
            return state["cross_kv"]
        enc = encoder_out["encoder_out"][0].transpose(0, 1)  # [B, S, C]
        kv = self.encoder_attn_kv(enc)
        if state is not None:
            state["cross_kv"] = kv
        return kv

    def make_generation_fast_(self, need_attn: bool = False, retain_dropout: bool = False, **kwargs):
        """fairseq's inference preparation (prepare_for_inference_): ``need_attn`` (--print-alignment) makes
        evaluation return the alignment layer's attention weights; --retain-dropout is refused."""
        if retain_dropout:
            raise OptionError("ls_transformer: --retain-dropout (dropout at inference) is not supported: its fused "
                              "layers apply dropout only in training mode")
        self.need_attn = bool(need_attn)

    def _alignment_layer(self, full_context_alignment, alignment_layer, alignment_heads):
        """The layer whose cross-attention weights the call returns (fairseq's default: the last), or -1 when
        none is asked for: then no weights are formed."""
        if alignment_layer is None and alignment_heads is None and not full_context_alignment:
            return self.num_layers - 1 if self.need_attn and not self.training else -1
        if alignment_heads is not None and int(alignment_heads) < 1:
            raise OptionError(f"ls_transformer: alignment_heads must be >= 1, got {alignment_heads}")
        if alignment_layer is None:
            return self.num_layers - 1
        if not 0 <= int(alignment_layer) < self.num_layers:
            raise OptionError(f"ls_transformer: alignment_layer {alignment_layer} is out of range: the decoder has "
                              f"{self.num_layers} layers (0 to {self.num_layers - 1})")
        return int(alignment_layer)

    def extract_features(self, prev_output_tokens, encoder_out=None, incremental_state=None,
                         full_context_alignment: bool = False, alignment_layer: Optional[int] = None,
                         alignment_heads: Optional[int] = None, rows=None, **unused):
        """Features [B, T, C]; with ``rows`` (int64 indices into the B * T positions) [N, C] of those rows only,
        selected before the final layer norm (row-wise, so the same values), which then keeps only them.
        The extra output's "attn" holds, as fairseq's decoder does, the alignment layer's cross-attention
        weights averaged over the first ``alignment_heads`` heads ([B, T, S]), when asked for (see
        :meth:`_alignment_layer`; None otherwise); ``full_context_alignment``: no causal mask (not incremental)."""
        attn_layer = self._alignment_layer(full_context_alignment, alignment_layer, alignment_heads)
        if encoder_out is None or len(encoder_out["encoder_out"]) == 0:
            raise ValueError("ls_transformer's decoder needs the encoder output")
        T = prev_output_tokens.shape[1]
        if T > self.max_positions():
            raise ValueError(
                f"target sequence of length {T} exceeds the model's maximum of {self.max_positions()} positions "
                "(--max-target-positions)"
            )
        incremental = incremental_state is not None
        state = None
        if incremental:
            state = self.get_incremental_state(incremental_state, "ls_state")
            if state is None:
                state = {"layers": [{} for _ in range(self.num_layers)]}
                self.set_incremental_state(incremental_state, "ls_state", state)

        x = self._embed(prev_output_tokens, incremental)  # [B, T or 1, C]
        self_pad = None
        causal = incremental or not full_context_alignment
        if not causal:  # every key visible: padding must be masked (as fairseq does)
            pad = prev_output_tokens.eq(self.padding_idx)
            self_pad = pad if bool(pad.any()) else None
        elif not incremental and not self.right_padded_targets:
            pad = prev_output_tokens.eq(self.padding_idx)
            # With right padding the causal mask already hides every pad key from every real
            # query, so the explicit mask (which rules out the fastest attention kernels) is
            # needed only when some row has padding before a real token.
            if bool(pad.any()) and not _right_padded_only(pad):
                self_pad = pad
        enc_pad = encoder_out["encoder_padding_mask"][0] if len(encoder_out["encoder_padding_mask"]) else None
        kv = self._cross_kv(encoder_out, state)
        if attn_layer < 0 and causal:
            return self._layers(x, kv, enc_pad, self_pad, state, None, rows, True)
        return self._layers_with_attn(x, kv, enc_pad, self_pad, state, rows, attn_layer, alignment_heads, causal)

    def extract_packed_features(self, packed, encoder_out, return_all_hiddens: bool = False, every_row: bool = False):
        """Features [R, C] of the packing's counted rows, over the packed batch (the encoder's output packed
        with it); ``every_row``: of every packed row instead, [1, N, C]."""
        if encoder_out is None or len(encoder_out["encoder_out"]) == 0:
            raise ValueError("ls_transformer's decoder needs the encoder output")
        x = self._embed(packed["tgt_tokens"], False, packed["tgt_positions"])  # [1, Nt, C]
        kv = self._cross_kv(encoder_out, None)  # each [1, H, Ns, D]
        rows = None if every_row else packed["rows"]
        return self._layers(x, kv, None, None, None, cross_varlen(packed), rows, return_all_hiddens)

    def _layers(self, x, kv, enc_pad, self_pad, state, varlen, rows, every_layer: bool):
        """The layers over x (with each layer's cache while decoding incrementally: ``state``; over packed
        sentences: ``varlen``), then ``rows`` of the flattened positions (all with None) through the final layer
        norm: (x, fairseq's extra output; inner_states holds every layer's output with ``every_layer``)."""
        inner_states: List[Optional[torch.Tensor]] = [x.transpose(0, 1)]
        for i, layer in enumerate(self.layers):
            k, v = kv[2 * i], kv[2 * i + 1]
            if state is not None:
                x = layer(x, k, v, enc_pad, None, cache=state["layers"][i])
            elif self.checkpoint_activations and self.training:
                x = checkpoint(layer, x, k, v, enc_pad, self_pad, None, varlen, use_reentrant=False)
            else:
                x = layer(x, k, v, enc_pad, self_pad, varlen=varlen)
            if every_layer:
                inner_states.append(x.transpose(0, 1))
        if self.training and self.fp8_state is not None:  # the body's FP8 projections have run
            self.fp8_state.end_body()
        if rows is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, rows)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return x, {"attn": [None], "inner_states": inner_states}

    def _layers_with_attn(self, x, kv, enc_pad, self_pad, state, rows, attn_layer: int, heads, causal: bool):
        """:meth:`_layers` through each layer's forward_with_attn, for alignments: layer ``attn_layer``'s
        cross-attention weights averaged over its first ``heads`` heads (all with None) as "attn"."""
        inner_states: List[Optional[torch.Tensor]] = [x.transpose(0, 1)]
        attn = None
        for i, layer in enumerate(self.layers):
            cache = state["layers"][i] if state is not None else None
            x, probs = layer.forward_with_attn(x, kv[2 * i], kv[2 * i + 1], enc_pad, self_pad, cache, causal,
                                               i == attn_layer)
            if probs is not None:
                attn = (probs if heads is None else probs[:, :int(heads)]).mean(dim=1).to(x.dtype)
            inner_states.append(x.transpose(0, 1))
        if self.training and self.fp8_state is not None:
            self.fp8_state.end_body()
        if rows is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, rows)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        return x, {"attn": [attn], "inner_states": inner_states}

    def output_layer(self, features):
        # under --fp8 (training only) the vocabulary projection's slot in the FP8 state, else None
        return ops.linear(features, self.output_projection.weight, fp8=fp8_now(self.output_projection))

    # ------------------------------------------------------------- beam search
    def reorder_incremental_state(self, incremental_state, new_order):
        state = self.get_incremental_state(incremental_state, "ls_state")
        if state is None:
            return
        if "cross_kv" in state:
            state["cross_kv"] = [t.index_select(0, new_order) for t in state["cross_kv"]]
        for cache in state["layers"]:
            for key in list(cache.keys()):
                cache[key] = cache[key].index_select(0, new_order)
        self.set_incremental_state(incremental_state, "ls_state", state)

    def upgrade_state_dict_named(self, state_dict, name):
        return state_dict


def _save_hook(module, state_dict, prefix, local_metadata):
    weights.fused_to_native_self_attn(state_dict, prefix, module.num_layers)
    weights.fused_to_native_cross_kv(state_dict, prefix, module.num_layers)
    return state_dict


def _load_hook(module, state_dict, prefix, *args):
    weights.check_vocab(state_dict, prefix, module.embed_tokens.num_embeddings, "target")
    weights.native_to_fused_self_attn(state_dict, prefix, module.num_layers)
    weights.native_to_fused_cross_kv(state_dict, prefix, module.num_layers)
