"""The updates the deferred step leaves pending, and settling them.

The deferred step (:mod:`ls_fairseq.fairseq_ext.deferred_step`) queues update n and returns without
reading its outcome. :class:`_PendingStep` holds that outcome on its way to the host (one copy into
pinned memory); :meth:`PendingUpdateMixin._ls_resolve` reads it, during a later update or whenever
something needs the exact state, and does the host side of fairseq's step: on overflow the loss
scale goes down and the update is taken back, otherwise the update's statistics are logged.

How many updates may be pending (:func:`pending_limit`): with fp16's dynamic loss scale one, as an
overflow of update n changes the loss scale, the learning rate and the step count that update n + 1
uses, so update n is settled during update n + 1, before its optimizer step. Without a loss scale
(bf16, fp32) nothing an update's outcome decides reaches the next updates (a non-finite gradient
stops training), and PENDING_WITHOUT_SCALE (5) may be pending: update n is settled during update
n + 5, so the host runs up to five updates ahead of the GPU and host work longer than one update (a
CUDA-graph capture, tens of milliseconds; a slow batch) hides behind the GPU's queue. (Ten ahead
with captures spaced twice as far gained nothing at 4096 tokens and lost at 8192: a capture that
meets a GEMM kernel cuBLAS has not loaded yet waits for the whole queue, however deep.) Updates are
settled in order, so the logged statistics are the same either way.
:meth:`PendingUpdateMixin._count_is_read_after` tells which updates are settled at once because
fairseq's loop acts on the update count after them. :class:`PendingUpdateMixin` holds methods of
:class:`~ls_fairseq.fairseq_ext.trainer.LSTrainer`.
"""

import logging
import math
import time
from collections import deque

import torch
from fairseq import metrics
from fairseq.optim.fp16_optimizer import MemoryEfficientFP16Optimizer

from ls_fairseq.fairseq_ext.memory_modes import zero_weight_report
from ls_fairseq.fairseq_ext.step_stats import _SummedLogs

logger = logging.getLogger("fairseq.trainer")  # fairseq's own logger: the same lines as its Trainer


class _PendingStep:
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
        self.events = events  # _StepTimer's CUDA events, when timing
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


def _inner_and_scaler(opt):
    """The trainer's optimizer without fairseq's memory-efficient fp16/bf16 wrapper (ls_adam, or
    whatever it wraps), and the wrapper's loss scaler (None for bf16 and without a wrapper)."""
    if isinstance(opt, MemoryEfficientFP16Optimizer):
        return opt.wrapped_optimizer, opt.scaler
    return opt, None


class PendingUpdateMixin:
    """LSTrainer's pending update: when it is settled, and what settling it does."""

    def _count_is_read_after(self, num_updates) -> bool:
        """Whether fairseq's loop acts on the update count after this update (log, save, validate,
        stop, end of epoch): then the update is settled now."""
        knobs = self._knobs()
        if num_updates % knobs.log_interval == 0 or any(num_updates % e == 0 for e in knobs.every):
            return True
        if (knobs.max_update and num_updates >= knobs.max_update) or knobs.timed_stop:
            return True
        itr = self.__dict__.get("_ls_epoch_itr")
        try:
            return itr is not None and itr.end_of_epoch()
        except (AttributeError, NotImplementedError):  # no epoch started yet / an iterator that cannot tell
            return False

    # -------------------------------------------------------- settling
    def _ls_pend(self, pending):
        """Queue ``pending`` (the update just taken) for settling."""
        pendings = self.__dict__.get("_ls_pendings")
        if pendings is None:
            pendings = self._ls_pendings = deque()
        pendings.append(pending)

    def _ls_any_pending(self) -> bool:
        return bool(self.__dict__.get("_ls_pendings"))

    def _ls_resolve(self, in_step=False, keep=0):
        """Settle the pending updates, oldest first, until at most ``keep`` are left: read each one's outcome
        and do the host side of fairseq's step. ``in_step``: called from a later update's step (where the step
        timer measures the wait)."""
        pendings = self.__dict__.get("_ls_pendings")
        while pendings and len(pendings) > keep:
            self._ls_settle(pendings.popleft(), in_step)

    def _ls_settle(self, pending, in_step):
        timed = in_step and pending.events is not None
        t0 = time.perf_counter() if timed else 0.0
        values = pending.values()
        if pending.events is not None:
            # only the settle inside a later update's step tells how far ahead the host runs
            wait = (time.perf_counter() - t0) * 1e3 if timed else None
            pending.events[-1].synchronize()  # recorded after the Adam step that the read above waited for
            self._ls_timer.settle(pending.events, wait)
        grad_norm, norms = values[0], values[1:pending.n_status]
        if isinstance(pending.logging_outputs, _SummedLogs):
            pending.logging_outputs = pending.logging_outputs.read(values[pending.n_status:])
        ls_adam, scaler = _inner_and_scaler(self.optimizer)
        if not math.isfinite(grad_norm):
            report = zero_weight_report(self.model)
            taken = ("the weights in memory took this update and the ones queued after it; the checkpoints "
                     "written before are intact" if pending.applied_anyway else "the update was not applied")
            if report is not None:  # a cause no loss scale can fix, named
                raise FloatingPointError(f"gradients are Nan/Inf ({taken}): {report}")
            if scaler is None:
                raise FloatingPointError(f"gradients are Nan/Inf ({taken})")
            # fairseq: no update, the loss scale goes down, nothing is logged for this step
            ls_adam._optimizer.forget_last_step()
            self.set_num_updates(self.get_num_updates() - 1)
            streak = self._ls_overflows = self.__dict__.get("_ls_overflows", 0) + 1
            if streak >= OVERFLOW_STREAK_LIMIT:
                raise FloatingPointError(
                    f"the gradients overflowed in fp16 on {streak} consecutive updates (loss scale now "
                    f"{scaler.loss_scale:g}): training diverged; lower --lr, add --clip-norm, or train with --bf16")
            try:
                scaler.check_overflow(grad_norm)
            except OverflowError as e:
                logger.info(f"NOTE: gradient overflow detected, ignoring gradient, {str(e)}")
            if pending.output is not None:
                pending.output._settle(None, None)
            return
        if norms and _inconsistent(norms):
            detail = "\n".join("rank {:3d} = {:.8f}".format(r, n) for r, n in enumerate(norms))
            raise FloatingPointError(
                "Fatal error: gradients are inconsistent between workers. Try --ddp-backend=legacy_ddp. "
                "Or are you mixing up different generation of GPUs in training?\n" + "-" * 80
                + "\ngrad_norm across the workers:\n{}\n".format(detail) + "-" * 80)
        self._ls_overflows = 0
        if scaler is not None:
            scaler.update()
        agg = self._log_step_stats(pending.logging_outputs, grad_norm, pending.clip_norm)
        if self._knobs().fp16:
            metrics.log_scalar("loss_scale", scaler.loss_scale, priority=700, round=4, weight=0)
        if pending.output is not None:
            pending.output._settle(agg, pending.sample_size)

    def _ls_resolve_quietly(self):
        try:
            self._ls_resolve()
        except (OverflowError, FloatingPointError) as e:
            logger.warning("while settling the last update: %s", e)
