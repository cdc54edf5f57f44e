"""Which CPUs of this machine slow each other down (a virtual machine may hide that two of its CPUs
are hyperthreads of one physical core, or share other resources).

For CPU a (--base, default 0) and every other CPU b: one process pinned to a and one pinned to b each
run the same pure-Python loop at once; the line for b gives a's time against a's time alone (1.00 =
no interference). Pairs near 1.0 are independent; pairs well above it share a core or a cache.

    python benchmarks/cpu_pairs.py [--base 0] [--work 2000000]
"""

import argparse
import multiprocessing as mp
import os
import time


def spin(cpu, work, start, out):
    os.sched_setaffinity(0, {cpu})
    start.wait()
    t0 = time.perf_counter()
    x = 0
    for i in range(work):
        x += i * i % 7
    out.put((cpu, time.perf_counter() - t0))


def timed(cpus, work):
    start, out = mp.Event(), mp.Queue()
    procs = [mp.Process(target=spin, args=(c, work, start, out)) for c in cpus]
    for p in procs:
        p.start()
    time.sleep(0.2)
    start.set()
    times = dict(out.get() for _ in procs)
    for p in procs:
        p.join()
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", type=int, default=0)
    ap.add_argument("--work", type=int, default=2_000_000)
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    solo = min(timed([args.base], args.work)[args.base] for _ in range(3))
    print(f"PAIRS base cpu {args.base} alone: {solo * 1e3:.1f} ms")
    row = []
    for b in cpus:
        if b == args.base:
            continue
        t = timed([args.base, b], args.work)
        row.append((b, t[args.base] / solo, t[b] / solo))
    for b, ra, rb in row:
        print(f"PAIRS {args.base}+{b}: {ra:.2f} {rb:.2f}")
    worst = sorted(row, key=lambda r: -max(r[1], r[2]))[:4]
    print("PAIRS most interference: " + ", ".join(f"{args.base}+{b} {max(ra, rb):.2f}" for b, ra, rb in worst))


if __name__ == "__main__":
    main()
