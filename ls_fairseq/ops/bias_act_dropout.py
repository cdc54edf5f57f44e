"""dropout(activation(x + bias)): the middle of the FFN block.

Activations: relu, gelu (exact, erf form, as fairseq's ``gelu``). Shapes: x [..., F];
bias [F] or None. ``mask``/``return_mask`` as in bias_dropout_residual.
"""

import torch
import torch.nn.functional as F

from ls_fairseq.ops._checks import check_activation, check_dropout, check_last_dim, up
from ls_fairseq.ops._dispatch import cpp_nodes, kernel_module
from ls_fairseq.ops._kernels import call, unpack_mask


def _act(y, activation):
    if activation == "relu":
        return F.relu(y)
    return F.gelu(y)


def bias_act_dropout_reference(x, bias, activation: str = "relu", p: float = 0.0, training: bool = True, mask=None):
    y = up(x)
    if bias is not None:
        y = y + up(bias)
    y = _act(y, activation)
    if training and p > 0.0:
        if mask is None:
            mask = torch.rand_like(y) >= p
        y = y * mask.to(y.dtype) / (1.0 - p)
    return y.to(x.dtype)


def bias_act_dropout(x, bias, activation: str = "relu", p: float = 0.0, training: bool = True, return_mask: bool = False):
    check_activation(activation)
    check_dropout(p, "activation dropout")
    if bias is not None:
        check_last_dim(bias, x.shape[-1], "bias_act_dropout bias")
    mod = kernel_module("bias_act_dropout", x, bias)
    if mod is not None:
        return _fused(mod, x, bias, activation, p, training, return_mask)
    mask = None
    if return_mask and training and p > 0.0:
        mask = torch.rand(x.shape, device=x.device) >= p
    out = bias_act_dropout_reference(x, bias, activation, p, training, mask)
    return (out, mask) if return_mask else out


class _BiasActDropoutFn(torch.autograd.Function):
    """relu saves only its output (act' * keep == out > 0); gelu saves x (+ bias) and the bitmask."""

    @staticmethod
    def forward(ctx, x, bias, activation, p):
        x = x.contiguous()
        out, mask = call("bias_act_dropout_fwd", x, bias, activation, float(p))
        ctx.activation, ctx.p = activation, p
        ctx.bias_dtype = bias.dtype if bias is not None else None
        if activation == "relu":
            ctx.save_for_backward(out)
        else:
            ctx.save_for_backward(x, bias, mask)
        ctx.mark_non_differentiable(mask)
        return out, mask

    @staticmethod
    def backward(ctx, g, _gmask=None):
        need_db = ctx.needs_input_grad[1]
        if ctx.activation == "relu":
            (out,) = ctx.saved_tensors
            x = bias = mask = None
        else:
            x, bias, mask = ctx.saved_tensors
            out = None
            mask = mask if ctx.p > 0 else None
        dx, db = call("bias_act_dropout_bwd", g.contiguous(), x, bias, out, mask, float(ctx.p), ctx.activation,
                      bool(need_db))
        return dx, (db.to(ctx.bias_dtype) if need_db else None), None, None


def _fused(mod, x, bias, activation, p, training, return_mask):  # kernel slot
    p_eff = float(p) if training else 0.0
    nodes = cpp_nodes(mod)
    if nodes is not None:
        out, bits = nodes.ag_bias_act_dropout(x, bias, activation, p_eff)
    else:
        out, bits = _BiasActDropoutFn.apply(x, bias, activation, p_eff)
    if not return_mask:
        return out
    return out, (unpack_mask(bits, x.shape) if p_eff > 0 else None)
