"""The fixed buffers a bucket's CUDA graphs read and write, and the graphs' capture and instantiation.

:class:`GraphCapture` is the part of :class:`~ls_fairseq.fairseq_ext.graph.graph_step.GraphStep` that deals
with devices: the shared input buffer (one view per bucket, filled by one host-to-device copy through pinned
staging buffers), the decoder features' buffers, and the capture of a bucket's forward and backward into one
memory pool, each graph instantiated on a helper thread while the next one is captured. A capture that fails
turns the graphs off for the rest of the run; the eager step takes over. docs/graph_step.md ("Capture and
pacing") has the design.
"""

import logging
import time
from typing import Optional

import numpy as np
import torch

from ls_fairseq.fairseq_ext.graph.packed_buckets import PackedBucket
from ls_fairseq.fairseq_ext.graph.split_step import PACKED_KEYS, body, body_packed

logger = logging.getLogger("fairseq.trainer")


def _staging_buffers() -> int:
    """Pinned staging buffers for the batches' transfers: one per batch that may be in flight, for the updates that
    may be pending with --update-freq up to 3 (beyond that the buffers, not the pending limit, bound how far the
    host runs ahead)."""
    from ls_fairseq.fairseq_ext.step import pending_update

    return 3 * pending_update.PENDING_WITHOUT_SCALE + 1


class _Graphs:
    """One bucket's captured forward and backward and the views they read and write. The backward
    writes all body gradients into the flat gradient buffer, for ``mode``
    (:mod:`ls_fairseq.fairseq_ext.graph.graph_grads`)."""

    def __init__(self, fwd, bwd, mode, feats, grad):
        self.fwd, self.bwd, self.mode = fwd, bwd, mode
        self.feats, self.grad = feats, grad


class GraphCapture:
    """Buffers and capture of :class:`~ls_fairseq.fairseq_ext.graph.graph_step.GraphStep`, which declares the
    state they use in its ``__init__``."""

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
