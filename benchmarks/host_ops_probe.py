"""Host microseconds per call of the operations a training step launches most (GPU machine).

A step of ls_transformer_wmt_en_de_big_t2t at 8192 tokens launches about 60 linear layers forward and
twice as many GEMMs backward, and about 90 of the ops' autograd Functions. Where the host is slow the
GPU waits for these launches, so their host cost sets the step time. Each row: the best of a few
repeats of N back-to-back calls, queued behind a GPU spin kernel so that no call waits for the GPU,
in microseconds of host time per call.

    python benchmarks/host_ops_probe.py [--tokens 8192] [--calls 100]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def host_us(fn, calls, repeats=5):
    import torch

    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU spin: the calls below only queue their work
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, time.perf_counter() - t0)
        torch.cuda.synchronize()
    return best / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--calls", type=int, default=100)
    a = ap.parse_args()
    import torch
    import torch.nn.functional as F

    from ls_fairseq import ops

    dev = "cuda"
    h = torch.float16
    b, t = 64, a.tokens // 64
    x = torch.randn(b, t, 1024, device=dev, dtype=h)
    x2 = x.view(-1, 1024)
    w = torch.randn(4096, 1024, device=dev, dtype=h) * 0.02
    wt = w.t()
    bias = torch.randn(4096, device=dev, dtype=h)
    gy = torch.randn(b * t, 4096, device=dev, dtype=h)
    ln_w = torch.ones(1024, device=dev, dtype=h)
    ln_b = torch.zeros(1024, device=dev, dtype=h)
    small = torch.zeros(1, device=dev)

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, v):
            return v.view_as(v)

        @staticmethod
        def backward(ctx, g):
            return g

    xr = x.detach().requires_grad_()
    y2 = torch.empty(b * t, 4096, device=dev, dtype=h)
    rows = [
        ("empty_like (allocator only)", lambda: torch.empty_like(x)),
        ("tiny add_ (dispatch + launch floor)", lambda: small.add_(1)),
        ("F.linear 3D, no bias (forward)", lambda: F.linear(x, w)),
        ("F.linear 3D, bias (addmm)", lambda: F.linear(x, w, bias)),
        ("torch.mm 2D", lambda: torch.mm(x2, wt)),
        ("torch.mm 2D, out=", lambda: torch.mm(x2, wt, out=y2)),
        ("ops.linear 3D, no grad (the linear node's entry)", lambda: ops.linear(x, w)),
        ("ops.linear 3D, records its autograd node", lambda: ops.linear(xr, w)),
        ("torch.mm grad input [N,4096]x[4096,1024]", lambda: torch.mm(gy, w)),
        ("torch.mm grad weight [4096,N]x[N,1024]", lambda: torch.mm(gy.t(), x2)),
        ("sum over rows (bias grad)", lambda: gy.sum(0)),
        ("autograd.Function identity, grad on", lambda: Identity.apply(xr)),
        ("ops.layer_norm (Function + kernel)", lambda: ops.layer_norm(xr, ln_w, ln_b)),
        ("ops.layer_norm, no grad", lambda: ops.layer_norm(x, ln_w, ln_b)),
    ]
    libs = ["default"]
    if hasattr(torch.backends.cuda, "preferred_blas_library"):
        libs += ["cublaslt"]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, tokens {b * t}, "
          f"DISABLE_ADDMM_CUDA_LT={os.environ.get('DISABLE_ADDMM_CUDA_LT', '')}")
    for lib in libs:
        if lib != "default":
            torch.backends.cuda.preferred_blas_library(lib)
        for name, fn in rows:
            for _ in range(3):
                fn()
            print(f"HOSTUS {lib:9s} {host_us(fn, a.calls):8.2f} us  {name}", flush=True)


if __name__ == "__main__":
    main()
