"""Choosing between the fused CUDA kernel and the PyTorch reference for one call.

An op runs its kernel when every tensor argument is on a CUDA device, the extension is
loaded, and the extension exports the op's entry point. Everything else (CPU tensors,
no extension, LS_FAIRSEQ_DISABLE_KERNELS=1) runs the reference. :func:`explain` tells why.
"""

from typing import Optional

import torch

from ls_fairseq import _ext

# public op name -> name of the entry point the extension must export
KERNEL_ENTRY = {
    "layer_norm": "layer_norm_fwd",
    "add_layer_norm": "layer_norm_fwd",
    "bias_dropout_residual": "bias_dropout_residual_fwd",
    "bias_act_dropout": "bias_act_dropout_fwd",
    "embedding": "embedding_fwd",
    "qkv_split": "qkv_split_fwd",
    "merge_heads": "merge_heads_fwd",
    "attention": None,  # always torch SDPA (flash / cuDNN / efficient backends)
    "label_smoothed_cross_entropy": "ls_cross_entropy_fwd",
    "adam": "adam_step",
    "copy_div": "copy_div",
    "grad_norm": "grad_norm",
}


# floating dtypes the kernels store (fp32 math inside); others (e.g. float64) take the reference
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernel_module(op: str, *tensors: Optional[torch.Tensor]):
    """The extension module if ``op`` should run its kernel for these tensors, else None.

    Unsupported floating dtypes and tensors spread over several devices take the reference, so
    that argument errors are raised by Python checks rather than inside the extension.
    """
    entry = KERNEL_ENTRY.get(op)
    if entry is None:
        return None
    device = None
    for t in tensors:
        if t is None:
            continue
        if t.device.type != "cuda" or (device is not None and t.device != device):
            return None
        device = t.device
        if t.is_floating_point() and t.dtype not in KERNEL_DTYPES:
            return None
    mod = _ext.get()
    if mod is None or not hasattr(mod, entry):
        return None
    return mod


def explain(op: str) -> str:
    """One line: which path ``op`` takes on CUDA tensors, and why."""
    entry = KERNEL_ENTRY.get(op)
    if entry is None:
        return "torch scaled_dot_product_attention (flash / memory-efficient backends on CUDA; no per-shape plans)"
    mod = _ext.get()
    if mod is None:
        return f"reference (extension unavailable: {_ext.reason()})"
    if not hasattr(mod, entry):
        return f"reference (extension has no '{entry}')"
    return f"fused kernel on CUDA tensors ({_ext.source()} ls_fairseq._C.{entry}); reference on CPU"
