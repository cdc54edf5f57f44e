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
    "bias_act_linear": "ag_bias_act_linear",
    "embedding": "embedding_fwd",
    "qkv_split": "qkv_split_fwd",
    "merge_heads": "merge_heads_fwd",
    "attention": "ag_short_attention",  # the kernel for sequences up to 128 tokens; SDPA for longer ones
    "label_smoothed_cross_entropy": "ls_cross_entropy_fwd",
    "adam": "adam_step",
    "grad_norm": "grad_norm",
}


# floating dtypes the kernels store (fp32 math inside); others (e.g. float64) take the reference
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernel_module(op: str, *tensors: Optional[torch.Tensor]):
    """The extension module if ``op`` should run its kernel for these tensors, else None.

    Unsupported floating dtypes and tensors spread over several devices take the reference, so
    that argument errors are raised by Python checks rather than inside the extension. A training
    step calls this hundreds of times: it reads only cheap tensor attributes (is_cuda, the device
    index, the dtype) and remembers per op whether the extension exports the entry point.
    """
    device = -1
    for t in tensors:
        if t is None:
            continue
        if not t.is_cuda:
            return None
        index = t.get_device()
        if device != index and device != -1:
            return None
        device = index
        dt = t.dtype
        if dt.is_floating_point and dt not in KERNEL_DTYPES:
            return None
    mod = _ext.get()
    if mod is None:
        return None
    has = _HAS_ENTRY.get(op)
    if has is None:
        entry = KERNEL_ENTRY.get(op)
        has = _HAS_ENTRY[op] = entry is not None and hasattr(mod, entry)
    return mod if has else None


_HAS_ENTRY = {}  # op -> whether the loaded extension exports its entry point (cleared with the extension)


def cpp_nodes(mod, linear: bool = False):
    """``mod`` when an op should record its C++ autograd node (ls_fairseq._C.ag_*), else None.

    The C++ nodes do the work of the Python autograd.Functions without entering Python after the
    call; they are used in eager mode whenever the extension has them. ``torch.compile`` traces
    the Python Functions (through the custom ops). ``linear=True`` asks for the linear node."""
    if mod is None or not (_CPP_LINEAR if linear else _CPP_AUTOGRAD) or torch.compiler.is_compiling():
        return None
    return mod if _has_nodes(mod) else None


def _has_nodes(mod) -> bool:
    """Whether the loaded extension ``mod`` was built with the C++ nodes (remembered with the entries)."""
    has = _HAS_ENTRY.get("cpp_nodes")
    if has is None:
        has = _HAS_ENTRY["cpp_nodes"] = hasattr(mod, "ag_linear")
    return has


def cpp_layers(x):
    """The extension when a whole encoder / decoder layer should run as one C++ call on input ``x``
    (``encoder_layer_fwd`` / ``decoder_layer_fwd``, csrc/torch/layers.cpp), else None.

    That call records the same C++ nodes as the layer's Python forward, so it needs what they need:
    ``x`` on CUDA in a kernel dtype, the C++ nodes including the linear node, eager mode without
    autocast."""
    if not _CPP_LAYERS or not x.is_cuda or x.dtype not in KERNEL_DTYPES:
        return None
    mod = cpp_nodes(_ext.get(), linear=True)
    if mod is None or _autocast_on():
        return None
    has = _HAS_ENTRY.get("cpp_layers")
    if has is None:
        has = _HAS_ENTRY["cpp_layers"] = hasattr(mod, "encoder_layer_fwd") and hasattr(mod, "decoder_layer_fwd")
    return mod if has else None


def _autocast_on() -> bool:
    try:
        return torch.is_autocast_enabled("cuda")
    except TypeError:  # older torch: no device argument (it then answers for CUDA)
        return torch.is_autocast_enabled()


def explain_autograd() -> str:
    """One line: which autograd nodes the fused ops and the projections record in eager mode on CUDA."""
    mod = _ext.get()
    if mod is None:
        return "PyTorch reference ops (extension unavailable)"
    if not _has_nodes(mod):
        return "Python autograd.Functions and F.linear (this extension build has no C++ nodes)"
    if _CPP_AUTOGRAD and _CPP_LINEAR:
        if not hasattr(mod, "encoder_layer_fwd"):
            layers = "layers in Python (this extension build has no C++ layers)"
        elif _CPP_LAYERS:
            layers = "each encoder / decoder layer one C++ call"
        else:
            layers = "layers in Python"
        return f"C++ nodes for the fused ops and the projections; {layers}"
    if _CPP_AUTOGRAD:
        return "C++ nodes for the fused ops, F.linear for the projections"
    return "Python autograd.Functions and F.linear"


# The C++ nodes (ops, and the linear node) and the one-call C++ layers are used whenever the extension has
# them (they take the Python off the host's path: docs/op_paths.md). These flags exist for the tests that
# compare them with the Python Functions and layers, which torch.compile, the CPU and incremental decoding use.
_CPP_AUTOGRAD = True
_CPP_LINEAR = True
_CPP_LAYERS = True


def explain(op: str) -> str:
    """One line: which path ``op`` takes on CUDA tensors, and why."""
    entry = KERNEL_ENTRY[op]
    mod = _ext.get()
    if op == "attention":  # the kernel for short sequences, SDPA for the rest (and without the extension)
        sdpa = "torch scaled_dot_product_attention (flash / memory-efficient backends on CUDA; no per-shape plans)"
        if mod is None or not hasattr(mod, entry):
            return sdpa
        return f"fused kernel ({_ext.source()} ls_fairseq._C.{entry}) for fp16/bf16 sequences up to 128 tokens; " \
               f"otherwise {sdpa}"
    if mod is None:
        return f"reference (extension unavailable: {_ext.reason()})"
    if not hasattr(mod, entry):
        return f"reference (extension has no '{entry}')"
    return f"fused kernel on CUDA tensors ({_ext.source()} ls_fairseq._C.{entry}); reference on CPU"
