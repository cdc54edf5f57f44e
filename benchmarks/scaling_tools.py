"""Tools for the multi-GPU scaling rounds (benchmarks/gpu_session.sh, step "scaling") and for training logs.

    python benchmarks/scaling_tools.py machine        # one line: how fast this host and its GPUs are right now
    python benchmarks/scaling_tools.py host-probe DATA --arch ... [fairseq-train flags] [--batches 12]
        [--skip-cprofile] [--torch-profile]           # where the host time of a training step goes
    python benchmarks/scaling_tools.py pairs AFTER ONE_GPU.log TWO_GPU.log [ONE_GPU.log TWO_GPU.log ...]
    python benchmarks/scaling_tools.py summarize "DIR/*.log" AFTER

machine: host Python loop (ms), CUDA launch (us per tiny kernel), fp16 GEMM TFLOP/s per GPU, GPU 0 -> 1 copy GB/s,
each the best of a few repeats, so that a call on a degraded machine can be recognised without a training run.
host-probe: STEP (wall ms per train_step, fairseq's Trainer and LSTrainer), PHASE (host and GPU ms of forward,
backward, optimizer step: host ms close to GPU ms means host-bound), SYNC (host-device synchronisations in a step),
TPROF (--torch-profile: host ops of the forwards), CPROF (Python functions with the most own time).
pairs: per pair of logs the mean and median train_inner words/s after update AFTER and their ratio, then the median
over the pairs. summarize: each log's train_inner losses and its mean words/s after update AFTER.
"""

import cProfile
import collections
import glob
import io
import os
import pstats
import re
import statistics
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for ls_fairseq

from _trainer_setup import build, first_batches, pop_flag, pop_option  # noqa: E402


# ---------------------------------------------------------------- training logs
def train_inner_rows(path):
    """The key=value fields of every train_inner line of a --log-format simple log."""
    return [dict(re.findall(r"(\w+)=([\d.]+)", line)) for line in open(path) if "train_inner" in line]


def wps_after(rows, after):
    """The words/s of the train_inner intervals that end after update ``after``."""
    return [float(r["wps"]) for r in rows if "wps" in r and int(r["num_updates"]) > after]


def summarize(argv):
    """summarize PATTERN AFTER"""
    if len(argv) != 2 or not argv[1].isdigit():
        sys.exit("usage: scaling_tools.py summarize \"DIR/*.log\" AFTER (AFTER: an update number)")
    pattern, after = argv[0], int(argv[1])
    for f in sorted(glob.glob(pattern)):
        rows = train_inner_rows(f)
        late = wps_after(rows, after)
        print(f.split("/")[-1], "loss@" + " ".join(f"{r['num_updates']}:{r['loss']}" for r in rows),
              f"| wps mean after update {after}: {sum(late) / max(1, len(late)):.0f}")


def intervals(path, after):
    """The train_inner words/s of a log after update ``after``."""
    return wps_after(train_inner_rows(path), after)


def pairs(argv):
    """pairs AFTER ONE_GPU.log TWO_GPU.log [...]"""
    if not argv or not argv[0].isdigit():
        sys.exit("usage: scaling_tools.py pairs AFTER ONE_GPU.log TWO_GPU.log [...] (AFTER: an update number)")
    after, logs = int(argv[0]), argv[1:]
    if not logs or len(logs) % 2:
        sys.exit("usage: scaling_tools.py pairs AFTER ONE_GPU.log TWO_GPU.log [...] (logs in pairs)")
    ratios = []
    for one, two in zip(logs[::2], logs[1::2]):
        a, b = intervals(one, after), intervals(two, after)
        if not a or not b:
            sys.exit(f"no train_inner words/s after update {after} in {one if not a else two}")
        mean = statistics.mean(b) / statistics.mean(a)
        med = statistics.median(b) / statistics.median(a)
        ratios.append((mean, med))
        print(f"{one.split('/')[-1]} {statistics.mean(a):.0f} (median {statistics.median(a):.0f}) | "
              f"{two.split('/')[-1]} {statistics.mean(b):.0f} (median {statistics.median(b):.0f}) | "
              f"ratio {mean:.3f} (medians {med:.3f})")
    if len(ratios) > 1:
        print(f"median over {len(ratios)} pairs: ratio {statistics.median(r[0] for r in ratios):.3f} "
              f"(medians {statistics.median(r[1] for r in ratios):.3f})")


# ---------------------------------------------------------------- machine check
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


def machine(argv):
    """machine: one line, how fast the host and GPUs are right now."""
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


# ---------------------------------------------------------------- host probe
def host_probe(argv):
    """host-probe DATA [fairseq-train flags]"""
    argv = list(argv)
    n_batches = pop_option(argv, "--batches", 12, int)
    skip_cprofile = pop_flag(argv, "--skip-cprofile")
    torch_profile = pop_flag(argv, "--torch-profile")
    import torch
    from fairseq.trainer import Trainer

    from ls_fairseq.fairseq_ext.step.trainer import LSTrainer

    cfg, task, model, criterion = build(argv)
    name = cfg.model._name
    cuda = torch.cuda.is_available() and not cfg.common.cpu
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    results = {}
    for kind, cls in (("plain", Trainer), ("ls", LSTrainer)):
        trainer = cls(cfg, task, model, criterion)
        batches = first_batches(trainer, n_batches)

        def run():
            for b in batches:
                trainer.train_step([b])

        run()
        run()
        sync()
        t0 = time.perf_counter()
        for _ in range(3):
            run()
        sync()
        results[kind] = (time.perf_counter() - t0) / (3 * len(batches)) * 1e3
        print(f"STEP {name} trainer={kind} ms/step={results[kind]:.2f}", flush=True)
    print(f"STEP {name} plain/ls={results['plain'] / results['ls']:.3f}", flush=True)

    # ---------------------------------------------------------------- phases
    sums = collections.defaultdict(float)
    overflows = 0
    for b in batches:
        sample, _ = trainer._prepare_sample(b)
        trainer.model.train()
        trainer.zero_grad()
        sync()
        t0 = time.perf_counter()
        loss, sample_size, _ = criterion(trainer.model, sample)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        trainer.optimizer.backward(loss)
        t3 = time.perf_counter()
        sync()
        t4 = time.perf_counter()
        trainer.optimizer.multiply_grads(1.0 / float(sample_size))
        try:
            gn = trainer.optimizer.clip_grad_norm(0.0)
            trainer.optimizer.step()
        except OverflowError:  # fp16 loss scale lowered (as fairseq's trainer does): the step is skipped
            gn, overflows = None, overflows + 1
        t5 = time.perf_counter()
        sync()
        t6 = time.perf_counter()
        del gn
        sums["fwd_host"] += t1 - t0
        sums["fwd_gpu"] += t2 - t0
        sums["bwd_host"] += t3 - t2
        sums["bwd_gpu"] += t4 - t2
        sums["opt_host"] += t5 - t4
        sums["opt_gpu"] += t6 - t4
    n = len(batches)
    print("PHASE " + " ".join(f"{k}={v / n * 1e3:.2f}ms" for k, v in sums.items())
          + (f" (fp16 overflows: {overflows} of {n} steps skipped)" if overflows else ""), flush=True)

    # ------------------------------------------------------------------ syncs
    where = collections.Counter()

    def showwarning(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if ("fairseq" in f.filename or "ls_fairseq" in f.filename) and "warnings" not in f.filename]
        key = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}" for f in frames[-3:][::-1])
        where[f"{str(message)[:60]} @ {key}"] += 1

    old = warnings.showwarning
    warnings.showwarning = showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = showwarning
        if cuda:
            torch.cuda.set_sync_debug_mode(1)
        try:
            for b in batches[:2]:
                trainer.train_step([b])
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
    warnings.showwarning = old
    print(f"SYNC total over 2 steps: {sum(where.values())}")
    for k, v in where.most_common(20):
        print(f"SYNC {v:4d}  {k}")
    sys.stdout.flush()

    if torch_profile:
        forward_profile(trainer, criterion, batches, sync)
    if skip_cprofile:
        return
    torch.autograd.set_multithreading_enabled(False)
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for b in batches:
        trainer.train_step([b])
    sync()
    prof.disable()
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s).sort_stats("tottime")
    st.print_stats(80)
    print("CPROF tottime\n" + s.getvalue()[-20000:])
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumtime").print_stats(80)
    print("CPROF cumtime\n" + s.getvalue()[-20000:])


def forward_profile(trainer, criterion, batches, sync):
    """TPROF lines: the host side of the forwards, op by op (self CPU time and calls per forward)."""
    from torch.profiler import ProfilerActivity, profile

    samples = [trainer._prepare_sample(b)[0] for b in batches]
    trainer.model.train()
    sync()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for sample in samples:
            loss, _, _ = criterion(trainer.model, sample)
            del loss
            sync()
    n = len(samples)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events) / 1e3 / n
    print(f"TPROF forward self-CPU ms per forward (profiled, so inflated): {total:.2f}", flush=True)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    for e in events[:45]:
        print(f"TPROF {e.self_cpu_time_total / 1e3 / n:8.3f} ms {e.count / n:7.1f} calls  {e.key[:90]}")
    sys.stdout.flush()


COMMANDS = {"machine": machine, "host-probe": host_probe, "pairs": pairs, "summarize": summarize}


def main():
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        sys.exit(f"usage: scaling_tools.py {{{','.join(COMMANDS)}}} ...: the first argument names the tool")
    COMMANDS[sys.argv[1]](sys.argv[2:])


if __name__ == "__main__":
    main()
