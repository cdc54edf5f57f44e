"""torch.profiler summary of steady-state training steps of a fairseq setup.

Takes the same flags as fairseq-train (and --user-dir for ls models). It trains on the
first --batches batches once (warm-up: every shape seen, allocator and plans warm), then
profiles the same batches again and prints: top kernels by GPU time, the GEMM share, the
attention share, and the idle time (wall time not covered by any kernel).

    python benchmarks/profile_step.py DATA --arch ... [fairseq-train flags] [--batches 8] [--top 25] [--copies]
        [--ls-graph-step on]  (the CUDA-graph step, as lightseq-train runs it by default)
"""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for ls_fairseq

from _trainer_setup import build, covered_time, first_batches, pop_flag, pop_option  # noqa: E402


def main():
    argv = sys.argv[1:]
    copies = pop_flag(argv, "--copies")
    top = pop_option(argv, "--top", 25, int)
    n_batches = pop_option(argv, "--batches", 8, int)
    graph_step = pop_option(argv, "--ls-graph-step", "off", str)
    import torch
    from torch.profiler import ProfilerActivity, profile

    from fairseq.trainer import Trainer

    if "ls_adam" in argv:  # ls_adam's option: the graphs only when asked for here
        argv += ["--ls-graph-step", graph_step]
    cfg, task, model, criterion = build(argv)
    if cfg.model._name.startswith("ls_"):  # what lightseq-train runs
        from ls_fairseq.fairseq_ext.step.trainer import LSTrainer as Trainer
    trainer = Trainer(cfg, task, model, criterion)
    batches = first_batches(trainer, n_batches)

    def run():
        words = 0
        for b in batches:
            trainer.train_step([b])
            words += b["ntokens"]
        return words

    run()
    run()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        words = run()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    # kernel intervals (us) for the idle estimate
    busy = covered_time((e.time_range.start, e.time_range.end) for e in events)
    by_name = {}
    for e in events:
        by_name.setdefault(e.name, [0.0, 0])
        by_name[e.name][0] += e.time_range.end - e.time_range.start
        by_name[e.name][1] += 1
    total = sum(v[0] for v in by_name.values())

    def share(pred):
        return sum(v[0] for k, v in by_name.items() if pred(k.lower())) / max(total, 1e-9)

    gemm = share(lambda k: any(s in k for s in ("gemm", "cutlass", "xmma", "cublas", "nvjet", "sm90_")))
    attn = share(lambda k: any(s in k for s in ("flash", "fmha", "attention", "cudnn")))
    print(f"PROFILE {cfg.model._name if hasattr(cfg.model, '_name') else ''} steps={len(batches)} "
          f"wall={wall * 1e3:.1f}ms words/s={words / wall:.0f} kernel_time={total / 1e3:.1f}ms "
          f"busy={busy / 1e3:.1f}ms idle={(wall * 1e6 - busy) / 1e3:.1f}ms ({(1 - busy / (wall * 1e6)) * 100:.1f}%) "
          f"gemm_share={gemm * 100:.1f}% attention_share={attn * 100:.1f}% kernels={len(events)}")
    steps = len(batches)
    print(f"{'kernel':90s} {'ms':>8s} {'%':>6s} {'calls':>6s} {'ms/step':>8s} {'calls/step':>10s}")
    for name, (t, n) in sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{name[:90]:90s} {t / 1e3:8.2f} {100 * t / total:6.1f} {n:6d} {t / 1e3 / steps:8.3f} {n / steps:10.1f}")


    if copies:
        _copy_origins(run, torch, ProfilerActivity, profile)


def _copy_origins(run, torch, ProfilerActivity, profile):
    """Which Python lines issue the copy / fill / add ops of a step (--copies)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        run()
        torch.cuda.synchronize()
    names = {"aten::copy_", "aten::clone", "aten::_to_copy", "aten::add_", "aten::add", "aten::fill_",
             "aten::zero_", "aten::cat", "aten::stack", "aten::sum", "aten::mul"}
    rows = [e for e in prof.key_averages(group_by_stack_n=5) if e.key in names]
    rows.sort(key=lambda e: -getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)))
    print("COPIES op count device_ms stack")
    for e in rows[:25]:
        t = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)) / 1e3
        frames = " <- ".join(f.split("/")[-1] for f in (e.stack or [])[:5])
        print(f"COPIES {e.key} {e.count} {t:.2f} {frames}")


if __name__ == "__main__":
    main()
