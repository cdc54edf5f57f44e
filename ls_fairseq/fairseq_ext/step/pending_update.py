"""The updates the deferred step leaves pending, and settling them.

The deferred step (:mod:`~ls_fairseq.fairseq_ext.step.deferred_step`) queues update n and returns
without reading its outcome. :class:`PendingUpdate` holds that outcome on its way to the host (one copy
into pinned memory); :meth:`PendingUpdates.settle` reads it, during a later update or whenever something
needs the exact state, and does the host side of fairseq's step: on overflow the loss scale goes down
and the update is taken back, otherwise the update's statistics are logged.

How many updates may be pending (:func:`pending_limit`): with fp16's dynamic loss scale one, as an
overflow of update n changes the loss scale, the learning rate and the step count that update n + 1
uses. Without a loss scale (bf16, fp32) nothing an update's outcome decides reaches the next updates (a
non-finite gradient stops training), and PENDING_WITHOUT_SCALE may be pending, so that host work longer
than one update (a CUDA-graph capture, a slow batch) hides behind the GPU's queue. Updates are settled in
order, so the logged statistics are the same either way.
"""

import logging
import math
import time
from collections import deque

import torch
from fairseq import metrics
from fairseq.optim.fp16_optimizer import MemoryEfficientFP16Optimizer

from ls_fairseq.fairseq_ext.memory_modes import zero_weight_report
from ls_fairseq.fairseq_ext.step.step_stats import SummedLogs

logger = logging.getLogger("fairseq.trainer")  # fairseq's own logger: the same lines as its Trainer


class PendingUpdate:
    """An update whose outcome (gradient norm, the ranks' norms, and with several ranks the summed
    statistics) is still on the device: ``status`` (double tensors) and ``summed`` (or None) travel
    to the host in one copy."""

    def __init__(self, status, summed, logging_outputs, sample_size, clip_norm, events=None, applied_anyway=False):
        self.n_status = sum(t.numel() for t in status)  # the values after them: summed statistics
        # the update was taken whatever the norm (ls_adam summed the norm in the update's own pass): a
        # non-finite norm found when settling did not keep it from the weights
        self.applied_anyway = applied_anyway
        status = torch.cat(status if summed is None else [*status, summed])
        self.logging_outputs = logging_outputs
        self.sample_size = sample_size
        self.clip_norm = clip_norm
        self.output = None  # the DeferredLoggingOutput handed to fairseq's loop
        self.events = events  # StepTimer's CUDA events, when timing
        self.event = None
        if status.device.type == "cuda":
            self.host = torch.empty(status.shape, dtype=status.dtype, pin_memory=True)
            self.host.copy_(status, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = status

    def values(self):
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


PENDING_WITHOUT_SCALE = 5


def pending_limit(scaler) -> int:
    """How many updates may be pending at once (module docstring): 1 with a dynamic loss scale, else
    PENDING_WITHOUT_SCALE."""
    return 1 if scaler is not None else PENDING_WITHOUT_SCALE


OVERFLOW_STREAK_LIMIT = 50  # consecutive fp16 overflows after which training stops (the loss scale cannot help)


def _inconsistent(norms) -> bool:
    """fairseq's cross-rank gradient-norm test (Trainer._check_grad_norms), on host numbers."""
    if not all(math.isfinite(n) for n in norms):
        return True
    ref = norms[0]
    return max(abs(n - ref) for n in norms) / (ref + 1e-6) >= 1e-6


def unwrap_optimizer(opt):
    """The trainer's optimizer without fairseq's memory-efficient fp16/bf16 wrapper (ls_adam, or
    whatever it wraps), and the wrapper's loss scaler (None for bf16 and without a wrapper)."""
    if isinstance(opt, MemoryEfficientFP16Optimizer):
        return opt.wrapped_optimizer, opt.scaler
    return opt, None


class PendingUpdates:
    """The updates of ``trainer`` still on the device, oldest first, and their settling (module docstring).

    ``stats`` logs a settled update's statistics; ``timer`` (a :class:`StepTimer` or None) takes the CUDA
    events of a timed update."""

    def __init__(self, trainer, stats, fp16: bool, timer=None):
        self.trainer = trainer
        self.stats = stats
        self.fp16 = bool(fp16)
        self.timer = timer
        self.queue = deque()
        self.overflows = 0  # consecutive fp16 overflows

    def add(self, pending: PendingUpdate) -> None:
        self.queue.append(pending)

    def __len__(self) -> int:
        return len(self.queue)

    def settle(self, keep: int = 0, in_step: bool = False) -> None:
        """Settle the pending updates, oldest first, until at most ``keep`` are left. ``in_step``: called from
        a later update's step (where the step timer measures the wait)."""
        while len(self.queue) > keep:
            self._settle_one(self.queue.popleft(), in_step)

    def settle_quietly(self) -> None:
        """:meth:`settle`, logging instead of raising what an overflow or a non-finite gradient raises (on the
        way out after another error)."""
        try:
            self.settle()
        except (OverflowError, FloatingPointError) as e:
            logger.warning("while settling the last update: %s", e)

    def _settle_one(self, pending, in_step):
        trainer = self.trainer
        timed = in_step and pending.events is not None
        t0 = time.perf_counter() if timed else 0.0
        values = pending.values()
        if pending.events is not None:
            # only the settle inside a later update's step tells how far ahead the host runs
            wait = (time.perf_counter() - t0) * 1e3 if timed else None
            pending.events[-1].synchronize()  # recorded after the Adam step that the read above waited for
            self.timer.settle(pending.events, wait)
        grad_norm, norms = values[0], values[1:pending.n_status]
        if isinstance(pending.logging_outputs, SummedLogs):
            pending.logging_outputs = pending.logging_outputs.read(values[pending.n_status:])
        ls_adam, scaler = unwrap_optimizer(trainer.optimizer)
        if not math.isfinite(grad_norm):
            self._overflow(pending, grad_norm, ls_adam, scaler)
            return
        if norms and _inconsistent(norms):
            detail = "\n".join("rank {:3d} = {:.8f}".format(r, n) for r, n in enumerate(norms))
            raise FloatingPointError(
                "Fatal error: gradients are inconsistent between workers. Try --ddp-backend=legacy_ddp. "
                "Or are you mixing up different generation of GPUs in training?\n" + "-" * 80
                + "\ngrad_norm across the workers:\n{}\n".format(detail) + "-" * 80)
        self.overflows = 0
        if scaler is not None:
            scaler.update()
        agg = self.stats.log(pending.logging_outputs, grad_norm, pending.clip_norm)
        if self.fp16:
            metrics.log_scalar("loss_scale", scaler.loss_scale, priority=700, round=4, weight=0)
        if pending.output is not None:
            pending.output.settle(agg, pending.sample_size)

    def _overflow(self, pending, grad_norm, ls_adam, scaler):
        """A non-finite gradient norm: fairseq's overflow handling with a loss scale, an error without one."""
        trainer = self.trainer
        report = zero_weight_report(trainer.model)
        taken = ("the weights in memory took this update and the ones queued after it; the checkpoints "
                 "written before are intact" if pending.applied_anyway else "the update was not applied")
        if report is not None:  # a cause no loss scale can fix, named
            raise FloatingPointError(f"gradients are Nan/Inf ({taken}): {report}")
        if scaler is None:
            raise FloatingPointError(f"gradients are Nan/Inf ({taken})")
        # fairseq: no update, the loss scale goes down, nothing is logged for this step
        ls_adam._optimizer.forget_last_step()
        trainer.set_num_updates(trainer.get_num_updates() - 1)
        self.overflows += 1
        if self.overflows >= OVERFLOW_STREAK_LIMIT:
            raise FloatingPointError(
                f"the gradients overflowed in fp16 on {self.overflows} consecutive updates (loss scale now "
                f"{scaler.loss_scale:g}): training diverged; lower --lr, add --clip-norm, or train with --bf16")
        try:
            scaler.check_overflow(grad_norm)
        except OverflowError as e:
            logger.info(f"NOTE: gradient overflow detected, ignoring gradient, {str(e)}")
        if pending.output is not None:
            pending.output.settle(None, None)
