"""The deferred step: fairseq's training update for ls_adam, with no host read of a device value.

The step that LSTrainer runs for ls_adam (``--optimizer ls_adam``, alone or under fairseq's
memory-efficient fp16/bf16 wrapper) reads nothing back:

* the fp16 loss scale lives on the GPU. The backward multiplies the loss by it, the unscale
  factor, the clip coefficient and the overflow test are computed on the GPU and handed to the
  fused Adam kernel as one device factor, which skips the update when it is not finite;
* the outcome of update n (gradient norm, overflow, the ranks' norms) is copied to pinned
  host memory and read during update n + 1, after that update's forward and backward have been
  queued and before its Adam step is: by then the GPU has long finished it, so reading costs
  no idle time. Then the host does what fairseq does right away: on overflow it logs fairseq's
  "gradient overflow detected" line, lowers its loss scale, takes the update back from the
  update count (so the learning rate and Adam's bias correction of update n + 1 are exactly
  fairseq's) and logs no statistics for it; otherwise it logs the statistics of update n.
  The next loss scale is chosen on the GPU from the two values the host precomputes with
  fairseq's own DynamicLossScaler (after an overflow, after a clean step), so update n + 1's
  backward already uses the scale fairseq would use. Without a loss scale (bf16, fp32) no outcome
  can change the next update, and update n is read during update n + 5 instead: the host may
  run five updates ahead (:func:`~ls_fairseq.fairseq_ext.pending_update.pending_limit`);
* the update is resolved at once (one wait) whenever something reads the exact count: updates
  that end a --log-interval, --save-interval-updates, --validate-interval-updates or
  --max-update, the last update of an epoch, and before checkpoints, validation and
  learning-rate steps. Between two updates, ``get_num_updates()`` may count the previous
  update before it is known whether it overflowed (fp16 overflows are rare after the first
  steps); nothing that fairseq's loop decides is based on that provisional count. One visible
  consequence: fairseq seeds each step's random numbers (dropout) with ``--seed`` plus the
  update count, and a step that follows an overflow is seeded with that provisional count, so
  after an overflow the dropout masks differ from fairseq's Trainer (the updates are otherwise
  computed the same way; with dropout 0 the two give identical weights). Another: when the
  update right after a --save-interval-updates point overflows, fairseq's loop sees the same count
  again and writes that checkpoint a second time (lowered loss scale, one more batch consumed);
  here the first one stays;
* multi-GPU: the logging statistics and the sample size are summed across ranks in one
  collective on the GPU (host numbers travel through pinned memory). The sums come back to the
  host with the update's outcome, so fairseq's meters get host numbers when the update is
  resolved (with device tensors as weights they would wait for the GPU), and the cross-rank
  gradient-norm check is evaluated then too;
* multi-GPU, sharded (``LS_FAIRSEQ_SHARD_ADAM``): ls_adam keeps its state sharded over the ranks
  (:mod:`ls_fairseq.optim.adam`): the gradients are reduce-scattered during the backward, each
  rank runs Adam on its own part and the weights are all-gathered (on two GPUs the Adam kernel stores
  them into both GPUs' copies instead, :mod:`ls_fairseq.optim.peer`). The gradient norm is then one
  all-reduced number, the same on every rank by construction, so fairseq's cross-rank norm check
  is not needed. Checkpoints still hold the whole state. The new weights' all-gathers overlap the
  next forward pass, which waits for each layer's weights in a forward pre-hook; every access to
  the model from outside the train step (validation, checkpoints, ``get_model()``) first waits
  for all of them. ``LS_FAIRSEQ_SHARD_ADAM=p2p``, the default, shards only where the ranks write each
  other's weights (two GPUs of one host) and keeps the whole state elsewhere; ``=0`` keeps the whole
  state everywhere. With peer writes the sharded step was faster than the whole state in seven of ten
  same-machine pairs on two H200s of one host, by 8% at the median (benchmarks/RESULTS.md).

The update's outcome is settled later (:mod:`ls_fairseq.fairseq_ext.pending_update`); the
statistics summed across ranks are :mod:`ls_fairseq.fairseq_ext.step_stats`'s. With the CUDA-graph
step (:mod:`ls_fairseq.fairseq_ext.graph_step`) each micro-batch's forward and backward are graph
replays; the rest of the update is the same, except that on several GPUs the gradients are
all-reduced after the last backward, whole, and the optimizer state is not sharded.
:class:`DeferredStepMixin` holds methods of :class:`~ls_fairseq.fairseq_ext.trainer.LSTrainer`.
"""

import contextlib
import copy
import logging
import os
from types import SimpleNamespace

import torch
from fairseq import metrics, utils
from fairseq.distributed import utils as distributed_utils

from ls_fairseq.fairseq_ext.memory_modes import invertible_layer_norms
from ls_fairseq.fairseq_ext.pending_update import _inner_and_scaler, _PendingStep, pending_limit
from ls_fairseq.fairseq_ext.step_stats import DeferredLoggingOutput
from ls_fairseq.fairseq_ext.step_timing import _StepTimer
from ls_fairseq import env

logger = logging.getLogger("fairseq.trainer")  # fairseq's own logger: the same lines as its Trainer


def _label(name: str):
    """fairseq's ``record_function`` label for a part of the step, while a profiler records (the
    label costs tens of microseconds of host time per use when none does)."""
    return torch.autograd.profiler.record_function(name) if torch.autograd._profiler_enabled() \
        else contextlib.nullcontext()


class _ScaledLossOptimizer:
    """The optimizer as the task sees it in a deferred step: ``backward`` multiplies the loss by the
    loss scale held on the device (fairseq's wrapper multiplies by its host copy)."""

    def __init__(self, optimizer, scale, timer=None):
        self._optimizer = optimizer
        self._scale = scale
        self._timer = timer  # LS_FAIRSEQ_STEP_TIMING: the host time of forward and backward apart

    def backward(self, loss):
        self.backward_by(lambda scale: (loss if scale is None else loss * scale).backward())

    def backward_by(self, run):
        """``run(scale)`` with the device loss scale (None: no scaling), between the host marks of the
        forward and the backward: :meth:`backward`, and a backward computed without autograd (the
        CUDA-graph step's head)."""
        if self._timer is not None:
            self._timer.host_mark("forward")
        out = run(self._scale)
        if self._timer is not None:
            self._timer.host_mark("backward")
        return out

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


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


def _on_device(x, dtype, device):
    """``x`` (a Python number or a tensor) as a 0-dim tensor on ``device``. A Python number is
    written by a fill kernel: ``torch.as_tensor(number, device=cuda)`` would copy it from pageable
    host memory, which waits for the GPU."""
    if torch.is_tensor(x):
        return x.to(device=device, dtype=dtype).reshape(())
    return torch.full((), x, dtype=dtype, device=device)


class DeferredStepMixin:
    """LSTrainer's deferred train step and the state it keeps between updates."""

    def _deferred_train_step(self, samples, raise_oom=False):
        """fairseq's Trainer.train_step for ls_adam, with every host read deferred (module docstring)."""
        self._set_seed()
        self.model.train()
        self.criterion.train()
        opt = self.optimizer
        ls_adam, scaler = _inner_and_scaler(opt)
        graphs = self._graph_step()
        if graphs is not None:
            graphs.begin_update(ls_adam, len(samples))  # the graphs write the flat gradient buffers
        else:
            self.zero_grad()
        metrics.log_start_time("train_wall", priority=800, round=0)

        scale = self._device_loss_scale(scaler)
        knobs = self._knobs()
        world = self.data_parallel_world_size
        timer = self._step_timer()
        task_opt = _ScaledLossOptimizer(opt, scale, timer)
        if timer is not None:
            timer.host_start()
        events = []
        logging_outputs, sample_size, ooms = [], 0, 0
        is_dummy_batch = False
        for i, sample in enumerate(samples):  # delayed update loop
            no_sync = world > 1 and hasattr(self.model, "no_sync") and i < len(samples) - 1
            try:
                if timer is not None:
                    events.append(timer.mark())
                graphed = None if graphs is None else graphs.micro_batch(sample, task_opt, self.get_num_updates())
                if graphed is not None:  # forward and backward replayed from CUDA graphs
                    _, sample_size_i, logging_output = graphed
                    is_dummy_batch = False
                else:
                    sample, is_dummy_batch = self._prepare_sample(sample)
                    with self.model.no_sync() if no_sync else contextlib.nullcontext():
                        loss, sample_size_i, logging_output = self.task.train_step(
                            sample=sample, model=self.model, criterion=self.criterion, optimizer=task_opt,
                            update_num=self.get_num_updates(), ignore_grad=is_dummy_batch,
                        )
                        del loss
                if timer is not None:
                    events.append(timer.mark())
                logging_outputs.append(logging_output)
                sample_size += sample_size_i
                if self.cuda and self.get_num_updates() == 0:
                    torch.cuda.empty_cache()
            except RuntimeError as e:
                if "out of memory" not in str(e):
                    raise
                self._log_oom(e)
                if raise_oom:
                    raise
                logger.warning("attempting to recover from OOM in forward/backward pass")
                ooms += 1
                self.zero_grad()
                if self.cuda:
                    torch.cuda.empty_cache()
                if self.cfg.distributed_training.distributed_world_size == 1:
                    return None
            except Exception:
                self._ls_resolve_quietly()
                self._save_crash_checkpoint(ls_adam)
                raise

        if graphs is not None:
            graphs.end_micro_batches()
        if timer is not None:
            timer.host_mark("the rest of the micro-batches")
        if is_dummy_batch:
            sample_size = sample_size.zero_() if torch.is_tensor(sample_size) else sample_size * 0.0
        sample_size = sample_size.float() if torch.is_tensor(sample_size) else float(sample_size)

        sync_stats = self._sync_stats()
        summed = None
        if sync_stats:
            train_time = self._local_cumulative_training_time()
            (sample_size, ooms, total_train_time), summed, logging_outputs = self._sum_stats_on_device(
                logging_outputs, sample_size, ooms, train_time, ignore=is_dummy_batch)
            self._cumulative_training_time = total_train_time / world

        if timer is not None:
            timer.host_mark("statistics")
        with _label("reduce-grads"):
            opt.all_reduce_grads(self.model)
            if utils.has_parameters(self.criterion):
                opt.all_reduce_grads(self.criterion)

        if timer is not None:
            timer.host_mark("gradient reduction")
        # the update before (with a loss scale) or the fifth before (without): settle it before this one uses
        # the learning rate, the step count and the loss scale that depend on it (pending_update.pending_limit)
        self._ls_resolve(in_step=True, keep=pending_limit(scaler) - 1)
        if timer is not None:
            timer.host_mark("settle an earlier update")

        # without a loss scale and without clipping the norm only reports (and names a non-finite gradient):
        # ls_adam sums it in its update's pass instead of reading the gradients once more before it. Not with
        # invertible layer norms, whose zero weights (a cause named when the norm is not finite) the update
        # would overwrite
        norm_in_step = (scale is None and knobs.clip <= 0 and not ls_adam.sharded
                        and not self._has_invertible_layer_norms())
        with _label("clip-grads"):
            numer = world if sync_stats else 1
            if torch.is_tensor(sample_size):
                factor = numer / torch.where(sample_size == 0, torch.ones_like(sample_size), sample_size)
            else:
                factor = numer / (sample_size or 1.0)
            clip = knobs.clip
            if norm_in_step:
                factor = self._unscaled_factor(factor, sample_size, self.device)
            else:
                raw = ls_adam._optimizer.grad_norm()  # norm of the gradients as they are (loss-scaled)
                factor, grad_norm, finite = self._factor_and_norm(raw, factor, scale, clip, sample_size)
                factor = torch.where(finite, factor, torch.full_like(factor, float("nan")))
                status = self._norm_status(grad_norm, ls_adam)

        if timer is not None:
            timer.host_mark("norm and factor")
        with _label("optimizer"):
            ls_adam._optimizer._grad_factor = factor  # read by the kernel; not finite: no update
            if norm_in_step:
                raw = ls_adam.step(with_norm=True)
                grad_norm = raw.to(factor.device) * factor
                status = self._norm_status(grad_norm, ls_adam)
            else:
                ls_adam.step()
            if scale is not None:
                ok_scale, bad_scale = scale_candidates(scaler)
                scale.copy_(torch.where(finite, torch.full_like(scale, ok_scale), torch.full_like(scale, bad_scale)))

        if timer is not None:
            events.append(timer.mark())
            timer.host_mark("optimizer step")
        complete = timer is not None and len(events) == 2 * len(samples) + 1  # no micro-batch lost to OOM
        pending = _PendingStep(status, summed, logging_outputs, sample_size, clip, events if complete else None,
                               applied_anyway=norm_in_step)
        self._ls_pend(pending)
        num_updates = self.get_num_updates() + 1
        self.set_num_updates(num_updates)  # provisional until settled

        if self.cuda and self.cuda_env is not None:
            # torch.cuda.max_memory_allocated() without flattening all allocator statistics
            peak = torch.cuda.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["peak"]
            torch.cuda.reset_peak_memory_stats()
            metrics.log_scalar("gb_free", self.cuda_env.total_memory_in_GB - peak / 1024 ** 3, priority=1500,
                               round=1, weight=0)
        freq = knobs.empty_cache_freq
        if self.cuda and freq > 0 and (num_updates + freq - 1) % freq == 0:
            torch.cuda.empty_cache()

        out = DeferredLoggingOutput(resolve=self._ls_resolve)
        pending.output = out
        if self._count_is_read_after(num_updates):
            self._ls_resolve()
            graphs = self.__dict__.get("_ls_graphs")
            if graphs is not None:
                graphs.queue_drained()
        metrics.log_stop_time("train_wall")
        if timer is not None:
            timer.host_end()
        return out

    def _save_crash_checkpoint(self, ls_adam):
        """fairseq's crash.pt after an exception in the forward or backward. Only this rank may have
        failed, so nothing collective runs here: with sharded optimizer state the checkpoint holds
        the model without the optimizer state (a run resumed from it starts Adam afresh)."""
        path = os.path.join(self.cfg.checkpoint.save_dir, "crash.pt")
        self._ls_in_step = False  # the checkpoint reads the weights: wait for them
        if not ls_adam.sharded:
            self.consolidate_optimizer()
            self.save_checkpoint(path, {})
            return
        logger.warning("saving %s without the optimizer state: it is sharded across the ranks and gathering it "
                       "needs every rank", path)
        ckpt = self.cfg.checkpoint
        kept = ckpt.no_save_optimizer_state
        try:
            ckpt.no_save_optimizer_state = True
            self.save_checkpoint(path, {})
        finally:
            ckpt.no_save_optimizer_state = kept

    def _step_timer(self):
        if "_ls_timer" not in self.__dict__:
            on = self.cuda and env.step_timing()
            self._ls_timer = _StepTimer(self.data_parallel_rank) if on else None
        return self._ls_timer

    def _has_invertible_layer_norms(self) -> bool:
        if "_ls_invertible" not in self.__dict__:
            self._ls_invertible = bool(invertible_layer_norms(self.model))
        return self._ls_invertible

    @staticmethod
    def _unscaled_factor(factor, sample_size, device):
        """The 1 / sample size ``factor`` on ``device`` without a loss scale: fairseq's step multiplies by a Python
        float (fp32 arithmetic with the fp32 norm), or, with statistics summed across ranks, by a double tensor
        (double arithmetic)."""
        dtype = torch.float64 if torch.is_tensor(sample_size) else torch.float32
        return _on_device(factor, dtype, device)

    @staticmethod
    def _factor_and_norm(raw, factor, scale, clip, sample_size):
        """(the update's gradient factor, the gradient norm fairseq logs, whether it is finite), on the device, from
        the raw norm of the (loss-scaled) gradients and the host's or device's 1 / sample size ``factor``."""
        if scale is not None:
            # fairseq's fp16 wrapper keeps its factor in double precision (a Python float), and
            # clips by clip / norm above the threshold; the same arithmetic here, on the device
            factor = _on_device(factor, torch.float64, raw.device) / scale
            grad_norm = raw * factor.float()
            if clip > 0:
                gn = grad_norm.double()
                factor = factor * torch.where(gn > clip, clip / gn, torch.ones_like(gn))
        else:  # bf16 wrapper and bare ls_adam: torch's clip_grad_norm_ coefficient
            factor = DeferredStepMixin._unscaled_factor(factor, sample_size, raw.device)
            grad_norm = raw * factor
            if clip > 0:
                factor = factor * (clip / (grad_norm + 1e-6)).clamp(max=1)
        return factor, grad_norm, torch.isfinite(grad_norm)

    def _norm_status(self, grad_norm, ls_adam):
        """The device values the host reads when it settles the update: the norm, and on several ranks each
        rank's norm (fairseq's cross-rank check; a sharded norm is the same on every rank)."""
        status = [grad_norm.double().reshape(1)]
        if self._grad_norm_buf is not None and not ls_adam.sharded:
            buf = self._grad_norm_buf
            buf.zero_()
            buf[self.data_parallel_rank] = grad_norm
            distributed_utils.all_reduce(buf, group=self.data_parallel_process_group)
            status.append(buf)  # copied by _PendingStep before the next update reuses it
        return status

    def _device_loss_scale(self, scaler):
        """The fp16 loss scale as a one-element fp32 tensor on the device (None without a scaler).
        With nothing pending the host scaler is exact and the device copy is refreshed from it."""
        if scaler is None:
            return None
        t = self.__dict__.get("_ls_scale")
        if t is None or t.device != self.device:
            t = self._ls_scale = torch.empty((), dtype=torch.float32, device=self.device)
            t.fill_(float(scaler.loss_scale))
        elif not self._ls_any_pending():
            t.fill_(float(scaler.loss_scale))
        return t

    def _knobs(self):
        """The configuration values the deferred step reads every update, read once (attribute
        access on fairseq's omegaconf config costs microseconds each)."""
        knobs = self.__dict__.get("_ls_knobs")
        if knobs is None:
            cfg = self.cfg
            knobs = self._ls_knobs = SimpleNamespace(
                clip=float(cfg.optimization.clip_norm),
                empty_cache_freq=int(cfg.common.empty_cache_freq),
                log_interval=max(1, int(cfg.common.log_interval)),
                every=[int(e) for e in (cfg.checkpoint.save_interval_updates, cfg.dataset.validate_interval_updates)
                       if e and e > 0],
                max_update=int(cfg.optimization.max_update or 0),
                timed_stop=cfg.optimization.stop_time_hours > 0,
                fp16=bool(cfg.common.fp16),
                bf16=bool(cfg.common.bf16),
            )
        return knobs
