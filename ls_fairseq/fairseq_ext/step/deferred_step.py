"""The deferred step: fairseq's training update for ls_adam, with no host read of a device value.

The fp16 loss scale, the clip coefficient and the overflow test stay on the GPU and reach the fused Adam
kernel as one device factor (not finite: the kernel skips the update). The outcome of update n (gradient
norm, overflow, the ranks' norms, the summed statistics) is copied to pinned memory and read during a
later update (:mod:`~ls_fairseq.fairseq_ext.step.pending_update`), when the GPU has long finished it;
then the host does what fairseq does at once (log, lower the loss scale, take an overflowed update back).
Whatever reads the exact update count settles first. With the CUDA-graph engine
(:mod:`ls_fairseq.fairseq_ext.graph`) each micro-batch's forward and backward are graph replays; the rest
of the update is the same. docs/step.md says how this differs from fairseq's step, and why.
"""

import contextlib
import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch
from fairseq import metrics, utils
from fairseq.distributed import utils as distributed_utils

from ls_fairseq.fairseq_ext.memory_modes import invertible_layer_norms
from ls_fairseq.fairseq_ext.step.pending_update import PendingUpdate, pending_limit, unwrap_optimizer
from ls_fairseq.fairseq_ext.step.step_stats import DeferredLoggingOutput

logger = logging.getLogger("fairseq.trainer")  # fairseq's own logger: the same lines as its Trainer


def _label(name: str):
    """fairseq's ``record_function`` label for a part of the step, only while a profiler records."""
    return torch.autograd.profiler.record_function(name) if torch.autograd._profiler_enabled() \
        else contextlib.nullcontext()


def scale_candidates(scaler):
    """(loss scale after a clean update, loss scale after an overflow), by running fairseq's own
    DynamicLossScaler logic on two copies of ``scaler``."""
    ok = copy.copy(scaler)
    ok.update()
    bad = copy.copy(scaler)
    try:
        bad.check_overflow(float("inf"))
    except (OverflowError, FloatingPointError):
        pass  # FloatingPointError (minimum scale reached) is raised again when the real scaler sees it
    return float(ok.loss_scale), float(bad.loss_scale)


def on_device(x, dtype, device):
    """``x`` (a Python number or a tensor) as a 0-dim tensor on ``device``; a number is written by a fill
    kernel (``torch.as_tensor`` would copy it from pageable memory, which waits for the GPU)."""
    if torch.is_tensor(x):
        return x.to(device=device, dtype=dtype).reshape(())
    return torch.full((), x, dtype=dtype, device=device)


class ScaledLossOptimizer:
    """The optimizer as the task sees it in a deferred step: ``backward`` multiplies the loss by the
    loss scale held on the device (fairseq's wrapper multiplies by its host copy)."""

    def __init__(self, optimizer, scale, timer=None):
        self._optimizer = optimizer
        self._scale = scale
        self._timer = timer

    def backward(self, loss):
        self.backward_by(lambda scale: (loss if scale is None else loss * scale).backward())

    def backward_by(self, run):
        """``run(scale)`` with the device loss scale (None: no scaling), between the timer's marks of the forward
        and the backward (also for a backward computed without autograd: the CUDA-graph step's head)."""
        if self._timer is not None:
            self._timer.host_mark("forward")
        out = run(self._scale)
        if self._timer is not None:
            self._timer.host_mark("backward")
        return out

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


@dataclass
class MicroBatches:
    """What an update's micro-batches produced."""
    logging_outputs: List[Any] = field(default_factory=list)
    sample_size: Any = 0
    ooms: int = 0
    dummy: bool = False
    events: List[Any] = field(default_factory=list)  # the timer's CUDA events
    summed_ranks: bool = False  # the statistics summed across ranks on the device


class DeferredStep:
    """One update of ``trainer`` with ls_adam (``optimizer``, fairseq's optimizer object) and no host read.

    ``pending`` settles the updates left on the GPU, ``stats`` sums and logs their statistics, ``graphs``
    (a :class:`~ls_fairseq.fairseq_ext.graph.graph_step.GraphStep` or None) replays micro-batches from CUDA
    graphs, ``timer`` (a :class:`~ls_fairseq.fairseq_ext.step.step_timing.StepTimer` or None) times them."""

    def __init__(self, trainer, optimizer, settings, pending, stats, graphs=None, timer=None):
        self.trainer = trainer
        self.optimizer = optimizer
        self.ls_adam, self.scaler = unwrap_optimizer(optimizer)
        self.settings = settings
        self.pending = pending
        self.stats = stats
        self.graphs = graphs
        self.timer = timer
        self.loss_scale = None  # the fp16 loss scale on the device (device_loss_scale)
        # without a loss scale and without clipping the norm only reports (and names a non-finite gradient):
        # ls_adam sums it in its update's pass instead of reading the gradients once more before it. Not with
        # invertible layer norms, whose zero weights (a cause named when the norm is not finite) the update
        # would overwrite, nor with sharded state (ls_adam decides it when it reduces the gradients):
        # _factor_and_norm decides per update
        self.norm_reports_only = (self.scaler is None and settings.clip <= 0
                                  and not invertible_layer_norms(trainer.model))
        self.norm_in_step = False  # this update's choice

    # ------------------------------------------------------------------ the update
    def run(self, samples, raise_oom=False):
        """fairseq's Trainer.train_step for ls_adam, with every host read deferred (module docstring)."""
        scale = self._begin(len(samples))
        done = self._micro_batches(samples, scale, raise_oom)
        if done is None:
            return None  # out of memory on one GPU: fairseq skips the update
        self._mark("the rest of the micro-batches")
        sample_size, summed = self._sum_stats(done)
        self._mark("statistics")
        self._reduce_grads()
        self._mark("gradient reduction")
        # the update before (with a loss scale) or the fifth before (without): settled before this one uses the
        # learning rate, the step count and the loss scale that depend on it
        self.pending.settle(keep=pending_limit(self.scaler) - 1, in_step=True)
        self._mark("settle an earlier update")
        factor, status, finite = self._factor_and_norm(sample_size, scale, done.summed_ranks)
        self._mark("norm and factor")
        status = self._optimizer_step(factor, status, finite, scale)
        out = self._queue(done, status, summed, sample_size)
        self._after_update()
        return out

    # ------------------------------------------------------------------ its phases
    def _begin(self, micro_batches: int):
        """fairseq's per-update seed and training mode; the gradients zeroed (or handed to the graphs); the
        device loss scale."""
        trainer = self.trainer
        trainer._set_seed()
        trainer.model.train()
        trainer.criterion.train()
        if self.graphs is not None:
            self.graphs.begin_update(self.ls_adam, micro_batches)  # the graphs write the flat gradient buffers
        else:
            trainer.zero_grad()
        metrics.log_start_time("train_wall", priority=800, round=0)
        if self.timer is not None:
            self.timer.host_start()
        return self.device_loss_scale()

    def _micro_batches(self, samples, scale, raise_oom) -> Optional[MicroBatches]:
        """Forward and backward of every micro-batch (fairseq's delayed-update loop), graphed where it can be."""
        trainer, timer = self.trainer, self.timer
        task_opt = ScaledLossOptimizer(self.optimizer, scale, timer)
        world = trainer.data_parallel_world_size
        done = MicroBatches()
        for i, sample in enumerate(samples):
            try:
                if timer is not None:
                    done.events.append(timer.mark())
                log, size, done.dummy = self._one_micro_batch(sample, task_opt, i < len(samples) - 1 and world > 1)
                if timer is not None:
                    done.events.append(timer.mark())
                done.logging_outputs.append(log)
                done.sample_size += size
                if trainer.cuda and trainer.get_num_updates() == 0:
                    torch.cuda.empty_cache()
            except RuntimeError as e:
                if "out of memory" not in str(e):
                    raise
                if not self._recover_from_oom(e, raise_oom):
                    return None
                done.ooms += 1
            except Exception:
                self.pending.settle_quietly()
                self._save_crash_checkpoint()
                raise
        if self.graphs is not None:
            self.graphs.end_micro_batches()
        return done

    def _one_micro_batch(self, sample, task_opt, no_sync: bool):
        """(logging output, sample size, dummy batch?) of one micro-batch: replayed, or the task's train step."""
        trainer = self.trainer
        if self.graphs is not None:
            graphed = self.graphs.micro_batch(sample, task_opt, trainer.get_num_updates())
            if graphed is not None:  # forward and backward replayed from CUDA graphs
                _, size, log = graphed
                return log, size, False
        sample, dummy = trainer._prepare_sample(sample)
        model = trainer.model
        with model.no_sync() if no_sync and hasattr(model, "no_sync") else contextlib.nullcontext():
            loss, size, log = trainer.task.train_step(
                sample=sample, model=model, criterion=trainer.criterion, optimizer=task_opt,
                update_num=trainer.get_num_updates(), ignore_grad=dummy)
            del loss
        return log, size, dummy

    def _recover_from_oom(self, error, raise_oom) -> bool:
        """fairseq's recovery from an out-of-memory micro-batch; False: skip the update (one GPU)."""
        trainer = self.trainer
        trainer._log_oom(error)
        if raise_oom:
            raise error
        logger.warning("attempting to recover from OOM in forward/backward pass")
        trainer.zero_grad()
        if trainer.cuda:
            torch.cuda.empty_cache()
        return trainer.cfg.distributed_training.distributed_world_size != 1

    def _sum_stats(self, done: MicroBatches):
        """The update's sample size (a float, or a device tensor summed across ranks) and, with several ranks,
        the statistics summed on the device (read when the update is settled)."""
        trainer = self.trainer
        sample_size = done.sample_size
        if done.dummy:
            sample_size = sample_size.zero_() if torch.is_tensor(sample_size) else sample_size * 0.0
        sample_size = sample_size.float() if torch.is_tensor(sample_size) else float(sample_size)
        done.summed_ranks = trainer._sync_stats()
        if not done.summed_ranks:
            return sample_size, None
        train_time = trainer._local_cumulative_training_time()
        (sample_size, ooms, total_time), summed, done.logging_outputs = self.stats.sum_on_device(
            done.logging_outputs, sample_size, done.ooms, train_time, ignore=done.dummy)
        trainer._cumulative_training_time = total_time / trainer.data_parallel_world_size
        return sample_size, summed

    def _reduce_grads(self) -> None:
        trainer = self.trainer
        with _label("reduce-grads"):
            self.optimizer.all_reduce_grads(trainer.model)
            if utils.has_parameters(trainer.criterion):
                self.optimizer.all_reduce_grads(trainer.criterion)

    def _factor_and_norm(self, sample_size, scale, summed_ranks: bool):
        """(the gradient factor ls_adam's kernel applies, the status the host reads later or None, finite flag
        or None). With :attr:`norm_in_step` the norm comes from the update's own pass instead."""
        device = self.trainer.device
        self.norm_in_step = self.norm_reports_only and not self.ls_adam.sharded
        with _label("clip-grads"):
            numer = self.trainer.data_parallel_world_size if summed_ranks else 1
            if torch.is_tensor(sample_size):
                factor = numer / torch.where(sample_size == 0, torch.ones_like(sample_size), sample_size)
            else:
                factor = numer / (sample_size or 1.0)
            if self.norm_in_step:
                return unscaled_factor(factor, sample_size, device), None, None
            raw = self.ls_adam._optimizer.grad_norm()  # norm of the gradients as they are (loss-scaled)
            factor, grad_norm, finite = factor_and_norm(raw, factor, scale, self.settings.clip, sample_size)
            factor = torch.where(finite, factor, torch.full_like(factor, float("nan")))
            return factor, self._norm_status(grad_norm), finite

    def _optimizer_step(self, factor, status, finite, scale):
        """ls_adam's fused update with ``factor`` (not finite: no update) and the next loss scale, chosen on the
        device. Returns the status the host reads when it settles the update."""
        with _label("optimizer"):
            self.ls_adam._optimizer._grad_factor = factor  # read by the kernel; not finite: no update
            if self.norm_in_step:
                raw = self.ls_adam.step(with_norm=True)
                status = self._norm_status(raw.to(factor.device) * factor)
            else:
                self.ls_adam.step()
            if scale is not None:
                ok_scale, bad_scale = scale_candidates(self.scaler)
                scale.copy_(torch.where(finite, torch.full_like(scale, ok_scale), torch.full_like(scale, bad_scale)))
        return status

    def _queue(self, done: MicroBatches, status, summed, sample_size):
        """The update queued for settling; the update count raised (provisional until settled). Returns the
        logging output handed to fairseq's loop."""
        trainer, timer = self.trainer, self.timer
        if timer is not None:
            done.events.append(timer.mark())
            timer.host_mark("optimizer step")
        complete = timer is not None and done.ooms == 0  # no micro-batch lost to OOM
        pending = PendingUpdate(status, summed, done.logging_outputs, sample_size, self.settings.clip,
                                done.events if complete else None, applied_anyway=self.norm_in_step)
        pending.output = DeferredLoggingOutput(resolve=self.pending.settle)
        self.pending.add(pending)
        trainer.set_num_updates(trainer.get_num_updates() + 1)
        return pending.output

    def _after_update(self) -> None:
        """fairseq's memory metric and cache emptying; the update settled at once when fairseq's loop reads
        the count after it."""
        trainer = self.trainer
        num_updates = trainer.get_num_updates()
        if trainer.cuda and trainer.cuda_env is not None:
            # torch.cuda.max_memory_allocated() without flattening all allocator statistics
            peak = torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["peak"]
            torch.cuda.reset_peak_memory_stats()
            metrics.log_scalar("gb_free", trainer.cuda_env.total_memory_in_GB - peak / 1024 ** 3, priority=1500,
                               round=1, weight=0)
        freq = self.settings.empty_cache_freq
        if trainer.cuda and freq > 0 and (num_updates + freq - 1) % freq == 0:
            torch.cuda.empty_cache()
        if trainer.count_is_read_after(num_updates):
            self.pending.settle()
            if self.graphs is not None:
                self.graphs.queue_drained()
        metrics.log_stop_time("train_wall")
        if self.timer is not None:
            self.timer.host_end()

    # ------------------------------------------------------------------ helpers
    def _mark(self, name: str) -> None:
        if self.timer is not None:
            self.timer.host_mark(name)

    def device_loss_scale(self):
        """The fp16 loss scale as a one-element fp32 tensor on the device (None without a scaler). With nothing
        pending the host scaler is exact and the device copy is refreshed from it."""
        if self.scaler is None:
            return None
        device = self.trainer.device
        if self.loss_scale is None or self.loss_scale.device != device:
            self.loss_scale = torch.empty((), dtype=torch.float32, device=device)
            self.loss_scale.fill_(float(self.scaler.loss_scale))
        elif not len(self.pending):
            self.loss_scale.fill_(float(self.scaler.loss_scale))
        return self.loss_scale

    def forget_loss_scale(self) -> None:
        """The host loss scale was restored (a checkpoint): the device copy is made afresh from it."""
        self.loss_scale = None

    def _norm_status(self, grad_norm):
        """The device values the host reads when it settles the update: the norm, and on several ranks each
        rank's norm (fairseq's cross-rank check; a sharded norm is the same on every rank)."""
        trainer = self.trainer
        status = [grad_norm.double().reshape(1)]
        if trainer._grad_norm_buf is not None and not self.ls_adam.sharded:
            buf = trainer._grad_norm_buf
            buf.zero_()
            buf[trainer.data_parallel_rank] = grad_norm
            distributed_utils.all_reduce(buf, group=trainer.data_parallel_process_group)
            status.append(buf)  # copied by PendingUpdate before the next update reuses it
        return status

    def _save_crash_checkpoint(self):
        """fairseq's crash.pt after an exception in the forward or backward. Only this rank may have failed, so
        nothing collective runs here: with sharded optimizer state the checkpoint holds the model without it (a
        run resumed from it starts Adam afresh)."""
        trainer = self.trainer
        path = os.path.join(trainer.cfg.checkpoint.save_dir, "crash.pt")
        trainer.in_step = False  # the checkpoint reads the weights: wait for them
        if not self.ls_adam.sharded:
            trainer.consolidate_optimizer()
            trainer.save_checkpoint(path, {})
            return
        logger.warning("saving %s without the optimizer state: it is sharded across the ranks and gathering it "
                       "needs every rank", path)
        ckpt = trainer.cfg.checkpoint
        kept = ckpt.no_save_optimizer_state
        try:
            ckpt.no_save_optimizer_state = True
            trainer.save_checkpoint(path, {})
        finally:
            ckpt.no_save_optimizer_state = kept


def unscaled_factor(factor, sample_size, device):
    """The 1 / sample size ``factor`` on ``device`` without a loss scale: fairseq's step multiplies by a Python
    float (fp32 arithmetic with the fp32 norm), or, with statistics summed across ranks, by a double tensor."""
    dtype = torch.float64 if torch.is_tensor(sample_size) else torch.float32
    return on_device(factor, dtype, device)


def factor_and_norm(raw, factor, scale, clip, sample_size):
    """(the update's gradient factor, the gradient norm fairseq logs, whether it is finite), on the device, from
    the raw norm of the (loss-scaled) gradients and the host's or device's 1 / sample size ``factor``."""
    if scale is not None:
        # fairseq's fp16 wrapper keeps its factor in double precision (a Python float), and clips by
        # clip / norm above the threshold; the same arithmetic here, on the device
        factor = on_device(factor, torch.float64, raw.device) / scale
        grad_norm = raw * factor.float()
        if clip > 0:
            gn = grad_norm.double()
            factor = factor * torch.where(gn > clip, clip / gn, torch.ones_like(gn))
    else:  # bf16 wrapper and bare ls_adam: torch's clip_grad_norm_ coefficient
        factor = unscaled_factor(factor, sample_size, raw.device)
        grad_norm = raw * factor
        if clip > 0:
            factor = factor * (clip / (grad_norm + 1e-6)).clamp(max=1)
    return factor, grad_norm, torch.isfinite(grad_norm)
