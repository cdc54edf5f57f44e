"""The CUDA-graph training step: each micro-batch's forward and backward as two graph replays.

An eager micro-batch launches several hundred kernels; on a host that launches them slower than the
GPU runs them, the GPU idles between kernels. Here each batch is grown to one of a few fixed shapes,
its bucket (packed rows in fp16 / bf16: :mod:`~ls_fairseq.fairseq_ext.graph.packed_buckets`; padded
lengths in fp32: :mod:`~ls_fairseq.fairseq_ext.graph.shape_buckets`), and per bucket the model's body
(encoder, decoder up to its final layer norm) is captured once as a forward and a backward graph
(:mod:`~ls_fairseq.fairseq_ext.graph.capture`; their arithmetic: :mod:`~ls_fairseq.fairseq_ext.graph.split_step`).
A micro-batch is one transfer into the bucket's fixed inputs, the forward replay, the eager head
(vocabulary projection and loss), and the backward replay, which writes ls_adam's flat gradient buffer
(:mod:`~ls_fairseq.fairseq_ext.graph.graph_grads`). Loss, gradients and statistics are those of fairseq's
batch, and dropout stays random. Captures are paced (CAPTURE_SPACING_ROWS). :class:`GraphStep` says once
in the log why a run or a batch takes the eager step. docs/graph_step.md ("Inside the graph step").
"""

import logging
import time
from typing import Dict, Optional, Union

import torch

from ls_fairseq.fairseq_ext.graph.capture import GraphCapture, _Graphs
from ls_fairseq.fairseq_ext.graph.graph_grads import GraphGrads
from ls_fairseq.fairseq_ext.step.settings import DEFAULT_GRAPH_BUCKETS
from ls_fairseq.fairseq_ext.graph.packed_buckets import PackedBucket, batch_points, choose_packed, packed_report, plan_packed
from ls_fairseq.fairseq_ext.graph.shape_buckets import Bucket, batch_shapes, choose, plan_buckets, plan_report
from ls_fairseq.fairseq_ext.graph.split_step import (PACKED_KEYS, head_step, logging_output, pack_sample, packed_inputs,
                                               packing_shape, padded_inputs, split_step)

logger = logging.getLogger("fairseq.trainer")

DEFAULT_BUCKETS = DEFAULT_GRAPH_BUCKETS
WARMUP_UPDATES = 1  # eager updates before the first capture (cuBLAS handles, workspaces, kernel attributes)
# Capture pacing. A capture costs the host more than an eager micro-batch; captured back to back (the first updates
# meet most buckets), captures outrun the GPU work queued before them and the GPU waits. Until the batches run since
# the last capture have computed CAPTURE_SPACING_ROWS rows (source + target, as their buckets have them: enough GPU
# work for the host, running ahead, to refill the queue a capture drained; benchmarks/RESULTS.md, "First epoch"), a
# batch whose bucket has no graphs yet runs in the cheapest captured bucket that holds it and computes at most
# STAND_IN_COST times its own bucket's rows (weighed by attention length); its own bucket is captured at a later
# batch. Only when no captured bucket holds it within that cost does it capture before the count is reached. An
# update after which the host waited for the GPU to finish everything (a log line, the end of an epoch) starts the
# count again (:meth:`GraphStep.queue_drained`). The rule counts rows and updates, not time, so a run's choice of
# buckets (and its dropout draws) repeats.
CAPTURE_SPACING_ROWS = 40960
STAND_IN_COST = 2.0
_NET_INPUT_KEYS = {"src_tokens", "src_lengths", "prev_output_tokens"}


# ----------------------------------------------------------------------------- eligibility
def unsupported_reason(trainer, several_gpus: bool = False) -> Optional[str]:
    """Why this run cannot take the CUDA-graph step (None when it can). ``several_gpus``: the graphs on several
    GPUs too (``--ls-graph-step on``; ``auto`` leaves those to the eager step)."""
    from fairseq.tasks import FairseqTask
    from fairseq.tasks.translation import TranslationTask

    from ls_fairseq.fairseq_ext.criterion import LSLabelSmoothedCrossEntropyCriterion
    from ls_fairseq.fairseq_ext.model import LSTransformerModel

    if not trainer.cuda:
        return "not on a CUDA device"
    cfg = trainer.cfg
    model, criterion, task = trainer._model, trainer._criterion, trainer.task
    if trainer.data_parallel_world_size > 1:
        if not several_gpus:
            return ("several GPUs with --ls-graph-step auto: the eager step, whose gradient all-reduce overlaps the "
                    "backward; --ls-graph-step on replays the graphs on every GPU")
        backend = cfg.distributed_training.ddp_backend
        if backend not in ("legacy_ddp", "no_c10d"):
            return f"--ddp-backend {backend} on several GPUs (the graphs need legacy_ddp)"
    if type(model) is not LSTransformerModel:
        return f"model {type(model).__name__} (the graphs hold ls_transformer)"
    if type(criterion) is not LSLabelSmoothedCrossEntropyCriterion:
        return f"criterion {type(criterion).__name__} (the graphs need ls_label_smoothed_cross_entropy)"
    if criterion.report_accuracy:
        return "--report-accuracy"
    if not isinstance(task, TranslationTask) or type(task).train_step is not FairseqTask.train_step:
        return f"task {type(task).__name__} (the graphs need translation's plain train step)"
    if getattr(task.cfg, "left_pad_target", False) or not model.decoder.right_padded_targets:
        return "--left-pad-target"
    if model.encoder.checkpoint_activations or model.decoder.checkpoint_activations:
        return "--checkpoint-activations"
    if cfg.common.amp:
        return "--amp"
    return None


# ----------------------------------------------------------------------------- the engine
class GraphStep(GraphCapture):
    """The CUDA-graph micro-batch of :class:`~ls_fairseq.fairseq_ext.step.trainer.LSTrainer` (module
    docstring). :meth:`micro_batch` returns None for a batch it leaves to the eager step.

    ``replay=False``: each batch is padded to its bucket and runs :func:`split_step` instead of the
    graphs (any device; the tests check the graph step's arithmetic with it on the CPU).
    ``packed``: packed buckets (the real tokens only); default: in fp16 / bf16 (the attention kernels over
    packed sentences; fp32 has none with a right dropout backward)."""

    def __init__(self, trainer, max_buckets: int = DEFAULT_BUCKETS, replay: bool = True,
                 packed: Optional[bool] = None):
        self.trainer = trainer
        self.replay = bool(replay)
        self.model = trainer._model
        if packed is None:
            dtype = next(self.model.parameters()).dtype
            packed = dtype in (torch.float16, torch.bfloat16)
        self.packed = bool(packed)
        self.criterion = trainer._criterion
        self.max_buckets = int(max_buckets)
        d = trainer.task.target_dictionary
        self.pad, self.eos = d.pad(), d.eos()
        self.left_pad_source = bool(getattr(trainer.task.cfg, "left_pad_source", True))
        self.buckets = []
        self._planned_for = None
        self.graphs: Dict[Union[Bucket, PackedBucket], _Graphs] = {}
        self.pool = None
        self.stream = None
        self.disabled = None  # why graphs were turned off for the rest of the run
        self._said = set()
        self.counts = {"graph": 0, "eager": 0, "stand_in": 0}
        self._rows_since_capture = CAPTURE_SPACING_ROWS  # rows the batches since the last capture computed (pacing)
        self._run_in = set()  # replay=False: the buckets a batch ran in, standing for captured ones
        self.capture_seconds = 0.0
        # host seconds of the captures by part: tracing the forward / the backward (Python and autograd running
        # under capture), ending those two captures and waiting for their instantiation (on the helper thread,
        # beside the captures that follow)
        self.capture_parts = {"forward": 0.0, "backward": 0.0, "instantiate": 0.0}
        # pinned staging buffers, used in turn, one per batch that may be in flight (_staging_buffers)
        self._host = []
        self._host_events = []
        self._turn = 0
        self._dev_in = self._feat_buf = self._grad_buf = None
        self._instantiator = None  # the helper thread that instantiates captured graphs (_instantiate)
        self._defer_instantiation = True
        self._key = None  # the optimizer buffers the graphs read and write (_buffers_key)
        self._summarised = None  # the counts the last log_summary reported
        self.grads = GraphGrads(self.model, trainer.data_parallel_world_size)
        import atexit

        atexit.register(self.close)

    # ------------------------------------------------------------------ planning
    def plan(self, epoch_itr) -> None:
        """Choose the buckets from the batches of ``epoch_itr`` (fairseq's frozen batches)."""
        batches = getattr(epoch_itr, "frozen_batches", None)
        if batches is None or batches is self._planned_for:
            return
        ds = getattr(epoch_itr, "dataset", None)
        src_sizes, tgt_sizes = getattr(ds, "src_sizes", None), getattr(ds, "tgt_sizes", None)
        if src_sizes is None or tgt_sizes is None:
            self._say("sizes", "CUDA-graph step: the dataset has no src_sizes / tgt_sizes; every batch takes "
                               "the eager step")
            return
        t0 = time.perf_counter()
        self._planned_for = batches
        if self.packed:
            points = batch_points(batches, src_sizes, tgt_sizes)
            self.buckets = plan_packed(points, self.max_buckets)
            extra, extra_tgt, missing = packed_report(self.buckets, points)
            logger.info("CUDA-graph step: %d packed buckets for %d batches: %.1f%% more rows computed than the "
                        "batches' real tokens (%.1f%% more target rows; %d batches fit none; planned in %.2f s)",
                        len(self.buckets), len(points), 100 * extra, 100 * extra_tgt, missing,
                        time.perf_counter() - t0)
        else:
            shapes = batch_shapes(batches, src_sizes, tgt_sizes)
            self.buckets = plan_buckets(shapes, self.max_buckets)
            distinct, extra, extra_tgt = plan_report(self.buckets, shapes)
            logger.info("CUDA-graph step: %d shape buckets for %d batches of %d distinct shapes: %.1f%% more "
                        "positions computed than fairseq's batches (%.1f%% more target positions; planned in "
                        "%.2f s)", len(self.buckets), len(shapes), distinct, 100 * extra, 100 * extra_tgt,
                        time.perf_counter() - t0)
        self._alloc_shared()  # GraphCapture

    # ------------------------------------------------------------------ the gradient buffers
    def begin_update(self, ls_adam, micro_batches: int = 1) -> None:
        """Before an update's ``micro_batches``: :meth:`GraphGrads.begin_update
        <ls_fairseq.fairseq_ext.graph.graph_grads.GraphGrads.begin_update>`."""
        self.grads.begin_update(ls_adam, micro_batches)

    def end_micro_batches(self) -> None:
        """After the update's micro-batches: buffers that no micro-batch wrote are zeroed."""
        self.grads.make_zero()

    # ------------------------------------------------------------------ one micro-batch
    def micro_batch(self, sample, optimizer, num_updates: int):
        """Forward and backward of the host ``sample`` through the graphs. Returns (loss,
        sample_size, logging_output) as the task's train_step does, or None: take the eager step
        (whose backward adds into the flat gradient buffers, zeroed here first)."""
        out = self._micro_batch(sample, optimizer, num_updates)
        if out is None:
            self.grads.make_zero()
        return out

    def _micro_batch(self, sample, optimizer, num_updates: int):
        if self.disabled is not None or not self.buckets or num_updates < WARMUP_UPDATES:
            return None
        if not self.grads.attached():
            return None  # begin_update did not run, or the gradients were detached since (an OOM's zero_grad)
        if not self.grads.can_replay(self.grads.mode):
            return None  # an update of one micro-batch whose buffers something else wrote already
        if not isinstance(sample, dict) or not sample or set(sample.get("net_input", {})) - {"src_lengths"} \
                != _NET_INPUT_KEYS - {"src_lengths"}:
            return None
        net = sample["net_input"]
        if net["src_tokens"].device.type != "cpu":
            return None
        B, S = net["src_tokens"].shape
        T = net["prev_output_tokens"].shape[1]
        packing = None
        if self.packed:
            packing = pack_sample(sample, self.criterion, self.pad)
            if packing is None:
                self.counts["eager"] += 1
                self._say("pack", "CUDA-graph step: a batch that cannot be packed (a sentence without tokens) takes "
                                  "the eager step (said once)")
                return None
            shape = packing_shape(packing[0])
            bucket = choose_packed(self.buckets, *shape)
        else:
            shape = (B, S, T)
            bucket = choose(self.buckets, B, S, T)
        if bucket is None:
            self.counts["eager"] += 1
            self._say("fit", f"CUDA-graph step: a batch of shape {shape} fits no shape bucket and takes the eager "
                             "step (said once)")
            return None
        if self.model.training is False or self.criterion.training is False:
            return None
        bucket = self._paced(bucket, shape)
        if not self.replay:
            self._run_in.add(bucket)
            self.grads.make_zero()  # split_step's backward adds into the flat gradient buffers
            loss, sample_size, log = split_step(self.model, self.criterion, sample, bucket, self.pad, self.eos,
                                                self.left_pad_source, optimizer=optimizer)
            self.counts["graph"] += 1
            return loss.detach(), sample_size, log
        if self.packed:
            p = packed_inputs(packing[0], bucket, self.pad)
            inputs = [p[k] for k in PACKED_KEYS] + [p["rows"], packing[1]]
        else:
            inputs = padded_inputs(sample, bucket, self.criterion, self.pad, self.eos, self.left_pad_source)
        key = self._buffers_key(optimizer)
        if key != self._key:
            if self.graphs:  # a new optimizer (its own flat buffers): the graphs read and write the old ones
                logger.info("CUDA-graph step: the parameter buffers changed; the buckets are captured again")
                self.graphs.clear()
            self._key = key
        g = self.graphs.get(bucket)
        if g is not None and g.mode != self.grads.mode:  # --update-freq changed: capture for the other mode
            self._say("mode", f"CUDA-graph step: updates of {'one micro-batch' if self.grads.mode == 'write' else 'several'}"
                              " now; the buckets are captured again for them (said once)")
            del self.graphs[bucket]
            g = None
        views = self._views(bucket, inputs[-1].numel())
        self._upload(views, *inputs)
        if g is None:
            g = self._capture(bucket, views)
            if g is None:
                return None
        g.fwd.replay()
        leaf = g.feats.detach().requires_grad_(True)
        loss, nll, _ = head_step(self.model, self.criterion, leaf, views["rows"], views["target_rows"], optimizer,
                                 grad_out=g.grad, first_writer=self.grads.mode == "write")
        g.bwd.replay()
        self.grads.replayed()
        self.counts["graph"] += 1
        # detached: nothing may keep the head's autograd graph (and its AccumulateGrad nodes, bound to this
        # stream) alive into the next capture, whose backward would then wait on this stream
        loss, nll = loss.detach(), nll.detach()
        return (loss,) + logging_output(self.criterion, loss, nll, sample["ntokens"], B)

    def queue_drained(self) -> None:
        """The host has just waited for all GPU work queued so far (fairseq's loop reads the update count): a capture
        now would find nothing queued to hide it, so the pacing counts its rows from here."""
        self._rows_since_capture = 0

    def _ready(self, bucket) -> bool:
        """Whether ``bucket`` has graphs for this update's mode (replay=False: whether a batch ran in it)."""
        if not self.replay:
            return bucket in self._run_in
        g = self.graphs.get(bucket)
        return g is not None and g.mode == self.grads.mode

    def capture_due(self) -> bool:
        """Whether the batches since the last capture have computed CAPTURE_SPACING_ROWS rows: a bucket without graphs
        is captured now rather than stood in for (:meth:`_paced`)."""
        return self._rows_since_capture >= CAPTURE_SPACING_ROWS

    def _paced(self, bucket, shape):
        """The bucket a batch whose cheapest bucket is ``bucket`` runs in (capture pacing, CAPTURE_SPACING_ROWS)."""
        if not self._ready(bucket) and not self.capture_due():
            limit = STAND_IN_COST * bucket.cost
            for b in self.buckets:  # sorted by cost
                if b.cost > limit:
                    break
                if b is not bucket and self._ready(b) and b.holds(*shape):
                    self.counts["stand_in"] += 1
                    bucket = b
                    break
        if self._ready(bucket):
            self._rows_since_capture += bucket.tokens
        else:
            self._rows_since_capture = 0  # ``bucket`` is captured now
        return bucket

    # ------------------------------------------------------------------ the log, the end
    def log_summary(self) -> None:
        """One line on what the graphs did so far (at the end of each epoch and of the run)."""
        seen = (self.counts["graph"], self.counts["eager"])
        if seen == self._summarised:
            return
        self._summarised = seen
        parts = ", ".join(f"{v:.1f} s {k}" for k, v in self.capture_parts.items())
        logger.info("CUDA-graph step: %d micro-batches from %d captured buckets (%.1f s capturing: %s; %d ran in a "
                    "larger bucket while theirs waited for its capture), %d batches fitting no bucket",
                    self.counts["graph"], len(self.graphs), self.capture_seconds, parts, self.counts["stand_in"],
                    self.counts["eager"])

    def close(self) -> None:
        """Log the summary and release the graphs and their pool while CUDA is still up (at exit)."""
        self.log_summary()
        if self.graphs:
            torch.cuda.synchronize()
        self.graphs.clear()
        self._dev_in = self._feat_buf = self._grad_buf = None
        self.pool = self.stream = None
        if self._instantiator is not None:
            self._instantiator.shutdown(wait=True)
            self._instantiator = None

    def _say(self, key, msg):
        if key not in self._said:
            self._said.add(key)
            logger.info(msg)
