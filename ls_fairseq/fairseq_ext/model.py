"""Registration of the ``ls_transformer`` model and its architectures.

ls_transformer takes every flag of fairseq's ``transformer`` (same argument parser), and
each ``ls_<arch>`` applies exactly fairseq's ``<arch>`` hyperparameters. Flags the fused
implementation cannot honour are rejected by name (see config.check_supported).
"""

from typing import Optional

import torch
from fairseq.models import register_model, register_model_architecture
from fairseq.models.transformer import TransformerConfig
from fairseq.models.transformer import transformer_legacy as native

from ls_fairseq.fairseq_ext.config import OptionError, check_supported
from ls_fairseq.fairseq_ext.decoder import LSTransformerDecoder
from ls_fairseq.fairseq_ext.encoder import LSTransformerEncoder
from ls_fairseq.fairseq_ext.fp8_mode import add_fp8_args, set_fp8_mode
from ls_fairseq.fairseq_ext.memory_modes import add_memory_args, set_memory_modes


@register_model("ls_transformer")
class LSTransformerModel(native.TransformerModel):
    """fairseq's Transformer with fused kernels and layer-batched cross-attention K/V.

    Its state dict uses the native parameter names, so checkpoints of ``transformer_*``
    and ``ls_transformer_*`` load into each other.
    """

    # every encoder / decoder layer uses its own parameters only while it is called, and nobody
    # else's: the sharded ls_adam may let the forward wait for each layer's weights on its own
    # (ls_fairseq.optim.gather_waits)
    ls_gather_waits = True

    @classmethod
    def hub_models(cls):
        return {}

    @classmethod
    def add_args(cls, parser):
        super().add_args(parser)
        add_fp8_args(parser)
        add_memory_args(parser)

    @staticmethod
    def check_args(args) -> None:
        """Raise OptionError naming every flag of the parsed ``args`` that ls_transformer cannot honour (the
        architecture's defaults filled in first, as for building)."""
        native.base_architecture(args)
        check_supported(TransformerConfig.from_namespace(args))

    @classmethod
    def build_model(cls, args, task):
        cls.check_args(args)
        model = super().build_model(args, task)
        set_fp8_mode(model, args)
        set_memory_modes(model, args)
        task_cfg = getattr(task, "cfg", None)
        left_pad = getattr(task_cfg, "left_pad_target", None) if task_cfg is not None else None
        if left_pad is not None:
            model.decoder.right_padded_targets = not left_pad
        return model

    def forward(self, src_tokens, src_lengths, prev_output_tokens, return_all_hiddens: bool = True,
                features_only: bool = False, alignment_layer: Optional[int] = None,
                alignment_heads: Optional[int] = None, logit_rows: Optional[torch.Tensor] = None,
                src_has_padding: Optional[bool] = None, packed: Optional[dict] = None):
        """fairseq's encoder-decoder forward; ``logit_rows`` (int64 [N], indices into the flattened
        [batch * length] target positions) makes the decoder return logits [N, vocab] for those rows
        only (ls_label_smoothed_cross_entropy passes the non-padding positions); ``src_has_padding``
        tells the encoder whether the source has padding (see LSTransformerEncoder.forward);
        ``packed`` (:func:`ls_fairseq.fairseq_ext.packing.pack_batch` of the batch) runs both over the
        batch's real tokens only, with ``logit_rows``."""
        encoder_out = self.encoder(src_tokens, src_lengths=src_lengths, return_all_hiddens=return_all_hiddens,
                                   src_has_padding=src_has_padding, packed=packed)
        return self.decoder(prev_output_tokens, encoder_out=encoder_out, features_only=features_only,
                            alignment_layer=alignment_layer, alignment_heads=alignment_heads,
                            src_lengths=src_lengths, return_all_hiddens=return_all_hiddens, logit_rows=logit_rows,
                            packed=packed)

    def prepare_for_inference_(self, cfg):
        """fairseq's preparation for generation; under ``--bf16`` the weights in bfloat16 too (fairseq's generate
        casts only under ``--fp16``: without this a --bf16 run would decode in fp32 and say nothing)."""
        common = getattr(cfg, "common", None)
        if common is not None and getattr(common, "bf16", False) and not getattr(common, "fp16", False):
            self.to(torch.bfloat16)
        return super().prepare_for_inference_(cfg)

    def __prepare_scriptable__(self):
        """torch.jit.script calls this first: refuse by name instead of failing deep in TorchScript's compiler."""
        raise OptionError("ls_transformer cannot be compiled by TorchScript (torch.jit.script): its layers call "
                          "fused ops; script the native model instead (lightseq-convert --to native)")

    def set_num_updates(self, num_updates):
        """Pass the update count to the submodules that use it.

        fairseq's default walks every submodule on every update (and the encoder walks its own
        again) to find them; no ls_transformer module uses the count, so the walk is made once and
        only modules whose class has its own ``set_num_updates`` (not fairseq's walking default)
        are called. The module tree of a built model does not change while it trains."""
        targets = self.__dict__.get("_ls_num_update_targets")
        if targets is None:
            from fairseq.models import BaseFairseqModel, FairseqEncoder

            walkers = (None, BaseFairseqModel.set_num_updates, FairseqEncoder.set_num_updates)
            targets = [m for m in self.modules()
                       if m is not self and getattr(type(m), "set_num_updates", None) not in walkers]
            self._ls_num_update_targets = targets
        for m in targets:
            m.set_num_updates(num_updates)

    @classmethod
    def build_encoder(cls, cfg, src_dict, embed_tokens):
        return LSTransformerEncoder(TransformerConfig.from_namespace(cfg), src_dict, embed_tokens)

    @classmethod
    def build_decoder(cls, cfg, tgt_dict, embed_tokens):
        return LSTransformerDecoder(TransformerConfig.from_namespace(cfg), tgt_dict, embed_tokens)


# ls arch name -> fairseq's arch function with the same hyperparameters
ARCHS = {
    "ls_transformer": native.base_architecture,
    "ls_transformer_tiny": native.tiny_architecture,
    "ls_transformer_iwslt_de_en": native.transformer_iwslt_de_en,
    "ls_transformer_wmt_en_de": native.transformer_wmt_en_de,
    "ls_transformer_vaswani_wmt_en_de_big": native.transformer_vaswani_wmt_en_de_big,
    "ls_transformer_vaswani_wmt_en_fr_big": native.transformer_vaswani_wmt_en_fr_big,
    "ls_transformer_wmt_en_de_big": native.transformer_wmt_en_de_big,
    "ls_transformer_wmt_en_de_big_t2t": native.transformer_wmt_en_de_big_t2t,
}


def _make_arch(fn):
    def arch(args):
        fn(args)

    arch.__doc__ = f"Hyperparameters of fairseq's {fn.__name__}."
    return arch


for _name, _fn in ARCHS.items():
    register_model_architecture("ls_transformer", _name)(_make_arch(_fn))
