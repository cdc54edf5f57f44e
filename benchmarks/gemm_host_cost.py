"""Host microseconds per call of the GEMMs a Transformer-big micro-batch issues, against a plain
elementwise launch: how much of a step's host time is the GEMM call itself.

    python benchmarks/gemm_host_cost.py [--tokens 8192] [--dim 1024]

Each case is called N times while the GPU is held busy by a long spin kernel queued first, so no
call waits for the GPU: the loop's wall time per call is the host cost (the best of a few repeats).
"""

import argparse
import time

import torch
import torch.nn.functional as F


def host_us(fn, n=200, repeats=5):
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU spin: every call below only queues
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best / n * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--dim", type=int, default=1024)
    args = ap.parse_args()
    dev, h = "cuda", torch.float16
    t, d = args.tokens, args.dim
    x = torch.randn(t, d, device=dev, dtype=h)
    g = torch.randn(t, d, device=dev, dtype=h)
    w = torch.randn(d, d, device=dev, dtype=h)
    b = torch.randn(d, device=dev, dtype=h)
    y = torch.empty(t, d, device=dev, dtype=h)
    s = torch.randn(64, 64, device=dev, dtype=h)
    cases = {
        "empty_like (allocator only)": lambda: torch.empty_like(x),
        "add (one elementwise launch)": lambda: torch.add(x, x),
        "mm x @ w.t() (forward)": lambda: torch.mm(x, w.t()),
        "mm g @ w (input gradient)": lambda: torch.mm(g, w),
        "mm g.t() @ x (weight gradient)": lambda: torch.mm(g.t(), x),
        "addmm b + x @ w.t()": lambda: torch.addmm(b, x, w.t()),
        "mm x @ w.t(), out=": lambda: torch.mm(x, w.t(), out=y),
        "F.linear(x, w)": lambda: F.linear(x, w),
        "mm 64x64": lambda: torch.mm(s, s),
    }
    try:
        from ls_fairseq.ops.linear import linear

        xr = x.clone().requires_grad_()
        cases["ls linear (no grad)"] = lambda: linear(x, w)
        cases["ls linear (records its node)"] = lambda: linear(xr, w)
    except Exception as e:  # the extension is not built
        print(f"ls linear: not measured ({e})")
    for name, fn in cases.items():
        fn()
        print(f"HOST {host_us(fn):7.2f} us  {name}", flush=True)
    if hasattr(torch.backends.cuda, "preferred_blas_library"):
        torch.backends.cuda.preferred_blas_library("cublaslt")
        for name in ("mm x @ w.t() (forward)", "mm g.t() @ x (weight gradient)", "addmm b + x @ w.t()"):
            cases[name]()
            print(f"HOST {host_us(cases[name]):7.2f} us  {name} [cublaslt]", flush=True)
        torch.backends.cuda.preferred_blas_library("cublas")


if __name__ == "__main__":
    main()
