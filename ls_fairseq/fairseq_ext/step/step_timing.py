"""LS_FAIRSEQ_STEP_TIMING=1: where the time of a training update goes.

:class:`StepTimer` records, for the deferred step of :class:`~ls_fairseq.fairseq_ext.step.trainer.LSTrainer`
on CUDA, the GPU time of each micro-batch's forward and backward, of each whole update, of its part
after the last backward and of the gap between updates (CUDA events, read when the update is settled),
and the host time of each part of the train step. :func:`step_timing_summary` and
:func:`host_sections_summary` turn those into the two lines every rank logs at exit.
"""

import logging
import time

import torch

logger = logging.getLogger("fairseq.trainer")  # fairseq's own logger: the same lines as its Trainer


def step_timing_summary(micro, updates, tails, gaps, skip=0.25, waits=None):
    """The line ``LS_FAIRSEQ_STEP_TIMING=1`` logs: medians over the updates after the first ``skip``
    fraction (allocator and autotuning warm-up), all in GPU milliseconds; and the updates' mean (batches of
    several shapes: the median is a typical update's time, the mean sets the throughput).

    ``micro``: per update, the forward + backward of each micro-batch; ``updates``: first
    micro-batch start to the end of the optimizer step; ``tails``: end of the last backward to
    the end of the optimizer step (gradient reduction still running, norm, Adam); ``gaps``: the
    end of the previous update to the start of this one (the sample's copy and whatever the GPU
    waited for: a gap well above the sample's copy means it waited for the host);
    ``waits``: host milliseconds, per update, that the host spent waiting for the previous update's
    outcome when it settled it (after queueing this update's forward and backward). Near zero, the
    host is the bottleneck: the GPU may already be idle, waiting for the next launches."""
    import statistics

    n = len(updates)
    if n == 0:
        return None
    first = min(int(n * skip), n - 1)
    med = statistics.median
    flat = [m for ms in micro[first:] for m in ms]
    line = (f"step timing: {n} updates, medians over the last {n - first}: update {med(updates[first:]):.2f} ms "
            f"(mean {statistics.mean(updates[first:]):.2f}), "
            f"micro-batch fwd+bwd {med(flat):.2f} ms, after the last backward {med(tails[first:]):.2f} ms")
    kept_gaps = [g for g in gaps[first:] if g is not None]
    if kept_gaps:
        line += (f", between updates {med(kept_gaps):.2f} ms (mean {statistics.mean(kept_gaps):.2f}, "
                 f"max {max(kept_gaps):.2f})")
    kept_waits = [w for w in (waits or [])[first:] if w is not None]
    if kept_waits:
        ordered = sorted(kept_waits)
        line += (f", host waits at the settle {med(kept_waits):.2f} ms (tenth percentile "
                 f"{ordered[len(ordered) // 10]:.2f}, under 1 ms in {sum(w < 1.0 for w in kept_waits)} of {len(kept_waits)})")
    pairs = [ms for ms in micro[first:] if len(ms) == 2]
    if pairs:
        # first and second apart: whether the slower one is a batch or a position (after the step)
        line += (f", pairs of micro-batches: mean {med([sum(ms) / 2 for ms in pairs]):.2f} ms, slower of the two "
                 f"{med([max(ms) for ms in pairs]):.2f} ms, first {med([ms[0] for ms in pairs]):.2f} ms, "
                 f"second {med([ms[1] for ms in pairs]):.2f} ms")
    return line


def host_sections_summary(sections, skip=0.25):
    """One line: the median host milliseconds of each part of the train step (and of the time
    outside it, in fairseq's loop), over the values after the first ``skip`` fraction. Forward and
    backward have one value per micro-batch, the other parts one per update."""
    import statistics

    parts = []
    for name, values in sections.items():
        kept = values[min(int(len(values) * skip), len(values) - 1):] if values else []
        if kept:
            parts.append(f"{name} {statistics.median(kept):.2f}")
    return ("host ms per update (medians; forward and backward per micro-batch): " + ", ".join(parts)
            if parts else None)


class StepTimer:
    """``LS_FAIRSEQ_STEP_TIMING=1`` (CUDA, deferred step): GPU milliseconds of every micro-batch's
    forward + backward, of every whole update, of its part after the last backward, and of the
    time between updates, from CUDA events read when the update is settled (no extra waits); a
    summary line (:func:`step_timing_summary`) is logged at exit by every rank. For benchmarks:
    it shows how far the per-batch times of data-parallel ranks differ (the slowest rank sets the
    pace) and whether the GPU waits for the host between updates."""

    def __init__(self, rank=0):
        self.rank = rank
        self.micro, self.updates, self.tails, self.gaps = [], [], [], []
        self.waits = []  # host ms waiting for the settled update, aligned with the updates it settles
        self.last_end = None
        # host milliseconds of each part of train_step (see host_sections_summary)
        self.host = {}
        self._host_t = None
        self._host_left = None  # when the previous train_step returned
        import atexit

        atexit.register(self.report)

    def host_start(self):
        now = time.perf_counter()
        if self._host_left is not None:
            self.host.setdefault("outside the step", []).append((now - self._host_left) * 1e3)
        self._host_t = now

    def host_mark(self, name):
        """Close the host section ``name`` (started by the previous mark or host_start)."""
        now = time.perf_counter()
        if self._host_t is not None:
            self.host.setdefault(name, []).append((now - self._host_t) * 1e3)
        self._host_t = now

    def host_end(self):
        self.host_mark("the rest of the step")
        self._host_left = time.perf_counter()

    def mark(self):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def settle(self, events, wait=None):
        self.waits.append(wait)
        marks = [e.elapsed_time(f) for e, f in zip(events[:-2:2], events[1:-1:2])]
        self.micro.append(marks)
        self.updates.append(events[0].elapsed_time(events[-1]))
        self.tails.append(events[-2].elapsed_time(events[-1]))
        self.gaps.append(self.last_end.elapsed_time(events[0]) if self.last_end is not None else None)
        self.last_end = events[-1]

    def report(self):
        line = step_timing_summary(self.micro, self.updates, self.tails, self.gaps, waits=self.waits)
        if line is not None:
            logger.warning("rank %d %s", self.rank, line)
        line = host_sections_summary(self.host)
        if line is not None:
            logger.warning("rank %d %s", self.rank, line)
