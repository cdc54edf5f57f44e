"""copy_div_: ``dst[i] = src[i] / divisor`` for lists of tensors.

What the overlapped gradient reduction does to a complete bucket: copy each parameter's gradient
into the flat buffer and divide by the world size. The reference copies, then divides each tensor
in place. The CUDA kernel does both in one pass, for any number of pairs in a few launches, with
the values of the reference on CUDA: PyTorch divides a CUDA tensor by a host number by multiplying
with its fp32 reciprocal, and so does the kernel. A source may be its own destination (an in-place
division).
"""

from typing import Sequence

import torch

from ls_fairseq.ops._dispatch import kernel_module
from ls_fairseq.ops._kernels import call


def _check(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], divisor) -> None:
    if len(dst) != len(src):
        raise ValueError(f"copy_div_: {len(dst)} destinations for {len(src)} sources")
    if divisor == 0:
        raise ValueError("copy_div_: the divisor must not be zero")
    for i, (a, b) in enumerate(zip(dst, src)):
        if a.shape != b.shape:
            raise ValueError(f"copy_div_: pair {i} has a destination of shape {tuple(a.shape)} and a source of "
                             f"shape {tuple(b.shape)}")


@torch.no_grad()
def copy_div_reference_(dst, src, divisor) -> None:
    copies = [(a, b) for a, b in zip(dst, src) if a is not b]
    if copies:
        torch._foreach_copy_([a for a, _ in copies], [b for _, b in copies])  # casts like Tensor.copy_
    for a in dst:
        a.div_(divisor)


@torch.no_grad()
def copy_div_(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], divisor) -> None:
    """``dst[i] = src[i] / divisor`` (pairs of one shape; ``src[i]`` may be ``dst[i]``; a source of another
    dtype is cast as ``Tensor.copy_`` does, on the reference path)."""
    dst, src = list(dst), list(src)
    _check(dst, src, divisor)
    if not dst:
        return
    mod = kernel_module("copy_div", *dst, *src)
    one_dtype = all(t.dtype == dst[0].dtype for t in dst + src)  # the kernel does not cast
    if mod is not None and one_dtype and all(t.is_contiguous() for t in dst + src):
        call("copy_div", dst, src, float(divisor))
        return
    copy_div_reference_(dst, src, divisor)
