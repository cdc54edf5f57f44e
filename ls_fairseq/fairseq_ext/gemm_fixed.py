"""Fixed GEMM algorithms: each class of the layers' products runs one cuBLASLt algorithm, whatever its token count.

A class is a product's sizes other than its token count, its layouts, dtype, bias, accumulation and device. ATen
lets cuBLAS choose a kernel for each exact product, so a batch with a token count not seen before may load a kernel
not used before in the process, and loading one waits until the GPU has finished everything queued: a capture of
the CUDA-graph step then drains the queue of pending updates instead of hiding behind it. With fixed algorithms
(:func:`enable`, at ``--max-tokens``), each class loads its one kernel in its first product (the eager first
update), and later batches of any token count load none. The products that do not fit (fp32, strided or unaligned
operands, sizes not multiples of 8, CPU) run through ATen, as they do with fixed algorithms off
(``csrc/torch/gemm.cpp``).

The layers' products (``csrc/torch/autograd.cpp``, ``weight_grads.cpp``) call the extension directly; the graph
step's head calls :func:`mm` and :func:`mm_into`.
"""

import torch

from ls_fairseq import _ext


def _c():
    C = _ext.get()
    return C if C is not None and hasattr(C, "gemm_mm") else None


def available() -> bool:
    """Whether this build and process can run fixed algorithms (the extension built with cuBLASLt's header, and
    the cuBLASLt torch loaded found)."""
    C = _c()
    return C is not None and bool(C.gemm_fixed_available())


def enable(ref_tokens: int, pick: int = 0, any_reduction: bool = False) -> bool:
    """Fixed algorithms on, chosen at ``ref_tokens`` rows (``--max-tokens``); a fresh table. False where not
    :func:`available` (every product then runs through ATen)."""
    C = _c()
    if C is None or not C.gemm_fixed_available():
        return False
    C.gemm_fixed_enable(int(ref_tokens), int(pick), bool(any_reduction))
    return bool(C.gemm_fixed_on())


def disable() -> None:
    C = _c()
    if C is not None:
        C.gemm_fixed_disable()


def is_on() -> bool:
    C = _c()
    return C is not None and bool(C.gemm_fixed_on())


def report() -> dict:
    """What the table holds: classes seen and with an algorithm, exact shapes through cuBLASLt and through ATen
    (the class's algorithm not accepted for them), products refused at run time."""
    C = _c()
    if C is None:
        return {"on": False}
    on, ref, classes, lt_classes, lt_shapes, aten_shapes, refusals = C.gemm_fixed_report()
    return {"on": bool(on), "ref_tokens": ref, "classes": classes, "classes_lt": lt_classes,
            "shapes_lt": lt_shapes, "shapes_aten": aten_shapes, "refusals": refusals}


def describe() -> str:
    r = report()
    if not r["on"]:
        return "off"
    return (f"{r['classes_lt']} of {r['classes']} classes with one cuBLASLt algorithm (chosen at "
            f"{r['ref_tokens']} tokens), {r['shapes_lt']} shapes through it, {r['shapes_aten']} through ATen, "
            f"{r['refusals']} refused")


def mm(a: torch.Tensor, b: torch.Tensor, token: int = 0) -> torch.Tensor:
    """``a @ b``; through the class's fixed algorithm when on and the operands fit (token: 0 when a's rows count
    tokens, 1 when the summed size does)."""
    if a.is_cuda and is_on():
        return _c().gemm_mm(a, b, None, token)
    return torch.mm(a, b)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: bool, token: int = 0) -> None:
    """``out += a @ b`` (add) or ``out = a @ b``, as :func:`mm`."""
    if a.is_cuda and is_on():
        _c().gemm_mm_into(out, a, b, add, token)
    elif add:
        out.addmm_(a, b)
    else:
        torch.mm(a, b, out=out)
