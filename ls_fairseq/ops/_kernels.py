"""The compiled kernels as torch.library custom ops, and the switch between the two ways of calling them.

Each ``ls_fairseq._C`` entry point the ops use is registered once as ``torch.ops.ls_fairseq.<name>``
(schema from the annotations below, a fake implementation for shape propagation), so the
autograd.Functions in ops/*.py trace under torch.compile without a graph break. In eager mode
:func:`call` skips the dispatcher and calls the pybind function directly (it costs microseconds per
call, and a training step makes hundreds). Nothing here touches CUDA at import time.
"""

from typing import List, Optional

import torch
from torch import Tensor

from ls_fairseq import _ext

_LIB = "ls_fairseq"


def _mod():
    mod = _ext.get()
    if mod is None:
        raise RuntimeError(f"ls_fairseq._C is not available: {_ext.reason()}")
    return mod


def call(name: str, *args):
    """Run kernel entry ``name``: through the custom op while compiling, directly otherwise."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.ls_fairseq, name)(*args)
    return getattr(_mod(), name)(*args)


def mask_numel(n: int) -> int:
    return (n + 7) // 8


def unpack_mask(bits: Tensor, shape) -> Tensor:
    """Bitmask (bit k of byte g = element 8g + k kept) -> bool tensor of ``shape`` (True = keep)."""
    n = 1
    for s in shape:
        n *= int(s)
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    flat = (bits.view(-1, 1) >> shifts) & 1
    return flat.view(-1)[:n].bool().view(tuple(shape))


def _empty(like: Tensor, shape, dtype=None) -> Tensor:
    return like.new_empty(tuple(shape), dtype=dtype if dtype is not None else like.dtype)


def _register():
    op = torch.library.custom_op

    @op(f"{_LIB}::layer_norm_fwd", mutates_args=())
    def layer_norm_fwd(x: Tensor, residual: Optional[Tensor], weight: Tensor, bias: Tensor, eps: float) -> List[Tensor]:
        return list(_mod().layer_norm_fwd(x, residual, weight, bias, eps))

    @layer_norm_fwd.register_fake
    def _(x, residual, weight, bias, eps):
        rows = x.numel() // x.shape[-1]
        s = _empty(x, x.shape) if residual is not None else _empty(x, (0,))
        return [_empty(x, x.shape), s, _empty(x, (rows,), torch.float32), _empty(x, (rows,), torch.float32)]

    @op(f"{_LIB}::layer_norm_bwd", mutates_args=())
    def layer_norm_bwd(dy: Tensor, dsum: Optional[Tensor], xin: Tensor, weight: Tensor, mean: Tensor,
                       rstd: Tensor) -> List[Tensor]:
        return list(_mod().layer_norm_bwd(dy, dsum, xin, weight, mean, rstd))

    @layer_norm_bwd.register_fake
    def _(dy, dsum, xin, weight, mean, rstd):
        C = xin.shape[-1]
        return [_empty(xin, xin.shape), _empty(xin, (C,)), _empty(xin, (C,))]

    @op(f"{_LIB}::bias_dropout_residual_fwd", mutates_args=())
    def bias_dropout_residual_fwd(x: Tensor, bias: Optional[Tensor], residual: Tensor, p: float) -> List[Tensor]:
        return list(_mod().bias_dropout_residual_fwd(x, bias, residual, p))

    @bias_dropout_residual_fwd.register_fake
    def _(x, bias, residual, p):
        return [_empty(x, x.shape), _empty(x, (mask_numel(x.numel()) if p > 0 else 0,), torch.uint8)]

    @op(f"{_LIB}::bias_act_dropout_fwd", mutates_args=())
    def bias_act_dropout_fwd(x: Tensor, bias: Optional[Tensor], activation: str, p: float) -> List[Tensor]:
        return list(_mod().bias_act_dropout_fwd(x, bias, activation, p))

    @bias_act_dropout_fwd.register_fake
    def _(x, bias, activation, p):
        return [_empty(x, x.shape), _empty(x, (mask_numel(x.numel()) if p > 0 else 0,), torch.uint8)]

    @op(f"{_LIB}::bias_act_dropout_bwd", mutates_args=())
    def bias_act_dropout_bwd(dy: Tensor, x: Optional[Tensor], bias: Optional[Tensor], out: Optional[Tensor],
                             mask: Optional[Tensor], p: float, activation: str, need_dbias: bool) -> List[Tensor]:
        return list(_mod().bias_act_dropout_bwd(dy, x, bias, out, mask, p, activation, need_dbias))

    @bias_act_dropout_bwd.register_fake
    def _(dy, x, bias, out, mask, p, activation, need_dbias):
        return [_empty(dy, dy.shape), _empty(dy, (dy.shape[-1] if need_dbias else 0,))]

    @op(f"{_LIB}::embedding_fwd", mutates_args=())
    def embedding_fwd(tokens: Tensor, weight: Tensor, pos_weight: Optional[Tensor], positions: Optional[Tensor],
                      scale: float, p: float, padding_idx: int, zero_pad: bool) -> List[Tensor]:
        return list(_mod().embedding_fwd(tokens, weight, pos_weight, positions, scale, p, padding_idx, zero_pad))

    @embedding_fwd.register_fake
    def _(tokens, weight, pos_weight, positions, scale, p, padding_idx, zero_pad):
        C = weight.shape[-1]
        n = tokens.numel() * C
        return [_empty(weight, tuple(tokens.shape) + (C,)),
                _empty(weight, (mask_numel(n) if p > 0 else 0,), torch.uint8)]

    @op(f"{_LIB}::embedding_bwd", mutates_args=())
    def embedding_bwd(dy: Tensor, mask: Optional[Tensor], keys: Tensor, tokens: Tensor, num_embeddings: int,
                      factor: float, padding_idx: int, zero_pad: bool) -> Tensor:
        return _mod().embedding_bwd(dy, mask, keys, tokens, num_embeddings, factor, padding_idx, zero_pad)

    @embedding_bwd.register_fake
    def _(dy, mask, keys, tokens, num_embeddings, factor, padding_idx, zero_pad):
        return _empty(dy, (num_embeddings, dy.shape[-1]))

    @op(f"{_LIB}::qkv_split_fwd", mutates_args=())
    def qkv_split_fwd(x: Tensor, bias: Optional[Tensor], n: int, num_heads: int, token_major: bool = False) -> Tensor:
        return _mod().qkv_split_fwd(x, bias, n, num_heads, token_major)

    @qkv_split_fwd.register_fake
    def _(x, bias, n, num_heads, token_major=False):
        B, T, W = x.shape
        if token_major:
            return _empty(x, (n, B, T, num_heads, W // n // num_heads)).transpose(2, 3)
        return _empty(x, (n, B, num_heads, T, W // n // num_heads))

    @op(f"{_LIB}::split_heads_bwd", mutates_args=())
    def split_heads_bwd(parts: List[Optional[Tensor]], need_dbias: bool) -> List[Tensor]:
        return list(_mod().split_heads_bwd(parts, need_dbias))

    @split_heads_bwd.register_fake
    def _(parts, need_dbias):
        ref = next(t for t in parts if t is not None)
        B, H, T, D = ref.shape
        n = len(parts)
        return [_empty(ref, (B, T, n * H * D)), _empty(ref, (n * H * D if need_dbias else 0,))]

    @op(f"{_LIB}::merge_heads_fwd", mutates_args=())
    def merge_heads_fwd(x: Tensor) -> Tensor:
        return _mod().merge_heads_fwd(x)

    @merge_heads_fwd.register_fake
    def _(x):
        B, H, T, D = x.shape
        return _empty(x, (B, T, H * D))

    @op(f"{_LIB}::merge_heads_bwd", mutates_args=())
    def merge_heads_bwd(dy: Tensor, num_heads: int) -> Tensor:
        return _mod().merge_heads_bwd(dy, num_heads)

    @merge_heads_bwd.register_fake
    def _(dy, num_heads):
        B, T, W = dy.shape
        return _empty(dy, (B, num_heads, T, W // num_heads))

    @op(f"{_LIB}::ls_cross_entropy_fwd", mutates_args=())
    def ls_cross_entropy_fwd(logits: Tensor, target: Tensor, epsilon: float, ignore_index: int) -> List[Tensor]:
        return list(_mod().ls_cross_entropy_fwd(logits, target, epsilon, ignore_index))

    @ls_cross_entropy_fwd.register_fake
    def _(logits, target, epsilon, ignore_index):
        f = torch.float32
        return [_empty(logits, (), f), _empty(logits, (), f), _empty(logits, (logits.shape[0],), f)]

    @op(f"{_LIB}::ls_cross_entropy_bwd", mutates_args=())
    def ls_cross_entropy_bwd(logits: Tensor, target: Tensor, lse: Tensor, g_loss: Tensor, g_nll: Tensor,
                             epsilon: float, ignore_index: int) -> Tensor:
        return _mod().ls_cross_entropy_bwd(logits, target, lse, g_loss, g_nll, epsilon, ignore_index)

    @ls_cross_entropy_bwd.register_fake
    def _(logits, target, lse, g_loss, g_nll, epsilon, ignore_index):
        return _empty(logits, logits.shape)

    @op(f"{_LIB}::ls_cross_entropy_fwd_bwd", mutates_args=("logits",))
    def ls_cross_entropy_fwd_bwd(logits: Tensor, target: Tensor, epsilon: float, ignore_index: int,
                                 grad_scale: Optional[Tensor]) -> List[Tensor]:
        return list(_mod().ls_cross_entropy_fwd_bwd(logits, target, epsilon, ignore_index, grad_scale))

    @ls_cross_entropy_fwd_bwd.register_fake
    def _(logits, target, epsilon, ignore_index, grad_scale):
        f = torch.float32
        return [_empty(logits, (), f), _empty(logits, (), f)]

    @op(f"{_LIB}::adam_step",
        mutates_args=("param", "exp_avg", "exp_avg_sq", "param_lp", "param_lp_peer", "norm_out", "param_lo"))
    def adam_step(param: Tensor, grad: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, param_lp: Optional[Tensor],
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float, step: int,
                  grad_scale: float, torch_mode: bool, skip_if_nonfinite: Optional[Tensor],
                  grad_scale_tensor: Optional[Tensor], param_lp_peer: Optional[Tensor], ranges: List[int],
                  norm_out: Optional[Tensor], param_lo: Optional[Tensor]) -> None:
        _mod().adam_step(param, grad, exp_avg, exp_avg_sq, param_lp, lr, beta1, beta2, eps, weight_decay, step,
                         grad_scale, torch_mode, skip_if_nonfinite, grad_scale_tensor, param_lp_peer, ranges,
                         norm_out, param_lo)

    @adam_step.register_fake
    def _(*args):
        return None

    @op(f"{_LIB}::grad_norm", mutates_args=())
    def grad_norm(grad: Tensor, ranges: List[int]) -> Tensor:
        return _mod().grad_norm(grad, ranges)

    @grad_norm.register_fake
    def _(grad, ranges):
        return _empty(grad, (), torch.float32)


try:
    _register()
except Exception as e:  # noqa: BLE001 - an old torch without custom_op: eager calls still work
    import logging

    logging.getLogger(__name__).warning("torch.library registration of ls_fairseq kernels failed: %s", e)
