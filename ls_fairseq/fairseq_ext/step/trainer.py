"""LSTrainer: fairseq's Trainer without the per-step host stalls that do not change training.

lightseq-train, and ``fairseq-train --user-dir`` with the ls model, ls_adam and the ls criterion
(:mod:`~ls_fairseq.fairseq_ext.step.takeover`), run fairseq's own training loop on this subclass. Every
update is computed as fairseq computes it; what changes is when the host waits for the GPU. With ls_adam
an update is a :class:`~ls_fairseq.fairseq_ext.step.deferred_step.DeferredStep` (no host read; its
micro-batches replayed from CUDA graphs where the run allows); with another optimizer it is fairseq's own
step body. For every optimizer: batches copied from pinned memory (:class:`SamplePrep`), the statistics
read only when logged (:class:`StepStats`), no walk of the model to set training mode while it stays in
training mode, the per-update seed without torch's lazy seeding queues, exact resume, and every fairseq
hook that reads the exact state settles the pending updates first (:class:`PendingUpdates`).
docs/step.md draws the parts and follows one batch through an update.
"""

import contextlib
import functools
import logging

import torch
from fairseq import utils
from fairseq.tasks import FairseqTask
from fairseq.trainer import Trainer

from ls_fairseq import env
from ls_fairseq.fairseq_ext.optimizer import LSFairseqAdam
from ls_fairseq.fairseq_ext.step.batching import group_batches_by_update
from ls_fairseq.fairseq_ext.step.deferred_step import DeferredStep
from ls_fairseq.fairseq_ext.step.graph_setup import GraphSetup
from ls_fairseq.fairseq_ext.step.heap import settle_heap
from ls_fairseq.fairseq_ext.step.pending_update import PendingUpdates, unwrap_optimizer
from ls_fairseq.fairseq_ext.step.resume import batches_as_first_made
from ls_fairseq.fairseq_ext.step.sample_prep import SamplePrep
from ls_fairseq.fairseq_ext.step.settings import StepSettings
from ls_fairseq.fairseq_ext.step.step_stats import DeferredLoggingOutput, StepStats
from ls_fairseq.fairseq_ext.step.step_timing import StepTimer

logger = logging.getLogger("fairseq.trainer")  # fairseq's own logger: the same lines as its Trainer


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
    """The generator state that fairseq's ``utils.set_torch_seed(seed)`` leaves behind: the CPU generator and
    every CUDA device's generator seeded with ``seed``. Seeded directly when those are the only ones (CUDA
    initialised or absent, no other backend, no XLA): ``torch.manual_seed`` also queues a seed, with a copy of
    the Python stack, for every backend not yet initialised, on every update."""
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


def check_lr(lr) -> None:
    """A schedule may compute a negative learning rate (say polynomial_decay with a negative
    --end-learning-rate): that would be gradient ascent, so it stops training instead."""
    values = lr.values() if isinstance(lr, dict) else [lr]
    for v in values:
        if v is not None and float(v) < 0:
            raise ValueError(f"the learning-rate schedule produced a negative learning rate ({float(v):g}); check "
                             "--lr, --end-learning-rate and the --lr-scheduler settings")


def deferred_step_refused(trainer, optimizer):
    """Why ``trainer`` cannot take the deferred step with ``optimizer`` (None when it can)."""
    inner, _ = unwrap_optimizer(optimizer)
    cfg = trainer.cfg
    if not isinstance(inner, LSFairseqAdam):
        return f"optimizer {type(inner).__name__} (the deferred step needs ls_adam)"
    if trainer.tpu or cfg.common.amp or cfg.optimization.use_bmuf or cfg.ema.store_ema:
        return "--tpu / --amp / --use-bmuf / --ema"
    if trainer.is_fsdp or cfg.distributed_training.ddp_backend == "slowmo":
        return f"--ddp-backend {cfg.distributed_training.ddp_backend}"
    if trainer.pipeline_model_parallel or cfg.common.model_parallel_size > 1:
        return "model / pipeline parallelism"
    if type(trainer.task).optimizer_step is not FairseqTask.optimizer_step:
        return f"task {type(trainer.task).__name__} has its own optimizer_step"
    if trainer.data_parallel_world_size > 1 and not trainer.get_criterion().logging_outputs_can_be_summed():
        return "the criterion's logging outputs cannot be summed across ranks"
    return None


class LSTrainer(Trainer):
    def __init__(self, cfg, task, model, criterion, quantizer=None):
        # read by the properties below, which fairseq's own __init__ already uses
        self.in_step = False  # inside the deferred step: the forward waits for each layer's weights itself
        self._dp_world = None
        super().__init__(cfg, task, model, criterion, quantizer)
        self.settings = StepSettings.from_cfg(cfg)
        src = getattr(task, "source_dictionary", None)
        self.prep = SamplePrep(self._model, self._criterion, src.pad() if src is not None else -1,
                               fp16=self.settings.fp16, bf16=self.settings.bf16)
        self.stats = StepStats(task, self._criterion, self.device, lambda: self.data_parallel_process_group)
        self.timer = StepTimer(self.data_parallel_rank) if self.cuda and env.step_timing() else None
        self.pending = PendingUpdates(self, self.stats, self.settings.fp16, self.timer)
        self.graph_setup = GraphSetup(self, self.settings)
        self.deferred = None  # the DeferredStep of the optimizer below, or None: fairseq's step body
        self.deferred_for = None  # the optimizer the step was chosen for
        self.epoch_itr = None
        self.train_mode_set = False  # the model was put in training mode by an earlier step
        settle_heap()  # the imported modules and the model, never walked by the collector again (heap.py)

    # ------------------------------------------------------------------ the update
    def train_step(self, samples, raise_oom=False):
        self.graph_setup.join_prewarm()
        model, criterion = Trainer.model.fget(self), self.criterion  # the forward waits for the weights
        step = self._step_for(self.optimizer)
        if step is None:
            self.pending.settle()
        keep = self.train_mode_set and model.training and criterion.training
        with _train_mode_kept(model, criterion) if keep else contextlib.nullcontext():
            if step is None:
                out = super().train_step(samples, raise_oom)
            else:
                self.in_step = True  # the forward pre-hooks wait for the weights they read
                try:
                    out = step.run(samples, raise_oom)
                finally:
                    self.in_step = False
        self.train_mode_set = True
        return out

    def _step_for(self, optimizer):
        """The deferred step for ``optimizer`` (None: fairseq's step body), decided once per optimizer."""
        if self.deferred_for is optimizer:
            return self.deferred
        reason = deferred_step_refused(self, optimizer)
        inner, _ = unwrap_optimizer(optimizer)
        if isinstance(inner, LSFairseqAdam):
            inner.driven_by_ls_trainer = True
        self.deferred_for, self.deferred = optimizer, None
        if reason is not None:
            logger.info("LSTrainer: fairseq's step body (%s)", reason)
            return None
        # --ls-shard-state auto: only where the ranks write each other's weights (request_sharding's "p2p")
        shard = {"auto": "p2p", "on": True, "off": False}[str(getattr(inner.cfg, "ls_shard_state", "auto"))]
        if self.data_parallel_world_size > 1 and shard:
            inner.request_sharding(shard)
        logger.info("LSTrainer: deferred step (the loss scale, clipping and the overflow test stay on the GPU; "
                    "each update is settled during a later one)")
        self.deferred = DeferredStep(self, optimizer, self.settings, self.pending, self.stats,
                                     graphs=self.graph_setup.engine(), timer=self.timer)
        return self.deferred

    def count_is_read_after(self, num_updates) -> bool:
        """Whether fairseq's loop acts on the update count after this update (log, save, validate, stop, end of
        epoch): then the update is settled at once."""
        if self.settings.count_is_read_after(num_updates):
            return True
        try:
            return self.epoch_itr is not None and self.epoch_itr.end_of_epoch()
        except (AttributeError, NotImplementedError):  # an iterator that cannot tell
            return False

    def _set_seed(self):
        """fairseq's per-update seed (the seed plus the update count), without torch's lazy queues."""
        seed_generators(self.settings.seed + self.get_num_updates())

    def _build_optimizer(self):
        self.graph_setup.start_prewarm(self.prep)  # the first update's kernels, beside the optimizer's setup
        return super()._build_optimizer()

    # ------------------------------------------------------------------ batches
    def _prepare_sample(self, sample, is_dummy=False):
        if self.cuda and not self.pipeline_model_parallel and isinstance(sample, dict) and len(sample) > 0:
            sample = self.prep.for_copy(sample)
        return super()._prepare_sample(sample, is_dummy)

    def _fp_convert_sample(self, sample):
        return self.prep.to_precision(sample)

    def get_train_iterator(self, *args, **kwargs):
        self.pending.settle()
        epoch = args[0] if args else kwargs.get("epoch", 1)
        with batches_as_first_made(self.task, self.cfg, epoch):
            itr = super().get_train_iterator(*args, **kwargs)
        if self.cfg.dataset.grouped_shuffling:
            itr = group_batches_by_update(itr, self.cfg.optimization.update_freq)
        self.epoch_itr = itr
        self.graph_setup.plan(itr)
        return itr

    @property
    def data_parallel_world_size(self):
        """fairseq's value, read once the process group is up (fairseq reads the config and the process group at
        every call, several times per update)."""
        if self._dp_world is not None:
            return self._dp_world
        value = Trainer.data_parallel_world_size.fget(self)
        if value > 1 or self.cfg.distributed_training.distributed_world_size == 1 or (
                torch.distributed.is_available() and torch.distributed.is_initialized()):
            self._dp_world = value
        return value

    # ------------------------------------------------------------------ the weights in flight
    @property
    def model(self):
        """fairseq's (wrapped) model; outside the train step, after the weights' all-gathers still in flight from
        the last sharded step (the train step's forward waits for them layer by layer)."""
        if not self.in_step:
            self.wait_for_weights()
        return Trainer.model.fget(self)

    def get_model(self):
        self.wait_for_weights()
        return super().get_model()

    def wait_for_weights(self):
        inner, _ = unwrap_optimizer(getattr(self, "_optimizer", None))
        if isinstance(inner, LSFairseqAdam):
            inner.wait_for_weights()

    # ------------------------------------------------------------------ fairseq's hooks: settle first
    def _reduce_and_log_stats(self, logging_outputs, sample_size, grad_norm=None):
        """fairseq's step body: its statistics logged without reading the device (read when logged)."""
        if self.tpu:
            return super()._reduce_and_log_stats(logging_outputs, sample_size, grad_norm)
        if grad_norm is not None and torch.is_tensor(grad_norm) and self.cfg.common.amp:
            # outside --amp a non-finite norm never gets here (fp16: OverflowError, which sets it to 0;
            # otherwise FloatingPointError), so fairseq's host-side test is needed only then
            if not bool(torch.isfinite(grad_norm)):
                grad_norm = None
        agg = self.stats.log(logging_outputs, grad_norm, self.cfg.optimization.clip_norm)
        return DeferredLoggingOutput(agg, sample_size)

    def begin_epoch(self, epoch):
        self.graph_setup.join_prewarm()
        self.pending.settle()
        settle_heap()  # no pause of the garbage collector's in the epoch's updates (heap.py)
        return super().begin_epoch(epoch)

    def begin_valid_epoch(self, epoch):
        self.graph_setup.join_prewarm()
        self.pending.settle()
        return super().begin_valid_epoch(epoch)

    def valid_step(self, sample, raise_oom=False):
        self.graph_setup.join_prewarm()
        self.pending.settle()
        return super().valid_step(sample, raise_oom)

    def lr_step(self, epoch, val_loss=None):
        self.pending.settle()
        self.graph_setup.log_summary()
        return super().lr_step(epoch, val_loss)

    def lr_step_update(self):
        lr = super().lr_step_update()
        check_lr(lr)
        return lr

    def lr_step_begin_epoch(self, epoch):
        self.pending.settle()
        return super().lr_step_begin_epoch(epoch)

    def state_dict(self):
        self.pending.settle()
        return super().state_dict()

    def save_checkpoint(self, filename, extra_state):
        self.pending.settle()
        return super().save_checkpoint(filename, extra_state)

    def load_checkpoint(self, *args, **kwargs):
        self.pending.settle()
        out = super().load_checkpoint(*args, **kwargs)
        if self.deferred is not None:
            self.deferred.forget_loss_scale()  # the loss scale may have been restored: refreshed from the host
        return out
