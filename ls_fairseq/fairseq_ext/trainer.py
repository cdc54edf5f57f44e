"""LSTrainer: fairseq's Trainer without the per-step host stalls that do not change training.

lightseq-train runs fairseq's own training loop with this subclass in place of
``fairseq.trainer.Trainer``. Every update is computed as fairseq computes it; what changes is
when the host waits for the GPU. fairseq's step reads GPU values on the host several times
(the gradient norm for the fp16 loss scaler and the overflow test, the summed sample size in
multi-GPU runs, the cross-rank gradient-norm check); each read drains the GPU queue, and the
GPU then idles while Python prepares the next batch and launches its first kernels.

For ls_adam (``--optimizer ls_adam``, alone or under fairseq's memory-efficient fp16/bf16
wrapper) LSTrainer runs the deferred step, which reads nothing back: the fp16 loss scale, the
clip coefficient and the overflow test stay on the GPU, and the outcome of each update is read
during the next one, when the GPU has long finished it
(:mod:`ls_fairseq.fairseq_ext.deferred_step` says how, and how it differs from fairseq's step).

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

Where each part lives: this module holds LSTrainer itself (which step it takes, the switches
above, the per-update seed, exact resume, and the calls from fairseq's loop that settle a pending
update first); the deferred step is :mod:`~ls_fairseq.fairseq_ext.deferred_step`, the pending
update and its settling :mod:`~ls_fairseq.fairseq_ext.pending_update`, the update's statistics
:mod:`~ls_fairseq.fairseq_ext.step_stats`, the batch's host-side preparation
:mod:`~ls_fairseq.fairseq_ext.sample_prep`, ``LS_FAIRSEQ_STEP_TIMING``
:mod:`~ls_fairseq.fairseq_ext.step_timing`, and the warm-up of the first update's kernels while the
optimizer is built :mod:`~ls_fairseq.fairseq_ext.prewarm`.
"""

import contextlib
import functools
import logging

import torch
from fairseq import utils
from fairseq.tasks import FairseqTask
from fairseq.trainer import Trainer

from ls_fairseq.fairseq_ext.batching import group_batches_by_update
from ls_fairseq.fairseq_ext.deferred_step import DeferredStepMixin, scale_candidates
from ls_fairseq.fairseq_ext.heap import settle_heap
from ls_fairseq.fairseq_ext.optimizer import LSFairseqAdam
from ls_fairseq.fairseq_ext.pending_update import PendingUpdateMixin, _inner_and_scaler
from ls_fairseq.fairseq_ext.sample_prep import SamplePrepMixin, pin_sample
from ls_fairseq.fairseq_ext.step_stats import DeferredLoggingOutput, StepStatsMixin
from ls_fairseq.fairseq_ext.step_timing import host_sections_summary, step_timing_summary
from ls_fairseq import env

# the names other modules and scripts import from here
__all__ = ["LSTrainer", "DeferredLoggingOutput", "host_sections_summary", "pin_sample",
           "scale_candidates", "seed_generators", "step_timing_summary"]

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


def _check_lr(lr) -> None:
    """A schedule may compute a negative learning rate (say polynomial_decay with a negative
    --end-learning-rate): that would be gradient ascent, so it stops training instead."""
    values = lr.values() if isinstance(lr, dict) else [lr]
    for v in values:
        if v is not None and float(v) < 0:
            raise ValueError(f"the learning-rate schedule produced a negative learning rate ({float(v):g}); check "
                             "--lr, --end-learning-rate and the --lr-scheduler settings")


class LSTrainer(DeferredStepMixin, PendingUpdateMixin, StepStatsMixin, SamplePrepMixin, Trainer):
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
        self._ls_join_prewarm()
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
        if env.sync_step():
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
        shard = env.shard_adam()
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

    # ------------------------------------------------------- the kernels' warm-up before the first update
    def _build_optimizer(self):
        self._ls_start_prewarm()  # beside the optimizer's setup (prewarm.py)
        return super()._build_optimizer()

    def _ls_start_prewarm(self):
        """Start :class:`~ls_fairseq.fairseq_ext.prewarm.Prewarm` on the first batch, once per run, when this run
        takes the CUDA-graph step with ls_adam; the layers' products through cuBLASLt with it, ATen's without."""
        if "_ls_prewarm" in self.__dict__:
            return
        self._ls_prewarm = None
        from ls_fairseq.fairseq_ext import gemm_lt, graph_step, prewarm

        if not graph_step.OPTIONS["on"] or not self.cuda \
                or getattr(self.cfg.optimizer, "_name", None) != "ls_adam" \
                or graph_step.unsupported_reason(self) is not None:
            gemm_lt.disable()  # the eager step's products: ATen's (an earlier run in this process may have set it)
            return
        preload = self._ls_lt_products()
        sample = self.__dict__.get("_dummy_batch")
        if not isinstance(sample, dict) or not sample:
            return
        try:
            self._ls_prewarm = prewarm.Prewarm(self._model, self._criterion, self._host_marked(sample), self.device,
                                               preload_tokens=preload)
        except Exception as e:  # noqa: BLE001 - the warm-up only
            logger.info("kernel warm-up before the first update not started (%s: %s)", type(e).__name__, e)

    def _ls_lt_products(self):
        """With the CUDA-graph step, the layers' products run through cuBLASLt (gemm_lt.py): one kernel per exact
        shape, known before it runs, so the warm-up loads those of the planned buckets and the captures of new
        buckets do not wait for the queued updates. Returns the buckets' token counts to preload, or None."""
        from ls_fairseq.fairseq_ext import gemm_lt

        if not gemm_lt.enable():
            logger.info("cuBLASLt not available in this build: the layers' products through ATen")
            return None
        logger.info("the layers' products through cuBLASLt (one algorithm per exact shape)")
        engine = self._graph_step()  # the bucket plan, made now rather than at the first update
        return gemm_lt.bucket_token_counts(engine.buckets) if engine is not None and engine.buckets else None

    def _ls_join_prewarm(self):
        """Wait for the kernels' warm-up (if one runs): the model runs on this thread from here."""
        warm = self.__dict__.get("_ls_prewarm")
        if warm is not None:
            self._ls_prewarm = None  # (the key stays: no second warm-up)
            warm.join()

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

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        settle_heap()  # the imported modules and the model, never walked by the collector again (heap.py)

    def begin_epoch(self, epoch):
        self._ls_join_prewarm()
        self._ls_resolve()
        settle_heap()  # no pause of the garbage collector's in the epoch's updates (heap.py)
        return super().begin_epoch(epoch)

    def begin_valid_epoch(self, epoch):
        self._ls_join_prewarm()
        self._ls_resolve()
        return super().begin_valid_epoch(epoch)

    def valid_step(self, sample, raise_oom=False):
        self._ls_join_prewarm()
        self._ls_resolve()
        return super().valid_step(sample, raise_oom)

    def lr_step(self, epoch, val_loss=None):
        self._ls_resolve()
        graphs = self.__dict__.get("_ls_graphs")
        if graphs is not None:
            graphs.log_summary()
        if self.cuda:
            from ls_fairseq.fairseq_ext import gemm_lt

            if gemm_lt.is_on():
                logger.info("cuBLASLt products: %s", gemm_lt.describe())
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
