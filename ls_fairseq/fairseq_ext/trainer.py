"""LSTrainer: fairseq's Trainer without the per-step host stalls that do not change training.

lightseq-train runs fairseq's own training loop with this subclass in place of
``fairseq.trainer.Trainer``. Every update is computed as fairseq computes it; what changes is
when the host waits for the GPU. fairseq's step reads GPU values on the host several times
(the gradient norm for the fp16 loss scaler and the overflow test, the summed sample size in
multi-GPU runs, the cross-rank gradient-norm check); each read drains the GPU queue, and the
GPU then idles while Python prepares the next batch and launches its first kernels.

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
  backward already uses the scale fairseq would use;
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

Other host stalls removed for every optimizer:

* batches are copied to the GPU from pinned memory. fairseq's ``move_to_cuda`` asks for a
  non-blocking copy, but from ordinary (pageable) memory the CUDA driver first waits for the
  whole stream to drain;
* the per-step statistics stay on the GPU until something reads them (``--log-interval``);
* the model is not walked module by module to set training mode on every step while the roots
  stay in training mode (anything that switches the model to evaluation through its root,
  validation or generation, makes the next step walk again);
* with an ls_transformer, the target positions ls_label_smoothed_cross_entropy counts and
  whether the source has padding are found while the batch is still on the host;
* the per-update seed (fairseq's ``_set_seed``) seeds the CPU and CUDA generators directly
  (:func:`seed_generators`). ``torch.manual_seed`` also queues a seed for every backend that is not
  initialised (XPU, MTIA, and CUDA itself before its first use), each with a formatted copy of the
  Python stack, on every update: ~0.8 ms of host time per call on a CPU-only host, where it queues
  three (two on a CUDA host).

``--grouped-shuffling`` keeps all batches of one update (every rank, every micro-batch)
together, so the ranks of an update get batches of similar length and cost
(:mod:`ls_fairseq.fairseq_ext.batching`).

``LS_FAIRSEQ_SYNC_STEP=1`` keeps fairseq's step body (with the stalls above, still on
LSTrainer); ``LS_FAIRSEQ_PLAIN_TRAINER=1`` makes lightseq-train use fairseq's Trainer unchanged.
Other optimizers, --amp, --use-bmuf, --ema, FSDP, SlowMo, model/pipeline parallelism and tasks
with their own ``optimizer_step`` take fairseq's step body.
"""

import contextlib
import copy
import functools
import logging
import math
import os
import time
from collections.abc import Mapping
from types import SimpleNamespace

import torch
from fairseq import metrics, utils
from fairseq.distributed import utils as distributed_utils
from fairseq.optim.fp16_optimizer import MemoryEfficientFP16Optimizer
from fairseq.tasks import FairseqTask
from fairseq.trainer import Trainer

from ls_fairseq.fairseq_ext.batching import group_batches_by_update
from ls_fairseq.fairseq_ext.criterion import (
    COUNTED_ROWS_KEY,
    LSLabelSmoothedCrossEntropyCriterion,
    takes_logit_rows,
)
from ls_fairseq.fairseq_ext.optimizer import LSFairseqAdam

logger = logging.getLogger("fairseq.trainer")  # fairseq's own logger: the same lines as its Trainer

SRC_PADDING_KEY = "src_has_padding"  # net_input entry the ls_transformer encoder reads


def plain_trainer_requested() -> bool:
    return os.environ.get("LS_FAIRSEQ_PLAIN_TRAINER") == "1"


def shard_adam_requested():
    """LS_FAIRSEQ_SHARD_ADAM: "1" shards ls_adam's state (True); "p2p", the default, only where the
    ranks can write each other's weights ("p2p"); "0": every rank keeps the whole state (False)."""
    value = os.environ.get("LS_FAIRSEQ_SHARD_ADAM", "p2p")
    modes = {"0": False, "1": True, "p2p": "p2p", "": "p2p"}
    if value not in modes:
        raise ValueError(f"LS_FAIRSEQ_SHARD_ADAM must be 0, 1 or p2p, not {value!r}")
    return modes[value]


def _label(name: str):
    """fairseq's ``record_function`` label for a part of the step, while a profiler records (the
    label costs tens of microseconds of host time per use when none does)."""
    return torch.autograd.profiler.record_function(name) if torch.autograd._profiler_enabled() \
        else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _other_seeded_backends() -> bool:
    """Whether ``torch.manual_seed`` would seed a generator besides the CPU's and CUDA's (MPS, XPU,
    MTIA, a registered custom device); decided once per process, unknown counts as yes."""
    try:
        return bool(torch.backends.mps.is_available() or torch.xpu.is_available() or torch.mtia.is_available()
                    or torch._C._get_privateuse1_backend_name() != "privateuseone")
    except Exception:  # noqa: BLE001 - a torch without one of these probes: keep torch's own seeding
        return True


def seed_generators(seed: int) -> None:
    """The generator state that fairseq's ``utils.set_torch_seed(seed)`` leaves behind when the
    object is dropped, as ``Trainer._set_seed`` does on every update: the CPU generator and every
    CUDA device's generator seeded with ``seed``. Seeded directly when those are the only ones
    (CUDA initialised or absent, no other backend, no XLA); otherwise through fairseq's call."""
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, not {type(seed).__name__}")
    cuda = torch.cuda.is_available()
    if utils.xm is not None or _other_seeded_backends() or (cuda and not torch.cuda.is_initialized()):
        utils.set_torch_seed(seed)
        return
    torch.default_generator.manual_seed(seed)
    if cuda:
        for gen in torch.cuda.default_generators:
            gen.manual_seed(seed)


def sync_step_requested() -> bool:
    return os.environ.get("LS_FAIRSEQ_SYNC_STEP") == "1"


def pin_sample(sample):
    """Pin every CPU tensor of a (nested) sample so its copy to the GPU is asynchronous."""

    def _pin(t):
        if t.device.type == "cpu" and not t.is_pinned():
            return t.pin_memory()
        return t

    return utils.apply_to_sample(_pin, sample)


class DeferredLoggingOutput(Mapping):
    """The dictionary ``train_step`` returns, computed from the step's meters on first read.

    ``resolve`` (optional) is called first: it settles a step whose outcome is still on the GPU.
    A step that overflowed has no statistics (fairseq returns None for it): the mapping is empty."""

    def __init__(self, agg=None, sample_size=None, resolve=None):
        self._agg = agg
        self._sample_size = sample_size
        self._resolve = resolve
        self._values = None

    def _settle(self, agg, sample_size):
        self._agg, self._sample_size = agg, sample_size

    def _get(self):
        if self._values is None:
            if self._resolve is not None:
                resolve, self._resolve = self._resolve, None
                resolve()
            values = {}
            if self._agg is not None:
                values = self._agg.get_smoothed_values()
                values["sample_size"] = self._sample_size
                for key in ("ppl", "wps", "wpb", "bsz"):
                    values.pop(key, None)
            self._values = values
            self._agg = None
        return self._values

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self):
        return len(self._get())

    def __repr__(self):
        return repr(self._get())


@contextlib.contextmanager
def _train_mode_kept(*modules):
    """Within the block, ``m.train()`` returns ``m`` without walking its submodules."""
    for m in modules:
        object.__setattr__(m, "train", lambda mode=True, _m=m: _m if mode else type(_m).train(_m, mode))
    try:
        yield
    finally:
        for m in modules:
            m.__dict__.pop("train", None)


class _ScaledLossOptimizer:
    """The optimizer as the task sees it in a deferred step: ``backward`` multiplies the loss by the
    loss scale held on the device (fairseq's wrapper multiplies by its host copy)."""

    def __init__(self, optimizer, scale, timer=None):
        self._optimizer = optimizer
        self._scale = scale
        self._timer = timer  # LS_FAIRSEQ_STEP_TIMING: the host time of forward and backward apart

    def backward(self, loss):
        if self._timer is not None:
            self._timer.host_mark("forward")
        if self._scale is not None:
            loss = loss * self._scale
        loss.backward()
        if self._timer is not None:
            self._timer.host_mark("backward")

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


class _PendingStep:
    """An update whose outcome (gradient norm, the ranks' norms, and with several ranks the summed
    statistics) is still on the device: ``status`` (double tensors) and ``summed`` (or None) travel
    to the host in one copy."""

    def __init__(self, status, summed, logging_outputs, sample_size, clip_norm, events=None):
        self.n_status = sum(t.numel() for t in status)  # the values after them: summed statistics
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


class _SummedLogs:
    """Where each summed logging output sits in the all-reduced statistics buffer; ``read`` turns
    the host copy of that buffer into fairseq's one-element list of logging outputs (Python
    numbers, or CPU tensors for outputs with more than one element)."""

    def __init__(self, layout):
        self.layout = layout  # (key, start, shape)

    def read(self, values):
        out = {}
        for key, start, shape in self.layout:
            if shape == ():
                out[key] = values[start]
            else:
                n = math.prod(shape)
                out[key] = torch.tensor(values[start:start + n], dtype=torch.double).view(shape)
        return [out]


def _on_device(x, dtype, device):
    """``x`` (a Python number or a tensor) as a 0-dim tensor on ``device``. A Python number is
    written by a fill kernel: ``torch.as_tensor(number, device=cuda)`` would copy it from pageable
    host memory, which waits for the GPU."""
    if torch.is_tensor(x):
        return x.to(device=device, dtype=dtype).reshape(())
    return torch.full((), x, dtype=dtype, device=device)


def _check_lr(lr) -> None:
    """A schedule may compute a negative learning rate (say polynomial_decay with a negative
    --end-learning-rate): that would be gradient ascent, so it stops training instead."""
    values = lr.values() if isinstance(lr, dict) else [lr]
    for v in values:
        if v is not None and float(v) < 0:
            raise ValueError(f"the learning-rate schedule produced a negative learning rate ({float(v):g}); check "
                             "--lr, --end-learning-rate and the --lr-scheduler settings")


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


def step_timing_summary(micro, updates, tails, gaps, skip=0.25, waits=None):
    """The line ``LS_FAIRSEQ_STEP_TIMING=1`` logs: medians over the updates after the first ``skip``
    fraction (allocator and autotuning warm-up), all in GPU milliseconds.

    ``micro``: per update, the forward + backward of each micro-batch; ``updates``: first
    micro-batch start to the end of the optimizer step; ``tails``: end of the last backward to
    the end of the optimizer step (gradient reduction still running, norm, Adam); ``gaps``: the
    end of the previous update to the start of this one (the sample's copy and whatever the GPU
    waited for: a gap well above a few hundred microseconds means it waited for the host);
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
    line = (f"step timing: {n} updates, medians over the last {n - first}: update {med(updates[first:]):.2f} ms, "
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


class _StepTimer:
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


class LSTrainer(Trainer):
    # ----------------------------------------------------- the weights in flight
    @property
    def model(self):
        """fairseq's (wrapped) model; outside the train step, after the weights' all-gathers still in
        flight from the last sharded step (the train step's forward waits for them layer by layer)."""
        if not self.__dict__.get("_ls_in_step"):
            self._ls_wait_for_weights()
        return Trainer.model.fget(self)

    def get_model(self):
        self._ls_wait_for_weights()
        return super().get_model()

    def _ls_wait_for_weights(self):
        inner, _ = _inner_and_scaler(self.__dict__.get("_optimizer"))
        if isinstance(inner, LSFairseqAdam):
            inner.wait_for_weights()

    # ------------------------------------------------------------------ step
    def train_step(self, samples, raise_oom=False):
        model, criterion = Trainer.model.fget(self), self.criterion  # the forward waits for the weights
        deferred = self._deferred_step_applies()
        if not deferred:
            self._ls_resolve()
        keep = self.__dict__.get("_ls_train_mode_set") and model.training and criterion.training
        with _train_mode_kept(model, criterion) if keep else contextlib.nullcontext():
            if deferred:
                self._ls_in_step = True  # the forward pre-hooks wait for the weights they read
                try:
                    out = self._deferred_train_step(samples, raise_oom)
                finally:
                    self._ls_in_step = False
            else:
                out = super().train_step(samples, raise_oom)
        self._ls_train_mode_set = True
        return out

    def _set_seed(self):
        """fairseq's per-update seed (the seed plus the update count), without torch's lazy queues."""
        seed = self.__dict__.get("_ls_seed")
        if seed is None:
            seed = self._ls_seed = self.cfg.common.seed  # read once: omegaconf attribute reads are slow
        seed_generators(seed + self.get_num_updates())

    def _deferred_step_applies(self) -> bool:
        """Whether this run can take the step without host reads (decided once per optimizer)."""
        opt = self.optimizer
        seen = self.__dict__.get("_ls_deferred")
        if seen is not None and seen[0] is opt:
            return seen[1]
        inner, _ = _inner_and_scaler(opt)
        cfg = self.cfg
        reason = None
        if sync_step_requested():
            reason = "LS_FAIRSEQ_SYNC_STEP=1"
        elif not isinstance(inner, LSFairseqAdam):
            reason = f"optimizer {type(inner).__name__} (the deferred step needs ls_adam)"
        elif self.tpu or cfg.common.amp or cfg.optimization.use_bmuf or cfg.ema.store_ema:
            reason = "--tpu / --amp / --use-bmuf / --ema"
        elif self.is_fsdp or cfg.distributed_training.ddp_backend == "slowmo":
            reason = f"--ddp-backend {cfg.distributed_training.ddp_backend}"
        elif self.pipeline_model_parallel or cfg.common.model_parallel_size > 1:
            reason = "model / pipeline parallelism"
        elif type(self.task).optimizer_step is not FairseqTask.optimizer_step:
            reason = f"task {type(self.task).__name__} has its own optimizer_step"
        elif self.data_parallel_world_size > 1 and not self.get_criterion().logging_outputs_can_be_summed():
            reason = "the criterion's logging outputs cannot be summed across ranks"
        ok = reason is None
        self._ls_deferred = (opt, ok)
        if isinstance(inner, LSFairseqAdam):
            inner._ls_trainer = True  # lightseq-train's trainer drives it (see LSFairseqAdam.step)
        shard = shard_adam_requested()
        if ok and self.data_parallel_world_size > 1 and shard:
            inner.request_sharding(shard)
        if ok:
            logger.info("LSTrainer: deferred step (the loss scale, clipping and the overflow test stay on "
                        "the GPU; each update is settled during the next one)")
        else:
            logger.info("LSTrainer: fairseq's step body (%s)", reason)
        return ok

    def _graph_step(self):
        """The CUDA-graph micro-batch engine (:mod:`ls_fairseq.fairseq_ext.graph_step`), or None: decided
        once per run; the reason it is off is logged once."""
        if "_ls_graphs" in self.__dict__:
            return self._ls_graphs
        from ls_fairseq.fairseq_ext import graph_step

        engine = None
        if graph_step.OPTIONS["on"]:
            reason = graph_step.unsupported_reason(self)
            if reason is None:
                engine = graph_step.GraphStep(self, graph_step.OPTIONS["buckets"])
                itr = self.__dict__.get("_ls_epoch_itr")
                if itr is not None:
                    engine.plan(itr)
            else:
                logger.info("CUDA-graph step off (%s): each micro-batch is launched eagerly", reason)
        self._ls_graphs = engine
        return engine

    def _deferred_train_step(self, samples, raise_oom=False):
        """fairseq's Trainer.train_step for ls_adam, with every host read deferred (module docstring)."""
        self._set_seed()
        self.model.train()
        self.criterion.train()
        opt = self.optimizer
        ls_adam, scaler = _inner_and_scaler(opt)
        graphs = self._graph_step()
        if graphs is not None:
            ls_adam.zero_grad(in_place=True)  # the graphs add into the flat gradient buffers
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

        # the previous update, long finished on the GPU: settle it before this one uses the
        # learning rate, the step count and the loss scale that depend on it
        if timer is not None:
            timer.host_mark("gradient reduction")
        self._ls_resolve(in_step=True)
        if timer is not None:
            timer.host_mark("settle the previous update")

        with _label("clip-grads"):
            numer = world if sync_stats else 1
            if torch.is_tensor(sample_size):
                factor = numer / torch.where(sample_size == 0, torch.ones_like(sample_size), sample_size)
            else:
                factor = numer / (sample_size or 1.0)
            raw = ls_adam._optimizer.grad_norm()  # norm of the gradients as they are (loss-scaled)
            clip = knobs.clip
            if scale is not None:
                # fairseq's fp16 wrapper keeps its factor in double precision (a Python float), and
                # clips by clip / norm above the threshold; the same arithmetic here, on the device
                factor = _on_device(factor, torch.float64, raw.device) / scale
                grad_norm = raw * factor.float()
                if clip > 0:
                    gn = grad_norm.double()
                    factor = factor * torch.where(gn > clip, clip / gn, torch.ones_like(gn))
            else:  # bf16 wrapper and bare ls_adam: torch's clip_grad_norm_ coefficient
                # fairseq's step multiplies by a Python float (fp32 arithmetic with the fp32 norm),
                # or, with statistics summed across ranks, by a double tensor (double arithmetic)
                dtype = torch.float64 if torch.is_tensor(sample_size) else torch.float32
                factor = _on_device(factor, dtype, raw.device)
                grad_norm = raw * factor
                if clip > 0:
                    factor = factor * (clip / (grad_norm + 1e-6)).clamp(max=1)
            finite = torch.isfinite(grad_norm)
            factor = torch.where(finite, factor, torch.full_like(factor, float("nan")))
            status = [grad_norm.double().reshape(1)]
            # fairseq's cross-rank check, read when settled (a sharded norm is the same on every rank)
            if self._grad_norm_buf is not None and not ls_adam.sharded:
                buf = self._grad_norm_buf
                buf.zero_()
                buf[self.data_parallel_rank] = grad_norm
                distributed_utils.all_reduce(buf, group=self.data_parallel_process_group)
                status.append(buf)  # copied by _PendingStep before the next update reuses it

        if timer is not None:
            timer.host_mark("norm and factor")
        with _label("optimizer"):
            ls_adam._optimizer._grad_factor = factor  # read by the kernel; not finite: no update
            ls_adam.step()
            if scale is not None:
                ok_scale, bad_scale = scale_candidates(scaler)
                scale.copy_(torch.where(finite, torch.full_like(scale, ok_scale), torch.full_like(scale, bad_scale)))

        if timer is not None:
            events.append(timer.mark())
            timer.host_mark("optimizer step")
        complete = timer is not None and len(events) == 2 * len(samples) + 1  # no micro-batch lost to OOM
        pending = _PendingStep(status, summed, logging_outputs, sample_size, clip, events if complete else None)
        self._ls_pending = pending
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
            on = self.cuda and os.environ.get("LS_FAIRSEQ_STEP_TIMING") == "1"
            self._ls_timer = _StepTimer(self.data_parallel_rank) if on else None
        return self._ls_timer

    def _device_loss_scale(self, scaler):
        """The fp16 loss scale as a one-element fp32 tensor on the device (None without a scaler).
        With nothing pending the host scaler is exact and the device copy is refreshed from it."""
        if scaler is None:
            return None
        t = self.__dict__.get("_ls_scale")
        if t is None or t.device != self.device:
            t = self._ls_scale = torch.empty((), dtype=torch.float32, device=self.device)
            t.fill_(float(scaler.loss_scale))
        elif self.__dict__.get("_ls_pending") is None:
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
    def _ls_resolve(self, in_step=False):
        """Settle the pending update: read its outcome and do the host side of fairseq's step.
        ``in_step``: called from the next update's step (where the step timer measures the wait)."""
        pending = self.__dict__.get("_ls_pending")
        if pending is None:
            return
        self._ls_pending = None
        timed = in_step and pending.events is not None
        t0 = time.perf_counter() if timed else 0.0
        values = pending.values()
        if pending.events is not None:
            # only the settle inside the next update's step tells how far ahead the host runs
            wait = (time.perf_counter() - t0) * 1e3 if timed else None
            pending.events[-1].synchronize()  # recorded after the Adam step that the read above waited for
            self._ls_timer.settle(pending.events, wait)
        grad_norm, norms = values[0], values[1:pending.n_status]
        if isinstance(pending.logging_outputs, _SummedLogs):
            pending.logging_outputs = pending.logging_outputs.read(values[pending.n_status:])
        ls_adam, scaler = _inner_and_scaler(self.optimizer)
        if not math.isfinite(grad_norm):
            if scaler is None:
                raise FloatingPointError("gradients are Nan/Inf (the update was not applied)")
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

    def _sum_stats_on_device(self, logging_outputs, *extra_stats, ignore=False):
        """fairseq's _fast_stat_sync_sum without host waits: one all-reduce of a double buffer on the
        device; host numbers reach it through pinned memory.

        Returns the summed ``extra_stats`` as device tensors, the summed buffer and a
        :class:`_SummedLogs` that rebuilds the summed logging outputs from a host copy of that
        buffer. The logging outputs are read only when the update is settled, from host numbers:
        as device tensors, fairseq's meters would test their weights (``n > 0``) on the host and
        wait for the GPU at every update."""
        entries = [(True, i, stat) for i, stat in enumerate(extra_stats)]  # (extra stat?, index or key, value)
        if logging_outputs:
            for k in logging_outputs[0].keys():
                if not ignore:
                    v = sum(log[k] for log in logging_outputs if k in log)
                else:
                    v = logging_outputs[0][k]
                    v = torch.zeros_like(v) if torch.is_tensor(v) else 0
                entries.append((False, k, v))

        def on_device(v):
            return torch.is_tensor(v) and v.device.type == self.device.type

        host = [e for e in entries if not on_device(e[2])]
        dev = [e for e in entries if on_device(e[2])]
        parts = []
        if host:
            host_vals = torch.tensor([float(v) for _, _, v in host], dtype=torch.double)
            if self.device.type == "cuda":
                host_vals = host_vals.pin_memory().to(self.device, non_blocking=True)
            parts.append(host_vals)
        parts += [v.detach().to(torch.double).reshape(-1) for _, _, v in dev]
        buf = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.double, device=self.device)
        distributed_utils.all_reduce(buf, group=self.data_parallel_process_group)
        stats, layout, pos = [None] * len(extra_stats), [], 0
        for is_stat, key, v in host + dev:  # the order of buf
            shape = tuple(v.shape) if on_device(v) else ()
            if is_stat:
                stats[key] = buf[pos:pos + math.prod(shape)].view(shape)
            else:
                layout.append((key, pos, shape))
            pos += math.prod(shape)
        return stats, buf, (_SummedLogs(layout) if logging_outputs else None)

    # ------------------------------------------ everything that reads the exact state settles first
    def get_train_iterator(self, *args, **kwargs):
        self._ls_resolve()
        epoch = args[0] if args else kwargs.get("epoch", 1)
        with self._batches_as_first_made(epoch):
            itr = super().get_train_iterator(*args, **kwargs)
        if self.cfg.dataset.grouped_shuffling:
            itr = group_batches_by_update(itr, self.cfg.optimization.update_freq)
        self._ls_epoch_itr = itr
        graphs = self.__dict__.get("_ls_graphs")
        if graphs is not None:
            graphs.plan(itr)
        return itr

    @contextlib.contextmanager
    def _batches_as_first_made(self, epoch):
        """Exact resume: the batches of a resumed run are those of the run it continues.

        fairseq makes the batches once and reuses them every epoch, but makes them with the
        random order of ``--seed`` + the epoch the iterator is created in (the length sort breaks
        ties at random): epoch 1 in a run from scratch, the checkpoint's epoch in a resumed run. A
        run resumed in epoch 2 or later therefore trained on other batches than the run it
        continues. Within this call an iterator made afresh for a later epoch takes the batches of
        epoch 1, and counts from the epoch asked for. Runs that remake their batches every epoch
        (--update-epoch-batch-itr, sharded data) are left as they are: those already agree."""
        task = self.task
        if (epoch is None or int(epoch) <= 1 or self.cfg.dataset.update_epoch_batch_itr
                or getattr(task.cfg, "rebuild_batches", False) or task.has_sharded_data("train")):
            yield
            return
        make = task.get_batch_iterator

        def get_batch_iterator(*a, **kw):
            dataset = kw.get("dataset", a[0] if a else None)
            reused = dataset in getattr(task, "dataset_to_epoch_iter", {})
            if reused or kw.get("disable_iterator_cache") or a or not task.can_reuse_epoch_itr(dataset):
                return make(*a, **kw)
            itr = make(**{**kw, "epoch": 1})
            itr.epoch = max(int(kw.get("epoch", 1)), 1)
            return itr

        task.get_batch_iterator = get_batch_iterator
        try:
            yield
        finally:
            del task.get_batch_iterator  # the task's own method again

    def begin_epoch(self, epoch):
        self._ls_resolve()
        return super().begin_epoch(epoch)

    def begin_valid_epoch(self, epoch):
        self._ls_resolve()
        return super().begin_valid_epoch(epoch)

    def valid_step(self, sample, raise_oom=False):
        self._ls_resolve()
        return super().valid_step(sample, raise_oom)

    def lr_step(self, epoch, val_loss=None):
        self._ls_resolve()
        graphs = self.__dict__.get("_ls_graphs")
        if graphs is not None:
            graphs.log_summary()
        return super().lr_step(epoch, val_loss)

    def lr_step_update(self):
        lr = super().lr_step_update()
        _check_lr(lr)
        return lr

    def lr_step_begin_epoch(self, epoch):
        self._ls_resolve()
        return super().lr_step_begin_epoch(epoch)

    def state_dict(self):
        self._ls_resolve()
        return super().state_dict()

    def save_checkpoint(self, filename, extra_state):
        self._ls_resolve()
        return super().save_checkpoint(filename, extra_state)

    def load_checkpoint(self, *args, **kwargs):
        self._ls_resolve()
        out = super().load_checkpoint(*args, **kwargs)
        self._ls_scale = None  # the loss scale may have been restored: refreshed from the host
        return out

    # ------------------------------------------------------------ batches
    @property
    def data_parallel_world_size(self):
        """fairseq's value, read once the process group is up (it reads the omegaconf config and the
        process group at every call, several times per update)."""
        cached = self.__dict__.get("_ls_dp_world")
        if cached is not None:
            return cached
        value = Trainer.data_parallel_world_size.fget(self)
        if value > 1 or self.cfg.distributed_training.distributed_world_size == 1 or (
                torch.distributed.is_available() and torch.distributed.is_initialized()):
            self._ls_dp_world = value
        return value

    def _fp_convert_sample(self, sample):
        """fairseq's conversion of float32 sample tensors to fp16 / bf16, with the flags read once."""
        knobs = self._knobs()
        if knobs.fp16:
            sample = utils.apply_to_sample(lambda t: t.to(dtype=torch.half) if t.dtype is torch.float32 else t, sample)
        if knobs.bf16:
            sample = utils.apply_to_sample(
                lambda t: t.to(dtype=torch.bfloat16) if t.dtype is torch.float32 else t, sample)
        return sample

    def _prepare_sample(self, sample, is_dummy=False):
        if self.cuda and not self.pipeline_model_parallel and isinstance(sample, dict) and len(sample) > 0:
            rows = self._counted_rows(sample)
            self._mark_source_padding(sample)
            sample = pin_sample(sample)
            if rows is not None:
                sample[COUNTED_ROWS_KEY] = rows.pin_memory()
        return super()._prepare_sample(sample, is_dummy)

    def _counted_rows(self, sample):
        """The target positions ls_label_smoothed_cross_entropy counts, found on the host while the
        target is still there (on the GPU the dynamic size would make the forward wait for the device)."""
        criterion = self.__dict__.get("_criterion")
        target = sample.get("target")
        if not isinstance(criterion, LSLabelSmoothedCrossEntropyCriterion) or not torch.is_tensor(target):
            return None
        if target.device.type != "cpu" or COUNTED_ROWS_KEY in sample or not takes_logit_rows(self._model):
            return None
        return criterion.counted_rows(target)

    def _mark_source_padding(self, sample):
        """Tell an ls_transformer whether the source has padding, read from the host copy of the batch."""
        net_input = sample.get("net_input")
        if not isinstance(net_input, dict) or SRC_PADDING_KEY in net_input:
            return
        src = net_input.get("src_tokens")
        if not torch.is_tensor(src) or src.device.type != "cpu" or not takes_logit_rows(self._model):
            return
        net_input[SRC_PADDING_KEY] = bool(src.eq(self.task.source_dictionary.pad()).any())

    # ------------------------------------------------------------ logging
    def _log_step_stats(self, logging_outputs, grad_norm, clip):
        """What fairseq's _reduce_and_log_stats logs for one update; returns the step's aggregator."""
        if grad_norm is not None:
            metrics.log_speed("ups", 1.0, priority=100, round=2)
            metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
            if clip > 0:
                if torch.is_tensor(grad_norm):
                    clipped = torch.where(grad_norm > clip, grad_norm.new_tensor(100), grad_norm.new_tensor(0))
                else:
                    clipped = 100.0 if grad_norm > clip else 0.0
                metrics.log_scalar("clip", clipped, priority=500, round=1)
        with metrics.aggregate() as agg:
            if logging_outputs is not None:
                self.task.reduce_metrics(logging_outputs, self.get_criterion())
            if "loss" not in agg:
                if "loss" not in self._warn_once:
                    self._warn_once.add("loss")
                    logger.warning("the criterion's reduce_metrics logged no 'loss'; logging -1 in its place "
                                   "(progress lines and best-checkpoint selection read it)")
                metrics.log_scalar("loss", -1)
        return agg

    def _reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        if self.tpu:
            return super()._reduce_and_log_stats(logging_outputs, sample_size, grad_norm)
        if grad_norm is not None and torch.is_tensor(grad_norm) and self.cfg.common.amp:
            # Outside --amp a non-finite norm never gets here (fp16: OverflowError, which sets it
            # to 0; otherwise FloatingPointError), so fairseq's host-side test is needed only then.
            if not bool(torch.isfinite(grad_norm)):
                grad_norm = None
        agg = self._log_step_stats(logging_outputs, grad_norm, self.cfg.optimization.clip_norm)
        return DeferredLoggingOutput(agg, sample_size)
