"""The layers' products through cuBLASLt, with the kernels of the planned shapes loaded before the first update.

The first product that uses a cuBLAS kernel not used before in the process waits until the GPU has finished
everything queued, then loads the kernel. Which kernel ATen's product uses is unknown until it runs, and cuBLAS
picks among many by exact size, so the CUDA-graph step's captures of new buckets often drain the queue of
pending updates instead of hiding behind it. With cuBLASLt on (:func:`enable`), each exact product runs
cuBLASLt's first heuristic proposal for its shape, so the kernels a set of shapes needs are known before they
run: :func:`preload` takes the planned buckets' token counts and, for every class of product seen so far (the
sizes other than the token count, layouts, dtype, bias, accumulation), runs one product per distinct kernel on
scratch operands. The warm-up before the first update (``prewarm.py``) calls it after the one-layer copy's first
batch has shown the classes, while the optimizer is built and the GPU is idle anyway.

Products that do not fit (fp32, strided or unaligned operands, sizes not multiples of 8, CPU) run through ATen, as
they do with cuBLASLt off (``csrc/torch/gemm.cpp``). The graph step's head stays on ATen's products.
"""

from ls_fairseq import _ext


def _c():
    C = _ext.get()
    return C if C is not None and hasattr(C, "gemm_lt_enable") else None


def available() -> bool:
    """Whether this build and process have cuBLASLt (the extension built with its header, and the library torch
    loaded found)."""
    C = _c()
    return C is not None and bool(C.gemm_lt_available())


def enable() -> bool:
    """The layers' products through cuBLASLt. False where not :func:`available` (they stay on ATen)."""
    C = _c()
    if C is None:
        return False
    C.gemm_lt_enable()  # stays off where cuBLASLt is missing
    return bool(C.gemm_lt_on())


def disable() -> None:
    C = _c()
    if C is not None:
        C.gemm_lt_disable()


def is_on() -> bool:
    C = _c()
    return C is not None and bool(C.gemm_lt_on())


def preload(token_counts, skip_size: int = 0) -> dict:
    """Plans and loads the kernels of every class seen so far at these token counts (the current device and
    stream; not under a capture), except the classes with a size equal to ``skip_size`` (the vocabulary: the
    graph step's head runs ATen's products). Returns the shapes planned, the products run and the classes."""
    C = _c()
    counts = sorted({int(t) for t in token_counts if int(t) > 0})
    if C is None or not C.gemm_lt_on() or not counts:
        return {"shapes": 0, "runs": 0, "classes": 0}
    shapes, runs, classes = C.gemm_preload(counts, int(skip_size))
    return {"shapes": shapes, "runs": runs, "classes": classes}


def report() -> dict:
    C = _c()
    if C is None:
        return {"on": False}
    on, classes, lt, aten, kernels, refusals, pre_runs, pre_ms = C.gemm_lt_report()
    return {"on": bool(on), "classes": classes, "shapes_lt": lt, "shapes_aten": aten, "kernels": kernels,
            "refusals": refusals, "preload_runs": pre_runs, "preload_ms": pre_ms}


def describe() -> str:
    r = report()
    if not r["on"]:
        return "off"
    return (f"{r['classes']} classes, {r['shapes_lt']} shapes through cuBLASLt ({r['shapes_aten']} through ATen), "
            f"{r['kernels']} kernels, {r['refusals']} refused; preloaded {r['preload_runs']} in "
            f"{r['preload_ms'] / 1000:.2f} s")


def bucket_token_counts(buckets) -> list:
    """The row counts the body's products take in these buckets (the encoder's and the decoder's)."""
    counts = set()
    for b in buckets:
        if hasattr(b, "src_rows"):
            counts.update((int(b.src_rows), int(b.tgt_rows)))
        else:
            counts.update((int(b.sentences) * int(b.src_len), int(b.sentences) * int(b.tgt_len)))
    return sorted(counts)
