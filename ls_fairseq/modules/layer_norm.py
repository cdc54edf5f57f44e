"""LayerNorm module over the fused op (parameter names weight / bias, as nn.LayerNorm)."""

import torch
import torch.nn as nn

from ls_fairseq import ops


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.invertible = False  # --ls-invertible-layernorm: keep the output for the backward, not the input

    def forward(self, x):
        return ops.layer_norm(x, self.weight, self.bias, self.eps, invertible=self.invertible)

    def with_input(self, x):
        """(layer_norm(x), x): use the second as the residual of a pre-LN block (one fused backward)."""
        return ops.pre_layer_norm(x, self.weight, self.bias, self.eps, invertible=self.invertible)

    def extra_repr(self):
        return f"{self.dim}, eps={self.eps}"
