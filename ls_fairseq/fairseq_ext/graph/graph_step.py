"""The CUDA-graph training step: each micro-batch's forward and backward as two graph replays.

An eager ls_transformer micro-batch launches several hundred kernels; on a host that launches
slower than the GPU runs them, the GPU idles between kernels. Here each batch is grown to one of
a few fixed shapes, its bucket: in fp16 / bf16 its real tokens packed back to back and grown to fixed
row counts (:mod:`ls_fairseq.fairseq_ext.graph.packed_buckets`), in fp32 its sentences padded to fixed
lengths (:mod:`ls_fairseq.fairseq_ext.graph.shape_buckets`; fp32 has no attention kernel over packed
sentences whose dropout backward is right). Per bucket, the model's body (encoder, decoder up to its
final layer norm) is captured once as two CUDA graphs: its forward, and its backward from the
gradient of the decoder features into the parameters' gradient buffers (the arithmetic of both:
:mod:`ls_fairseq.fairseq_ext.graph.split_step`). A micro-batch is then:

1. the grown batch copied to the GPU in one transfer, into the bucket's fixed input tensors;
2. the forward graph replayed: the decoder features land in a fixed buffer;
3. the head, eagerly (its row count varies from batch to batch): the vocabulary projection of the
   counted target positions, one cross-entropy pass that computes the loss and writes the gradient
   of the scaled loss over the logits, and the projection's two backward GEMMs, which add into the
   output projection's gradient and write the features' gradient (a handful of kernels, no autograd:
   :func:`~ls_fairseq.fairseq_ext.graph.split_step.head_step`);
4. the backward graph replayed: the linear layers' weight-gradient GEMMs write straight into
   ls_adam's flat gradient buffer, and the graph's last kernels move the other body gradients
   (biases, layer norms) there: overwriting for an update of one micro-batch (the buffer is not
   zeroed beforehand), adding for the micro-batches of ``--update-freq`` > 1
   (:mod:`ls_fairseq.fairseq_ext.graph.graph_grads`).

The loss, the gradients and the logged statistics are those of the batch as fairseq made it (padding
is ignored by the masks and the loss, or forms sentences of its own that the loss never reads). Dropout stays random:
the kernels draw their Philox seed and offset from torch's generator in the graph-safe way, so each
replay gets fresh numbers, and fairseq's per-update seeding reproduces them. The optimizer step
(ls_adam's deferred step: norm, clip, overflow test, fused Adam) stays eager: a few kernels.

On several GPUs (``--ddp-backend legacy_ddp``, lightseq-train's default for ls_adam) each GPU replays
its own graphs, and ls_adam all-reduces its flat gradient buffers between graph launches: once per
update, after the last micro-batch's backward (with ``--update-freq`` the earlier ones only
accumulate). The reduction is not overlapped with the backward and the optimizer state is not
sharded: both work through hooks in the backward, which run while a graph is captured, never when it
is replayed (:meth:`GraphStep.begin_update`).

All graphs share one memory pool: the activations a forward saves live until its backward has
run, so the pool holds about one micro-batch's activations whatever the number of buckets. The
graphs are captured on a bucket's first batch after a short eager warm-up (library handles,
kernel attributes), paced (CAPTURE_SPACING_ROWS: until a few batches have run since the last
capture, a batch whose bucket waits for its graphs runs in a larger captured bucket). Each graph
is instantiated on a helper thread while this one captures the next, and the host, which without
a loss scale runs up to five updates ahead of the GPU (:mod:`ls_fairseq.fairseq_ext.step.pending_update`),
captures while the GPU works through the updates queued before. :class:`GraphStep` says once in
the log why a run or a batch takes the eager step instead.
"""

import logging
import time
from typing import Dict, Optional, Union

import numpy as np
import torch

from ls_fairseq.fairseq_ext.graph.graph_grads import GraphGrads
from ls_fairseq.fairseq_ext.step.settings import DEFAULT_GRAPH_BUCKETS
from ls_fairseq.fairseq_ext.graph.packed_buckets import PackedBucket, batch_points, choose_packed, packed_report, plan_packed
from ls_fairseq.fairseq_ext.graph.shape_buckets import Bucket, batch_shapes, choose, plan_buckets, plan_report
from ls_fairseq.fairseq_ext.graph.split_step import (PACKED_KEYS, body, body_packed, head_step, logging_output, pack_sample,
                                               packed_inputs, packing_shape, padded_inputs, split_step)

logger = logging.getLogger("fairseq.trainer")

DEFAULT_BUCKETS = DEFAULT_GRAPH_BUCKETS
WARMUP_UPDATES = 1  # eager updates before the first capture (cuBLAS handles, workspaces, kernel attributes)
# Capture pacing. A capture costs the host about two eager micro-batches; captured back to back (the first
# hundred updates meet most buckets), they outrun the GPU work queued before them and the GPU waits. Until the
# batches run since the last capture have computed CAPTURE_SPACING_ROWS rows (source + target, as their buckets
# have them: about six batches of transformer-big at --max-tokens 4096, three at 8192, some 80 ms of H100/H200 GPU
# time, in which the host, running ahead, refills the queue a capture drained), a batch whose bucket has no graphs
# yet runs in the cheapest captured bucket that holds it and computes at most STAND_IN_COST times its own bucket's
# rows (weighed by attention length); its own bucket is captured at a later batch. Only when none is captured does
# it capture at once. An update after which the host waited for the GPU to finish everything (a log line, the end
# of an epoch) starts the count again (:meth:`GraphStep.queue_drained`). The rule counts rows and updates, not
# time, so a run's choice of buckets (and its dropout draws) repeats.
CAPTURE_SPACING_ROWS = 40960
STAND_IN_COST = 2.0
_NET_INPUT_KEYS = {"src_tokens", "src_lengths", "prev_output_tokens"}


def _staging_buffers() -> int:
    """Pinned staging buffers for the batches' transfers: one per batch that may be in flight, for the updates that
    may be pending with --update-freq up to 3 (beyond that the buffers, not the pending limit, bound how far the
    host runs ahead)."""
    from ls_fairseq.fairseq_ext.step import pending_update

    return 3 * pending_update.PENDING_WITHOUT_SCALE + 1


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
class _Graphs:
    """One bucket's captured forward and backward and the views they read and write. The backward
    writes all body gradients into the flat gradient buffer, for ``mode``
    (:mod:`ls_fairseq.fairseq_ext.graph.graph_grads`)."""

    def __init__(self, fwd, bwd, mode, feats, grad):
        self.fwd, self.bwd, self.mode = fwd, bwd, mode
        self.feats, self.grad = feats, grad


class GraphStep:
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
        self._alloc_shared()

    def _alloc_shared(self):
        """The device buffers every bucket's graphs read and write (only one bucket runs at a time),
        and pinned host buffers for the batches' single transfer."""
        if not self.buckets or not self.replay:
            return
        C = self.model.decoder.embed_tokens.embedding_dim
        n_in = max(sum(int(np.prod(s)) for _, s in self._shapes(b, self._max_rows(b))) for b in self.buckets)
        n_feat = max(int(np.prod(self._feat_shape(b, C))) for b in self.buckets)
        dev = self.trainer.device
        dtype = next(self.model.parameters()).dtype
        if self._dev_in is None or self._dev_in.numel() < n_in:
            if self.graphs:  # graphs read the old buffers: capture again
                self.graphs.clear()
            self._dev_in = torch.zeros(n_in, dtype=torch.int64, device=dev)
            self._host = [torch.zeros(n_in, dtype=torch.int64, pin_memory=True) for _ in range(_staging_buffers())]
            self._host_events = [None] * len(self._host)
        if self._feat_buf is None or self._feat_buf.numel() < n_feat or self._feat_buf.dtype != dtype:
            self.graphs.clear()
            self._feat_buf = torch.zeros(n_feat, dtype=dtype, device=dev)
            self._grad_buf = torch.zeros(n_feat, dtype=dtype, device=dev)

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
        if key != self.__dict__.get("_key"):
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

    # ------------------------------------------------------------------ buffers
    @staticmethod
    def _buffers_key(optimizer):
        """Addresses of ls_adam's flat weight and gradient buffers, which the graphs read and write."""
        from ls_fairseq.fairseq_ext.optimizer import LSFairseqAdam

        opt = optimizer
        for _ in range(4):  # the trainer's loss-scaling view, fairseq's memory-efficient fp16/bf16 wrapper
            if opt is None or isinstance(opt, LSFairseqAdam):
                break
            opt = opt.wrapped_optimizer if hasattr(opt, "wrapped_optimizer") else getattr(opt, "_optimizer", None)
        if not isinstance(opt, LSFairseqAdam):
            return None
        return tuple((buf.param.data_ptr(), buf.grad.data_ptr()) for ws in opt._optimizer.workspaces for buf in ws.buffers)

    @staticmethod
    def _shapes(bucket, n_rows: int):
        """(name, shape) of a bucket's inputs in the shared buffer: the graphs read all but the last two, the
        counted rows and their targets (the eager head's)."""
        if isinstance(bucket, PackedBucket):
            S, Rs, Rt = bucket.sentences + 1, bucket.src_rows, bucket.tgt_rows
            sizes = {"src_tokens": (1, Rs), "src_positions": (1, Rs), "cu_src": (S,), "tgt_tokens": (1, Rt),
                     "tgt_positions": (1, Rt), "cu_tgt": (S,)}
            named = [(k, sizes[k]) for k in PACKED_KEYS]
        else:
            B, S, T = bucket.sentences, bucket.src_len, bucket.tgt_len
            named = [("src", (B, S)), ("lengths", (B,)), ("prev", (B, T))]
        return named + [("rows", (n_rows,)), ("target_rows", (n_rows,))]

    @staticmethod
    def _max_rows(bucket) -> int:
        """The most counted rows a batch of ``bucket`` has (the loss rounds its count up to a multiple of 8)."""
        if isinstance(bucket, PackedBucket):
            return bucket.tgt_rows + 8
        return bucket.sentences * bucket.tgt_len

    @staticmethod
    def _feat_shape(bucket, C: int):
        """The shape of the decoder features the forward graph leaves (and the backward graph takes the gradient of)."""
        return (1, bucket.tgt_rows, C) if isinstance(bucket, PackedBucket) else (bucket.sentences, bucket.tgt_len, C)

    def _views(self, bucket, n_rows: int):
        """Fixed views of the shared input buffer for ``bucket`` (:meth:`_shapes`)."""
        buf, out, pos = self._dev_in, {}, 0
        for name, shape in self._shapes(bucket, n_rows):
            n = int(np.prod(shape))
            out[name] = buf[pos:pos + n].view(shape)
            pos += n
        return out

    def _upload(self, views, *tensors):
        """One host-to-device copy of the padded batch, through a pinned staging buffer."""
        turn = self._turn = (self._turn + 1) % len(self._host)
        host = self._host[turn]
        ev = self._host_events[turn]
        if ev is not None:
            ev.synchronize()  # the copy that last read this staging buffer (several batches ago)
        pos = 0
        for t in tensors:
            n = t.numel()
            host[pos:pos + n].copy_(t.reshape(-1))
            pos += n
        self._dev_in[:pos].copy_(host[:pos], non_blocking=True)
        ev = self._host_events[turn] = torch.cuda.Event()
        ev.record()

    # ------------------------------------------------------------------ capture
    def _capture(self, bucket, views) -> Optional[_Graphs]:
        t0 = time.perf_counter()
        C = self.model.decoder.embed_tokens.embedding_dim
        shape = self._feat_shape(bucket, C)
        n = int(np.prod(shape))
        feats_out = self._feat_buf[:n].view(shape)
        grad_in = self._grad_buf[:n].view(shape)
        if self.stream is None:
            self.stream = torch.cuda.Stream()
        if not self.graphs:
            # a pool lives as long as a graph captured into it: with every graph dropped (a new optimizer, larger
            # shared buffers) its id names a freed pool, and capturing into it fails; take a new one
            self.pool = None
        cur = torch.cuda.current_stream()
        self.stream.wait_stream(cur)
        fwd, bwd = self._new_graph(), self._new_graph()
        graph = None
        pending = []  # the two graphs' instantiations, run beside the captures that follow them
        try:
            with torch.cuda.stream(self.stream):
                parts = self.capture_parts
                graph = fwd
                fwd.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                if self.packed:
                    feats = body_packed(self.model, views, bucket.max_len)
                else:
                    feats = body(self.model, views["src"], views["lengths"], views["prev"])
                with torch.no_grad():  # a copy outside autograd: the buffer must not hold the graph
                    feats_out.copy_(feats)
                t1 = time.perf_counter()
                fwd.capture_end()
                pending.append(self._instantiate(fwd))
                t2 = time.perf_counter()
                parts["forward"] += t1 - t0
                parts["instantiate"] += t2 - t1
                graph = None
                if self.pool is None:
                    self.pool = fwd.pool()
                # the linear weights' gradients into their sinks; autograd hands over the others in the pool
                self.grads.detach_body()
                graph = bwd
                bwd.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                torch.autograd.backward(feats, grad_in)
                self.grads.move_pool_grads(self.grads.take_sinks())
                t3 = time.perf_counter()
                bwd.capture_end()
                pending.append(self._instantiate(bwd))
                parts["backward"] += t3 - t2
                graph = None
                del feats
                for done in pending:
                    done.result()  # an instantiation's error surfaces here
                parts["instantiate"] += time.perf_counter() - t3  # what the captures did not hide
        except Exception as e:  # noqa: BLE001 - any failure: the eager step for the rest of the run
            for done in pending:  # no graph is dropped while it is being instantiated
                try:
                    done.result()
                except Exception:  # noqa: BLE001 - the capture failed already
                    pass
            self.grads.take_sinks()
            self.grads.reattach_body()
            if graph is not None:
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - the capture is already invalid
                    pass
            try:
                cur.wait_stream(self.stream)
            except Exception as again:  # noqa: BLE001 - the stream cannot be used any more
                raise RuntimeError(f"CUDA-graph capture failed ({type(e).__name__}: {e}) and the capture stream could "
                                   "not be recovered; train with --ls-graph-step off") from again
            self.disabled = f"capture failed: {type(e).__name__}: {e}"
            self.graphs.clear()
            logger.warning("CUDA-graph step off for the rest of the run (%s); the eager step takes over",
                           self.disabled)
            return None
        cur.wait_stream(self.stream)
        g = self.graphs[bucket] = _Graphs(fwd, bwd, self.grads.mode, feats_out, grad_in)
        dt = time.perf_counter() - t0
        self.capture_seconds += dt
        logger.debug("CUDA-graph step: captured %s in %.0f ms", bucket, dt * 1e3)
        return g

    def _new_graph(self):
        """A graph that :meth:`_instantiate` instantiates (where torch cannot defer it: at the end of its capture)."""
        if self._defer_instantiation:
            try:
                return torch.cuda.CUDAGraph(keep_graph=True)
            except TypeError:  # a torch without keep_graph
                self._defer_instantiation = False
        return torch.cuda.CUDAGraph()

    def _instantiate(self, graph):
        """Instantiate ``graph`` on a helper thread (the CUDA call releases the GIL), so that it runs while this
        thread captures the next graph: a future to wait on before the graph is replayed."""
        from concurrent.futures import Future, ThreadPoolExecutor

        if not self._defer_instantiation:
            done = Future()
            done.set_result(None)  # capture_end instantiated it
            return done
        if self._instantiator is None:
            self._instantiator = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ls_fairseq_graphs",
                                                    initializer=torch.cuda.set_device,
                                                    initargs=(torch.cuda.current_device(),))
        return self._instantiator.submit(graph.instantiate)

    def log_summary(self) -> None:
        """One line on what the graphs did so far (at the end of each epoch and of the run)."""
        seen = (self.counts["graph"], self.counts["eager"])
        if seen == self.__dict__.get("_summarised"):
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
