"""dropout(act(x + bias)) W^T without keeping the activation's output: --ls-recompute-activation.

The middle of the FFN block. The stored path (bias_act_dropout, then linear) keeps, for a gelu FFN, both
the activation's input (for gelu') and its output a (for the weight gradient of the second projection):
two [tokens, ffn] tensors. This op keeps the input and the 1-bit dropout mask and computes a again in the
backward, with the forward's arithmetic and keep bits, so every gradient equals the stored path's. For
relu the stored path keeps a alone already (relu' is a > 0), so the layers use this op for gelu only.

Shapes: x [..., F]; bias [F] or None; weight [N, F] -> [..., N]. ``fp8`` as in ops.linear. On CUDA it is
one C++ autograd node (csrc/torch/autograd.cpp); elsewhere the reference below, which recomputes through
the references (FP8 on CPU takes the stored path).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from ls_fairseq.ops._checks import check_activation, check_dropout, check_last_dim
from ls_fairseq.ops._dispatch import cpp_nodes, kernel_module
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout, bias_act_dropout_reference
from ls_fairseq.ops.fp8 import Fp8Use, cpp_fp8_args
from ls_fairseq.ops.linear import linear


class _RecomputeReference(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, weight, activation, p, mask):
        if p > 0.0 and mask is None:
            mask = torch.rand(x.shape, device=x.device) >= p
        a = bias_act_dropout_reference(x, bias, activation, p, True, mask)
        ctx.save_for_backward(x, bias, weight, mask)
        ctx.meta = (activation, p)
        return F.linear(a, weight)

    @staticmethod
    def backward(ctx, dy):
        x, bias, weight, mask = ctx.saved_tensors
        activation, p = ctx.meta
        need = ctx.needs_input_grad[:3]
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(n) if t is not None else None for t, n in zip((x, bias, weight), need)]
            a = bias_act_dropout_reference(leaves[0], leaves[1], activation, p, True, mask)
            y = F.linear(a, leaves[2])
            wanted = [t for t, n in zip(leaves, need) if n and t is not None]
            grads = iter(torch.autograd.grad(y, wanted, dy)) if wanted else iter(())
        return (*[next(grads) if n and t is not None else None for t, n in zip(leaves, need)], None, None, None)


def bias_act_linear_reference(x, bias, weight, activation: str = "gelu", p: float = 0.0, training: bool = True,
                              mask=None):
    """The reference, recomputing in the backward; ``mask`` (bool, True = keep) replays a dropout pattern."""
    return _RecomputeReference.apply(x, bias, weight, activation, float(p) if training else 0.0, mask)


def bias_act_linear(x, bias, weight, activation: str = "gelu", p: float = 0.0, training: bool = True,
                    fp8: Optional[Fp8Use] = None):
    check_activation(activation)
    check_dropout(p, "activation dropout")
    if bias is not None:
        check_last_dim(bias, x.shape[-1], "bias_act_linear bias")
    check_last_dim(weight, x.shape[-1], "bias_act_linear weight")
    p_eff = float(p) if training else 0.0
    mod = kernel_module("bias_act_linear", x, bias, weight)
    if mod is not None and x.dim() >= 2 and x.dtype == weight.dtype:
        nodes = cpp_nodes(mod)
        if nodes is not None:
            return nodes.ag_bias_act_linear(x, bias, weight, activation, p_eff, *cpp_fp8_args(fp8))[0]
    if fp8 is not None or mod is not None:  # the Python kernel Functions and FP8 off CUDA: the stored path
        return linear(bias_act_dropout(x, bias, activation, p, training), weight, fp8=fp8)
    return bias_act_linear_reference(x, bias, weight, activation, p_eff, True)
