"""Public ops. Each picks the fused CUDA kernel when it can and the PyTorch reference otherwise."""

from ls_fairseq.ops.layer_norm import layer_norm, add_layer_norm, pre_layer_norm
from ls_fairseq.ops.bias_dropout_residual import bias_dropout_residual
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout
from ls_fairseq.ops.bias_act_linear import bias_act_linear
from ls_fairseq.ops.embedding import embedding
from ls_fairseq.ops.attention import qkv_split, kv_split, split_heads, merge_heads, attention
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy
from ls_fairseq.ops.adam import adam_, grad_norm
from ls_fairseq.ops.linear import linear, linear_dropout_residual, linear_split

__all__ = [
    "layer_norm", "add_layer_norm", "pre_layer_norm", "bias_dropout_residual", "bias_act_dropout", "bias_act_linear", "embedding",
    "qkv_split", "kv_split", "split_heads", "merge_heads", "attention", "label_smoothed_cross_entropy", "adam_", "grad_norm",
    "linear", "linear_dropout_residual", "linear_split",
]
