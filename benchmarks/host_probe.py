"""Where the host time of a training step goes (GPU machine).

Takes fairseq-train flags (plus --user-dir for ls models). Loads --batches batches once,
warms up on them, then reports for the steady state:

* STEP    mean wall ms per trainer.train_step, with fairseq's Trainer and with LSTrainer;
* PHASE   host ms (time until the Python call returns) and GPU ms (until the GPU is done)
          of forward, backward and optimizer step, each measured after a synchronize: where
          host ms is close to GPU ms, the phase is host-bound;
* SYNC    host<->device synchronisations inside one train_step and where they come from;
* TPROF   with --torch-profile: torch.profiler (CPU side only) over the forwards of the batches:
          host ms per forward and the ops with the most own host time, with their call counts
          per forward (so two autograd settings can be compared op by op);
* CPROF   the Python functions with the most own time over the batches (backward runs on the
          calling thread here so its Python shows up).

    python benchmarks/host_probe.py DATA --arch ... [fairseq-train flags] [--batches 12] [--skip-cprofile]
        [--torch-profile]
"""

import cProfile
import collections
import io
import os
import pstats
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _trainer_setup import build, first_batches, pop_flag, pop_option  # noqa: E402


def main():
    argv = sys.argv[1:]
    n_batches = pop_option(argv, "--batches", 12, int)
    skip_cprofile = pop_flag(argv, "--skip-cprofile")
    torch_profile = pop_flag(argv, "--torch-profile")
    import torch
    from fairseq.trainer import Trainer

    from ls_fairseq.fairseq_ext.trainer import LSTrainer

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


if __name__ == "__main__":
    main()
