"""Where the GPU time of an update goes on every rank of a lightseq-train run (torch.profiler).

    torchrun --nproc_per_node 2 benchmarks/profile_ranks.py --profile-updates 120:20 DATA <lightseq-train args>
    python benchmarks/profile_ranks.py --profile-updates 120:20 DATA <lightseq-train args> --update-freq 2

Runs lightseq-train unchanged and records the CUDA kernels of ``count`` updates starting at update
``start`` (after a device synchronisation; the training itself is not changed). Each rank then
prints, per update: the host wall time, the GPU timeline span, the time covered by compute
kernels, by NCCL kernels, by NCCL kernels while no compute kernel ran (communication that was not
overlapped) and the time no kernel ran at all (the GPU waiting for the host or for another rank),
followed by the largest idle gaps (named by the kernels before and after them) and the top kernels.

``--host-ops`` records the host side too (torch.profiler's CPU activity; it slows the host down): per
thread (the main thread runs the forward and the step, autograd's device thread the backward), the
host time covered by recorded ops per update and the ops with the most self time, and the host time
of every NCCL collective call.
"""

import os
import sys
import time

from _timeline import covered_time
from _trainer_setup import pop_flag, pop_option


def tally(pairs, top):
    """(key, microseconds) pairs -> the ``top`` keys with the most time: [(key, total us, count)]."""
    sums = {}
    for key, us in pairs:
        t = sums.setdefault(key, [0.0, 0])
        t[0] += us
        t[1] += 1
    return sorted(((k, t, n) for k, (t, n) in sums.items()), key=lambda r: -r[1])[:top]


def report(prof, wall_s, count, top=8):
    rank = int(os.environ.get("RANK", "0"))
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not events:
        print(f"[rank {rank}] no CUDA kernels recorded", flush=True)
        return
    spans = [(e.time_range.start, e.time_range.end) for e in events]
    nccl = [(e.time_range.start, e.time_range.end) for e in events if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in events if "nccl" not in e.name.lower()]
    window = max(s[1] for s in spans) - min(s[0] for s in spans)
    busy, busy_compute = covered_time(spans), covered_time(compute)
    per = 1e3 * count  # us -> ms per update
    print(f"[rank {rank}] PROFILE {count} updates: wall {wall_s * 1e3 / count:.2f} ms/update, GPU span "
          f"{window / per:.2f}, compute kernels {busy_compute / per:.2f}, NCCL kernels {covered_time(nccl) / per:.2f} "
          f"(not overlapped with compute {(busy - busy_compute) / per:.2f}), no kernel running "
          f"{(window - busy) / per:.2f}, kernels/update {len(events) / count:.0f}", flush=True)
    # idle gaps (no kernel on any stream), each attributed to the kernels on both sides of it
    gaps, end, prev = [], None, None
    for e in sorted(events, key=lambda e: e.time_range.start):
        if end is not None and e.time_range.start - end > 10:
            gaps.append((f"{prev[:48]} -> {e.name[:48]}", e.time_range.start - end))
        if end is None or e.time_range.end > end:
            end, prev = e.time_range.end, e.name
    for key, t, n in tally(gaps, top):
        print(f"[rank {rank}]   idle {t / per:6.3f} ms/update in {n / count:5.1f} gaps >10us: {key}", flush=True)
    for name, t, n in tally(((e.name, e.time_range.end - e.time_range.start) for e in events), top):
        print(f"[rank {rank}]   {t / per:7.3f} ms/update {n / count:6.1f} calls  {name[:110]}", flush=True)


def cpu_report(prof, count, top=25):
    """Host time per update by thread, and each busy thread's ops with the most self time."""
    rank = int(os.environ.get("RANK", "0"))
    per = 1e3 * count
    events = [e for e in prof.events() if e.device_type.name == "CPU"]
    threads = {}
    for e in events:
        threads.setdefault(e.thread, []).append(e)
    for tid, evs in sorted(threads.items(), key=lambda kv: -len(kv[1])):
        tops = [(e.time_range.start, e.time_range.end) for e in evs if e.cpu_parent is None]
        busy = covered_time(tops)
        if busy / per < 0.05:
            continue
        print(f"[rank {rank}] HOST thread {tid}: {busy / per:.2f} ms/update covered by ops, "
              f"{len(evs) / count:.0f} ops/update", flush=True)
        for name, t, n in tally(((e.name, e.self_cpu_time_total) for e in evs), top):
            print(f"[rank {rank}]   self {t / per:7.3f} ms/update {n / count:6.1f} calls  {name[:110]}", flush=True)
    calls = ((e.name, e.time_range.end - e.time_range.start) for e in events
             if e.name.startswith(("c10d::", "nccl:")) or "reduce_scatter" in e.name or "all_reduce" in e.name)
    for name, t, n in tally(calls, 12):
        print(f"[rank {rank}]   collective {t / per:7.3f} ms/update {n / count:6.1f} calls "
              f"({t / max(n, 1):.1f} us each)  {name[:90]}", flush=True)


def main():
    argv = sys.argv[1:]
    start, count = (int(x) for x in pop_option(argv, "--profile-updates", "120:20", str).split(":"))
    cpu = pop_flag(argv, "--host-ops")
    import torch
    from torch.profiler import ProfilerActivity, profile

    from ls_fairseq.cli import train
    from ls_fairseq.fairseq_ext.trainer import LSTrainer

    step = LSTrainer.train_step
    state = {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def train_step(self, samples, raise_oom=False):
        if "prof" not in state and self.get_num_updates() >= start:
            sync()
            acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            if cpu or not acts:
                acts.append(ProfilerActivity.CPU)
            state["prof"] = profile(activities=acts)
            state["prof"].__enter__()
            state["t0"], state["n0"] = time.perf_counter(), self.get_num_updates()
        out = step(self, samples, raise_oom)
        if "prof" in state and "done" not in state and self.get_num_updates() >= state["n0"] + count:
            sync()
            wall = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)
            state["done"] = True
            report(state["prof"], wall, self.get_num_updates() - state["n0"])
            if cpu:
                cpu_report(state["prof"], self.get_num_updates() - state["n0"])
        return out

    LSTrainer.train_step = train_step
    train.cli_main(argv)


if __name__ == "__main__":
    main()
