"""linear(x, weight, bias=None) = x W^T (+ b), the projections of every attention and FFN block.

The same product as ``torch.nn.functional.linear``. On CUDA tensors of one dtype (eager mode, no
autocast) it records ONE C++ autograd node (``ls_fairseq._C.ag_linear``): one GEMM over the flattened
rows forward, two GEMMs backward (the weight gradient already in W's layout). ``F.linear`` on a 3-d
input records the transpose, the reshape and the product as separate nodes, each with host work in
the forward and in the backward; a transformer-big micro-batch makes 62 of these calls. Everything
else (CPU, mixed dtypes, autocast, torch.compile) is ``F.linear`` itself.

``fp8`` (ls_fairseq/ops/fp8.py: Fp8Use, the layer's slot in its model's FP8 state, or None) runs the product as
FP8 GEMMs where the weight's sizes allow it (multiples of 16).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from ls_fairseq import _ext
from ls_fairseq.ops._dispatch import _autocast_on, cpp_nodes
from ls_fairseq.ops.fp8 import Fp8Use, fp8_linear, shapes_ok


def linear(x, weight, bias=None, fp8: Optional[Fp8Use] = None):
    if fp8 is not None and shapes_ok(weight):
        return fp8_linear(x, weight, bias, fp8)
    if (x.is_cuda and weight.is_cuda and x.dim() >= 2 and x.dtype == weight.dtype
            and (bias is None or (bias.dtype == x.dtype and bias.is_cuda))):
        nodes = cpp_nodes(_ext.get(), linear=True)
        if nodes is not None and not _autocast_on():
            return nodes.ag_linear(x, weight, bias)
    return F.linear(x, weight, bias)
