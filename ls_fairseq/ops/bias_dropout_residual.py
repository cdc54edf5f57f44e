"""residual + dropout(x + bias): the tail of every attention and FFN block.

Shapes: x, residual [..., C]; bias [C] or None. ``mask`` (bool, True = keep, x's shape)
replays a given dropout pattern in the reference; ``return_mask=True`` returns
(out, mask) so a test can replay the kernel's pattern.
"""

import torch

from ls_fairseq.ops._checks import check_dropout, check_last_dim, up
from ls_fairseq.ops._dispatch import cpp_nodes, kernel_module
from ls_fairseq.ops._kernels import call, unpack_mask


def _dropout_reference(y, p, training, mask):
    if not training or p == 0.0:
        return y, None
    if mask is None:
        mask = torch.rand_like(y, dtype=torch.float32) >= p
    return y * mask.to(y.dtype) / (1.0 - p), mask


def bias_dropout_residual_reference(x, bias, residual, p: float = 0.0, training: bool = True, mask=None):
    y = up(x)
    if bias is not None:
        y = y + up(bias)
    y, _ = _dropout_reference(y, p, training, mask)
    return (up(residual) + y).to(x.dtype)


def bias_dropout_residual(x, bias, residual, p: float = 0.0, training: bool = True, return_mask: bool = False):
    check_dropout(p)
    if bias is not None:
        check_last_dim(bias, x.shape[-1], "bias_dropout_residual bias")
    if residual.shape != x.shape:
        raise ValueError(
            f"bias_dropout_residual: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}"
        )
    mod = kernel_module("bias_dropout_residual", x, bias, residual)
    if mod is not None:
        return _fused(mod, x, bias, residual, p, training, return_mask)
    mask = None
    if return_mask and training and p > 0.0:
        mask = torch.rand(x.shape, device=x.device) >= p
    out = bias_dropout_residual_reference(x, bias, residual, p, training, mask)
    return (out, mask) if return_mask else out


class _BiasDropoutResidualFn(torch.autograd.Function):
    """Saves only the dropout bitmask (1 bit per element)."""

    @staticmethod
    def forward(ctx, x, bias, residual, p):
        out, mask = call("bias_dropout_residual_fwd", x.contiguous(), bias, residual.contiguous(), float(p))
        ctx.save_for_backward(mask)
        ctx.p = p
        ctx.bias_dtype = bias.dtype if bias is not None else None
        ctx.mark_non_differentiable(mask)
        return out, mask

    @staticmethod
    def backward(ctx, g, _gmask=None):
        (mask,) = ctx.saved_tensors
        need_db = ctx.needs_input_grad[1]
        dx, db = call("bias_act_dropout_bwd", g.contiguous(), None, None, None, mask if ctx.p > 0 else None,
                      float(ctx.p), "none", bool(need_db))
        return dx, (db.to(ctx.bias_dtype) if need_db else None), g, None


def _fused(mod, x, bias, residual, p, training, return_mask):  # kernel slot
    p_eff = float(p) if training else 0.0
    nodes = cpp_nodes(mod)
    if nodes is not None:
        out, bits = nodes.ag_bias_dropout_residual(x, bias, residual, p_eff)
    else:
        out, bits = _BiasDropoutResidualFn.apply(x, bias, residual, p_eff)
    if not return_mask:
        return out
    return out, (unpack_mask(bits, x.shape) if p_eff > 0 else None)
