"""Probe (torchrun, one node): does an all-reduce through the GPUs' copy engines (peer reads of
symmetric memory, then a small add kernel) hide behind compute better than NCCL's, whose
kernels take SMs from the compute they overlap with?

    torchrun --nproc_per_node 2 benchmarks/ce_allreduce_probe.py [--mb 420] [--bucket-mb 25]

Prints, per method: the all-reduce alone (ms, GB/s), a matmul loop alone, and the loop with the
bucketed all-reduce running beside it on another stream (loop time, time until both are done).
Checks first that both methods give the same sums."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem


def ce_all_reduce(buf, hdl, start, end, staging, rank, world):
    """Sum buf[start:end] over the ranks in place (buf: this rank's symmetric tensor)."""
    n = end - start
    shard = (n + world - 1) // world
    lo = [start + min(n, p * shard) for p in range(world + 1)]
    hdl.barrier(channel=0)  # every rank's bucket is complete
    mine = buf[lo[rank]:lo[rank + 1]]
    m = mine.numel()
    parts = []
    for step in range(1, world):
        p = (rank + step) % world
        dst = staging[(step - 1) * shard:(step - 1) * shard + m]
        dst.copy_(hdl.get_buffer(p, (m,), buf.dtype, lo[rank]))
        parts.append(dst)
    for t in parts:
        mine.add_(t)
    hdl.barrier(channel=0)  # every shard is reduced
    for step in range(1, world):
        p = (rank + step) % world
        buf[lo[p]:lo[p + 1]].copy_(hdl.get_buffer(p, (lo[p + 1] - lo[p],), buf.dtype, lo[p]))
    hdl.barrier(channel=0)  # nobody reads this rank's buffer any more


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=420)
    ap.add_argument("--bucket-mb", type=float, default=25)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    dev = torch.device("cuda")
    n = int(args.mb * 2**20) // 2
    buf = symm_mem.empty(n, dtype=torch.float16, device=dev)
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD)
    bucket = int(args.bucket_mb * 2**20) // 2
    bounds = [(s, min(n, s + bucket)) for s in range(0, n, bucket)]
    staging = torch.empty(((bucket + world - 1) // world) * (world - 1), dtype=torch.float16, device=dev)
    comm = torch.cuda.Stream()

    def nccl_all(b):
        for s, e in bounds:
            dist.all_reduce(b[s:e])

    def ce_all(b):
        for s, e in bounds:
            ce_all_reduce(b, hdl, s, e, staging, rank, world)

    methods = {"nccl": nccl_all, "ce": ce_all}
    # same sums
    g = torch.Generator(device=dev).manual_seed(rank)
    src = torch.randn(n, generator=g, device=dev).half()
    out = {}
    for name, fn in methods.items():
        buf.copy_(src)
        torch.cuda.synchronize()
        dist.barrier()
        fn(buf)
        torch.cuda.synchronize()
        out[name] = buf.clone()
    if not torch.equal(out["nccl"], out["ce"]):
        d = (out["nccl"].float() - out["ce"].float()).abs().max().item()
        raise SystemExit(f"rank {rank}: sums differ, max abs diff {d}")
    if rank == 0:
        print(f"sums agree on {n} fp16 values ({args.mb} MB), {len(bounds)} buckets of {args.bucket_mb} MB")

    a = torch.randn(8192, 4096, device=dev, dtype=torch.float16)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.float16)

    def loop():
        for _ in range(60):
            torch.mm(a, w)

    def timed(fn, reps=args.iters):
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        torch.cuda.synchronize()
        dist.barrier()
        ev[0].record()
        for _ in range(reps):
            fn()
        ev[1].record()
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]) / reps

    timed(loop, 2)
    t_loop = timed(loop)
    res = {}
    for name, fn in methods.items():
        timed(lambda: fn(buf), 2)
        t_ar = timed(lambda: fn(buf))

        def both():
            comm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(comm):
                fn(buf)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            loop()
            end.record()
            torch.cuda.current_stream().wait_stream(comm)
            both.ev.append((start, end))

        both.ev = []
        timed(both, 2)
        both.ev = []
        t_both = timed(both)
        t_loop_in = sum(s.elapsed_time(e) for s, e in both.ev) / len(both.ev)
        res[name] = (t_ar, t_loop_in, t_both)
    if rank == 0:
        print(f"matmul loop alone: {t_loop:.3f} ms")
        for name, (t_ar, t_li, t_b) in res.items():
            print(f"{name:5s} all-reduce alone {t_ar:.3f} ms ({args.mb * 2**20 / t_ar / 1e6:.0f} GB/s algbw); "
                  f"with the loop beside it: loop {t_li:.3f} ms (+{t_li - t_loop:.3f}), both done {t_b:.3f} ms "
                  f"(serial would be {t_loop + t_ar:.3f})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
