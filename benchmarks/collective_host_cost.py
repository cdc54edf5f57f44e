"""Host microseconds per NCCL collective call as the overlapped reduction issues them: asynchronous
reduce-scatters and all-reduces of 25 MB slices of a 418 MB fp16 buffer (the big Transformer's
gradients), issued while the GPU is held busy, so no call waits for the GPU.

    torchrun --nproc_per_node 2 benchmarks/collective_host_cost.py [--bucket-mb 25] [--total-mb 418]

Prints, per rank, the median over repeats of the host time per call for each kind of call, and for
comparison one elementwise launch (the machine's launch cost). Environment variables of torch's
process group (TORCH_FR_BUFFER_SIZE, TORCH_NCCL_*) can be set around it to see what they cost.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bucket-mb", type=float, default=25)
    ap.add_argument("--total-mb", type=float, default=418)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    world = dist.get_world_size()
    n = int(args.total_mb * 2**20) // 2 // (world * 256) * (world * 256)
    step = int(args.bucket_mb * 2**20) // 2 // (world * 256) * (world * 256)
    flat = torch.zeros(n, device="cuda", dtype=torch.float16)
    buckets = [flat[s:min(s + step, n)] for s in range(0, n, step)]
    buckets = [b for b in buckets if b.numel() % world == 0]
    outs = [b[: b.numel() // world] for b in buckets]
    x = torch.zeros(1, device="cuda")

    def rs():
        return [dist.reduce_scatter_tensor(o, b, async_op=True) for o, b in zip(outs, buckets)]

    def ar():
        return [dist.all_reduce(b, async_op=True) for b in buckets]

    def launches():
        for _ in buckets:
            x.add_(1)
        return []

    results = {}
    for name, fn in (("reduce_scatter_tensor", rs), ("all_reduce", ar), ("add_ (one launch)", launches)):
        per_call = []
        for _ in range(args.repeats):
            dist.barrier()
            torch.cuda.synchronize()
            torch.cuda._sleep(100_000_000)  # the GPU stays busy while the calls are issued
            t0 = time.perf_counter()
            works = fn()
            per_call.append((time.perf_counter() - t0) / len(buckets) * 1e6)
            for w in works:
                w.wait()
            torch.cuda.synchronize()
        results[name] = statistics.median(per_call[1:])
    line = ", ".join(f"{k} {v:.1f} us" for k, v in results.items())
    print(f"[rank {dist.get_rank()}] COLL host per call ({len(buckets)} buckets of {args.bucket_mb:g} MB): {line}",
          flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
