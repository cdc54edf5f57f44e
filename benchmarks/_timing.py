"""GPU time of one call, shared by the op benchmarks (bench_ops.py, bench_attention.py)."""

import statistics
import sys

import torch


def graphed_ms(fn, reps: int = 10, rounds: int = 5) -> float:
    """Median GPU milliseconds of one call of ``fn``: a CUDA graph holds ``reps`` calls back to back and is replayed
    ``rounds`` times, so that the host's launch latency is not counted for kernels of tens of microseconds. Where
    ``fn`` cannot be captured, ``reps`` eager calls are timed alike. ``fn`` runs three times first (on a side stream:
    allocations, library handles)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()  # the first replay uploads the graph
        run = graph.replay
    except RuntimeError as e:  # e.g. a library call that refuses capture
        # said on stderr: eager times of short kernels include the host's launch latency
        print(f"_timing: {getattr(fn, '__name__', 'the call')} could not be captured in a CUDA graph ({e}); timed "
              "eagerly, launch latency included", file=sys.stderr, flush=True)

        def run():
            for _ in range(reps):
                fn()
    torch.cuda.synchronize()
    return event_ms(run, rounds) / reps


def event_ms(run, rounds: int) -> float:
    """Median milliseconds between two CUDA events around ``run()``, over ``rounds`` calls."""
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
