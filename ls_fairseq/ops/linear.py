"""linear(x, weight, bias=None) = x W^T (+ b), the projections of every attention and FFN block.

The same product as ``torch.nn.functional.linear``. On CUDA tensors of one dtype (eager mode, no
autocast) it records ONE C++ autograd node (``ls_fairseq._C.ag_linear``): one GEMM over the flattened
rows forward, two GEMMs backward (the weight gradient already in W's layout). ``F.linear`` on a 3-d
input records the transpose, the reshape and the product as separate nodes, each with host work in
the forward and in the backward. Everything else (CPU, mixed dtypes, autocast, torch.compile) is
``F.linear`` itself. ``fp8`` (ls_fairseq/ops/fp8.py: Fp8Use, the layer's slot in its model's FP8 state, or
None) runs the product as FP8 GEMMs where the weight's sizes allow it (multiples of 16).

linear_split(x, weight, bias, n, num_heads, fp8): the attention's input projections, x W^T + b split into n parts of
heads: on CUDA views of one GEMM's output, the bias added in its epilogue.
linear_dropout_residual(x, weight, bias, residual, p, training, fp8): an attention block's output projection and its
end, residual + dropout(x W^T + b).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from ls_fairseq import _ext
from ls_fairseq.ops._dispatch import _autocast_on, cpp_nodes
from ls_fairseq.ops.attention import split_heads
from ls_fairseq.ops.bias_dropout_residual import bias_dropout_residual
from ls_fairseq.ops.fp8 import Fp8Use, fp8_linear, fp8_residual_node, fp8_split_node, shapes_ok


def linear(x, weight, bias=None, fp8: Optional[Fp8Use] = None):
    if fp8 is not None and shapes_ok(weight):
        return fp8_linear(x, weight, bias, fp8)
    nodes = _linear_nodes(x, weight, bias)
    if nodes is not None:
        return nodes.ag_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _linear_nodes(x, weight, bias):
    """The extension when the C++ linear nodes apply (ag_linear, ag_linear_split), else None: CUDA tensors of one
    dtype, an input of at least two dimensions, eager mode without autocast."""
    if not (x.is_cuda and weight.is_cuda and x.dim() >= 2 and x.dtype == weight.dtype
            and (bias is None or (bias.dtype == x.dtype and bias.is_cuda))):
        return None
    nodes = cpp_nodes(_ext.get(), linear=True)
    return nodes if nodes is not None and not _autocast_on() else None


def linear_split(x, weight, bias, n: int, num_heads: int, fp8: Optional[Fp8Use] = None):
    """x W^T + b split into n parts of heads [B, H, T, D] (the bias gradient summed as the heads' gradients are merged):
    an attention's q, k, v, a cross-attention's query, or the layer-batched keys and values. Where the FP8 node
    applies (ls_fairseq/ops/fp8.py fp8_split_node) the projection and the split are that one node, whose output
    gradient is quantised straight from the heads' gradients; where the linear node applies, one node whose parts are
    views of the GEMM's output; otherwise linear(fp8=fp8), then split_heads."""
    node = fp8_split_node(x, weight, fp8)
    if node is not None:
        return list(node.ag_fp8_linear_split(x, weight, bias, n, num_heads, fp8.mode, fp8.state, fp8.slot))
    # where the linear node applies, a [B, T, K] input: one node whose parts are views of the GEMM's output (the bias
    # in its epilogue), as the C++ layers take it (csrc/torch/layers.cpp)
    nodes = _linear_nodes(x, weight, bias) if x.dim() == 3 and (fp8 is None or not shapes_ok(weight)) else None
    if nodes is not None and hasattr(nodes, "ag_linear_split"):
        return list(nodes.ag_linear_split(x, weight, bias, n, num_heads))
    return list(split_heads(linear(x, weight, fp8=fp8), bias, n, num_heads))


def linear_dropout_residual(x, weight, bias, residual, p: float = 0.0, training: bool = True,
                            fp8: Optional[Fp8Use] = None):
    """residual + dropout(x W^T + b): an attention block's output projection and the block's end. Where the FP8 node
    applies (ls_fairseq/ops/fp8.py fp8_residual_node) they are that one node, whose projection's output gradient
    leaves the dropout's backward as codes; otherwise linear(fp8=fp8), then bias_dropout_residual."""
    node = fp8_residual_node(x, weight, fp8)
    if node is not None:
        return node.ag_fp8_linear_residual(x, weight, bias, residual, float(p) if training else 0.0, fp8.mode,
                                           fp8.state, fp8.slot)[0]
    return bias_dropout_residual(linear(x, weight, fp8=fp8), bias, residual, p, training)
