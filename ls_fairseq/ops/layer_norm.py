"""Layer norm, optionally fused with the residual add that precedes it.

Shapes: x, residual [..., C]; weight, bias [C]. Statistics are computed in fp32 and the
output is stored in x's dtype.

``invertible=True`` (--ls-invertible-layernorm) keeps the output y for the backward instead of the
input, and recovers the normalised input as (y - bias) / weight. A layer norm's output is the input of
the next linear layer, which keeps it anyway, so the input's memory is freed. The gradients are those of
the stored path up to the rounding of y to its dtype divided by the weight: within the kernels' tolerance
of the stored path while |weight| stays above about 0.5, growing as it shrinks; where the weight is 0 the
input cannot be recovered and the gradients of x and of the weight are NaN (never a finite wrong value),
which the optimizer treats as an overflow. The C++ node (eager mode) and the reference honour it;
torch.compile traces the stored path.
"""

import torch
import torch.nn.functional as F

from ls_fairseq.ops._checks import check_last_dim, up
from ls_fairseq.ops._dispatch import cpp_nodes, kernel_module
from ls_fairseq.ops._kernels import call


def layer_norm_reference(x, weight, bias, eps: float = 1e-5):
    y = F.layer_norm(up(x), (x.shape[-1],), up(weight), up(bias), eps)
    return y.to(x.dtype)


def add_layer_norm_reference(x, residual, weight, bias, eps: float = 1e-5):
    """Returns (layer_norm(x + residual), x + residual)."""
    s = (up(x) + up(residual)).to(x.dtype)
    return layer_norm_reference(s, weight, bias, eps), s


class _InvertibleLayerNormReference(torch.autograd.Function):
    """The reference of the invertible layer norm: y as layer_norm_reference, backward from y."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, _mean, rstd = torch.native_layer_norm(up(x), (x.shape[-1],), up(weight), up(bias), eps)
        y = y.to(x.dtype)
        ctx.save_for_backward(y, weight, bias, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        y, weight, bias, rstd = ctx.saved_tensors
        C = y.shape[-1]
        xh = (up(y) - up(bias)) / up(weight)
        g = up(dy)
        gw = g * up(weight)
        dx = rstd * (gw - gw.mean(-1, keepdim=True) - xh * (gw * xh).mean(-1, keepdim=True))
        dg = (g * xh).reshape(-1, C).sum(0)
        db = g.reshape(-1, C).sum(0)
        return dx.to(y.dtype), dg.to(weight.dtype), db.to(bias.dtype), None


def _reference(x, weight, bias, eps, invertible):
    if invertible and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad):
        return _InvertibleLayerNormReference.apply(x, weight, bias, eps)
    return layer_norm_reference(x, weight, bias, eps)


def _check(x, weight, bias):
    check_last_dim(weight, x.shape[-1], "layer_norm weight")
    check_last_dim(bias, x.shape[-1], "layer_norm bias")


def layer_norm(x, weight, bias, eps: float = 1e-5, invertible: bool = False):
    _check(x, weight, bias)
    mod = kernel_module("layer_norm", x, weight, bias)
    if mod is not None:
        return _fused_layer_norm(mod, x, None, weight, bias, eps, invertible)[0]
    return _reference(x, weight, bias, eps, invertible)


def add_layer_norm(x, residual, weight, bias, eps: float = 1e-5):
    """(layer_norm(x + residual), x + residual) in one pass."""
    _check(x, weight, bias)
    if residual.shape != x.shape:
        raise ValueError(f"add_layer_norm: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    mod = kernel_module("add_layer_norm", x, residual, weight, bias)
    if mod is not None:
        return _fused_layer_norm(mod, x, residual, weight, bias, eps)
    return add_layer_norm_reference(x, residual, weight, bias, eps)


def pre_layer_norm(x, weight, bias, eps: float = 1e-5, invertible: bool = False):
    """(layer_norm(x), x) for a pre-LN block, whose input is also its residual.

    Use the second output as the residual: both gradients then reach ONE backward call and the
    kernel adds the residual's gradient into dx in the same pass (otherwise autograd sums the
    two branches of x with an extra kernel per block)."""
    _check(x, weight, bias)
    mod = kernel_module("layer_norm", x, weight, bias)
    if mod is not None and 0 < x.shape[-1] <= KERNEL_MAX_C:
        nodes = cpp_nodes(mod)
        if nodes is not None:
            y, xs = nodes.ag_pre_layer_norm(x, weight, bias, float(eps), bool(invertible))
            return y, xs
        return _PreLayerNormFn.apply(x, weight, bias, eps)
    return _reference(x, weight, bias, eps, invertible), x


class _PreLayerNormFn(torch.autograd.Function):
    """layer norm returning its input too; backward: dx = layer_norm_bwd(dy) + d(input passed on)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        xc = x.contiguous()
        y, _s, mean, rstd = call("layer_norm_fwd", xc, None, weight, bias, float(eps))
        ctx.save_for_backward(xc, weight, mean, rstd)
        ctx.param_dtypes = (weight.dtype, bias.dtype)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, gy, gx):
        xin, weight, mean, rstd = ctx.saved_tensors
        if gy is None:
            return gx, None, None, None
        dsum = gx.contiguous() if gx is not None else None
        dx, dg, db = call("layer_norm_bwd", gy.contiguous(), dsum, xin, weight, mean, rstd)
        return dx, dg.to(ctx.param_dtypes[0]), db.to(ctx.param_dtypes[1]), None


class _LayerNormFn(torch.autograd.Function):
    """Fused (add +) layer norm. Saves the normalised input (x, or x + residual), mean and rstd."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, eps):
        x = x.contiguous()
        res = residual.contiguous() if residual is not None else None
        y, s, mean, rstd = call("layer_norm_fwd", x, res, weight, bias, float(eps))
        xin = s if res is not None else x
        ctx.save_for_backward(xin, weight, mean, rstd)
        ctx.has_residual = res is not None
        ctx.param_dtypes = (weight.dtype, bias.dtype)
        return (y, s) if res is not None else y

    @staticmethod
    def backward(ctx, gy, gs=None):
        xin, weight, mean, rstd = ctx.saved_tensors
        dsum = gs.contiguous() if (ctx.has_residual and gs is not None) else None
        dx, dg, db = call("layer_norm_bwd", gy.contiguous(), dsum, xin, weight, mean, rstd)
        dg, db = dg.to(ctx.param_dtypes[0]), db.to(ctx.param_dtypes[1])
        return dx, (dx if ctx.has_residual else None), dg, db, None


KERNEL_MAX_C = 8192  # the kernels keep a row in registers


def _fused_layer_norm(mod, x, residual, weight, bias, eps, invertible=False):  # kernel slot
    if x.shape[-1] > KERNEL_MAX_C or x.shape[-1] == 0:  # wider rows: the reference (no size limit)
        if residual is None:
            return (_reference(x, weight, bias, eps, invertible),)
        return add_layer_norm_reference(x, residual, weight, bias, eps)
    nodes = cpp_nodes(mod)
    if nodes is not None:
        return tuple(nodes.ag_layer_norm(x, residual, weight, bias, float(eps), bool(invertible)))
    out = _LayerNormFn.apply(x, residual, weight, bias, eps)
    return out if residual is not None else (out,)
