"""Token embedding x scale + positional embedding + dropout, in one pass.

Shapes: tokens [B, T] (int64); weight [V, C]; pos_weight [P, C] or None; positions [B, T]
(int64 rows of pos_weight, as fairseq's make_positions gives them) or None.
Output [B, T, C] in weight's dtype. With ``zero_pad`` the rows whose token is
``padding_idx`` are zeroed (fairseq's encoder does this). The gradient of ``weight`` is
not accumulated into row ``padding_idx`` (nn.Embedding's padding_idx semantics); the
gradient of ``pos_weight`` is produced only if it requires grad (learned positions).
"""


import torch
import torch.nn.functional as F

from ls_fairseq.ops._checks import check_dropout, up
from ls_fairseq.ops._dispatch import kernel_module
from ls_fairseq.ops._kernels import call, unpack_mask


def embedding_reference(tokens, weight, pos_weight=None, positions=None, scale: float = 1.0, p: float = 0.0,
                        training: bool = True, padding_idx: int = 1, zero_pad: bool = False, mask=None):
    x = up(F.embedding(tokens, weight, padding_idx=padding_idx)) * scale
    if pos_weight is not None:
        x = x + up(F.embedding(positions, pos_weight, padding_idx=padding_idx))
    if training and p > 0.0:
        if mask is None:
            mask = torch.rand_like(x) >= p
        x = x * mask.to(x.dtype) / (1.0 - p)
    if zero_pad:
        x = x.masked_fill(tokens.eq(padding_idx).unsqueeze(-1), 0.0)
    return x.to(weight.dtype)


def _check(tokens, weight, pos_weight, positions, p):
    check_dropout(p)
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"embedding: tokens must be an integer [batch, length] tensor, got {tuple(tokens.shape)} {tokens.dtype}")
    if pos_weight is not None:
        if positions is None or positions.shape != tokens.shape:
            raise ValueError("embedding: positions must be given with tokens' shape when pos_weight is given")
        if pos_weight.shape[-1] != weight.shape[-1]:
            raise ValueError(
                f"embedding: positional width {pos_weight.shape[-1]} != token embedding width {weight.shape[-1]}"
            )


def embedding(tokens, weight, pos_weight=None, positions=None, *, scale: float = 1.0, p: float = 0.0,
              training: bool = True, padding_idx: int = 1, zero_pad: bool = False, return_mask: bool = False):
    _check(tokens, weight, pos_weight, positions, p)
    mod = kernel_module("embedding", tokens, weight, pos_weight, positions)
    if mod is not None:
        return _fused(mod, tokens, weight, pos_weight, positions, scale, p, training, padding_idx, zero_pad,
                      return_mask)
    mask = None
    if return_mask and training and p > 0.0:
        mask = torch.rand(tuple(tokens.shape) + (weight.shape[-1],), device=weight.device) >= p
    out = embedding_reference(tokens, weight, pos_weight, positions, scale, p, training, padding_idx, zero_pad, mask)
    return (out, mask) if return_mask else out


def deterministic() -> bool:
    """Whether bit-identical gradients are asked for (``torch.use_deterministic_algorithms(True)``).

    The fused embedding backward is sort-based and deterministic in every mode, so this only
    documents the contract; kernels that gain a faster atomic path must check it.
    """
    return torch.are_deterministic_algorithms_enabled()


class _EmbeddingFn(torch.autograd.Function):
    """Saves tokens, positions and the dropout bitmask; the backward sorts the keys and sums runs."""

    @staticmethod
    def forward(ctx, tokens, weight, pos_weight, positions, scale, p, padding_idx, zero_pad):
        out, mask = call("embedding_fwd", tokens, weight.contiguous(), pos_weight, positions, float(scale), float(p),
                         int(padding_idx), bool(zero_pad))
        ctx.save_for_backward(tokens, positions, mask)
        ctx.weight_key = weight.data_ptr()  # its gradient's sink, if the CUDA-graph step names one (embedding.cpp)
        ctx.meta = (float(scale), float(p), int(padding_idx), bool(zero_pad), weight.shape[0],
                    pos_weight.shape[0] if pos_weight is not None else 0,
                    pos_weight.dtype if pos_weight is not None else None)
        ctx.mark_non_differentiable(mask)
        return out, mask

    @staticmethod
    def backward(ctx, g, _gmask=None):
        tokens, positions, mask = ctx.saved_tensors
        scale, p, padding_idx, zero_pad, V, P, pos_dtype = ctx.meta
        g = g.contiguous()
        keep = 1.0 / (1.0 - p) if p > 0 else 1.0
        m = mask if p > 0 else None
        gw = gp = None
        if ctx.needs_input_grad[1]:
            # None when written into the table's gradient sink (only while the CUDA-graph step captures a backward)
            sink = () if torch.compiler.is_compiling() else (ctx.weight_key,)
            gw = call("embedding_bwd", g, m, tokens, tokens, V, scale * keep, padding_idx, zero_pad, *sink)
        if ctx.needs_input_grad[2]:
            gp = call("embedding_bwd", g, m, positions, tokens, P, keep, padding_idx, zero_pad).to(pos_dtype)
        return None, gw, gp, None, None, None, None, None


def _fused(mod, tokens, weight, pos_weight, positions, scale, p, training, padding_idx, zero_pad, return_mask):
    p_eff = float(p) if training else 0.0  # kernel slot
    if pos_weight is None:
        positions = None
    out, bits = _EmbeddingFn.apply(tokens, weight, pos_weight, positions, scale, p_eff, padding_idx, zero_pad)
    if not return_mask:
        return out
    return out, (unpack_mask(bits, out.shape) if p_eff > 0 else None)
