"""How fast this machine is right now: host Python, CUDA launches, fp16 GEMMs, GPU-to-GPU copies.

The lent 2-GPU machines differ a lot from call to call (one GPU's training speed ranged from 210k to
310k words/s with the same code), and most of that difference is on the host. Session scripts print
this line first, so a call on a degraded machine can be recognised (and its ratios discounted)
without a training run:

    python benchmarks/machine_check.py

Each number is the best of a few repeats: python = ms for a fixed pure-Python loop; launch = us per
tiny CUDA kernel launched back to back (host-bound); gemm = fp16 TFLOP/s of 8192^3 matmuls, per GPU;
copy = GB/s of a 256 MB copy from GPU 0 to GPU 1.
"""

import time


def best(fn, repeats=3):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def python_loop():
    s = 0
    for i in range(2_000_000):
        s += i * i
    return s


def main():
    import os

    parts = [f"cpus {os.cpu_count()}", f"load {os.getloadavg()[0]:.2f}",
             f"python {best(python_loop) * 1e3:.1f} ms"]
    import torch

    if not torch.cuda.is_available():
        print("machine: " + ", ".join(parts + ["no CUDA"]), flush=True)
        return
    n_gpu = torch.cuda.device_count()
    x = torch.zeros(1, device="cuda:0")

    def launches(n=5000):
        for _ in range(n):
            x.add_(1)
        torch.cuda.synchronize(0)

    launches(100)
    parts.append(f"launch {best(launches) / 5000 * 1e6:.2f} us")
    for d in range(n_gpu):
        a = torch.randn(8192, 8192, device=f"cuda:{d}", dtype=torch.float16)

        def gemms(k=10, a=a, d=d):
            for _ in range(k):
                a @ a
            torch.cuda.synchronize(d)

        gemms(2)
        parts.append(f"gemm{d} {10 * 2 * 8192 ** 3 / best(gemms) / 1e12:.0f} TF")
    if n_gpu > 1:
        src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
        dst = torch.empty_like(src, device="cuda:1")

        def copies(k=10):
            for _ in range(k):
                dst.copy_(src)
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(1)

        copies(2)
        parts.append(f"copy0to1 {10 * src.numel() / best(copies) / 1e9:.0f} GB/s")
    print("machine: " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    main()
