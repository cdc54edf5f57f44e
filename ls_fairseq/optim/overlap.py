"""Data-parallel gradient all-reduce overlapped with the backward pass, over a flat workspace.

Without it the gradients of a :class:`~ls_fairseq.optim.workspace.FlatWorkspace` are averaged
after the backward pass: one all-reduce per flat gradient buffer that nothing runs beside.
:class:`OverlappedReducer` starts the reduction while the backward is still running:

* Buckets. Each flat gradient buffer is cut into contiguous ranges of about ``bucket_bytes``
  at parameter boundaries, formed from the END of the buffer (:mod:`ls_fairseq.optim.buckets`): the
  backward produces the gradients of the last layers first, so the first bucket to complete
  is the tail of the buffer. With several buffers (say fp32 and fp16 parameters) each gets
  buckets of its own; one global order interleaves them by the position of each bucket's
  first parameter in the optimizer's parameter list (:func:`~ls_fairseq.optim.buckets.bucket_order`).
* Hooks. Every trainable parameter carries a hook that runs after its gradient is accumulated.
  When it fires while the reduction is armed, it counts the parameter done. Where the extension
  has them (``ls_fairseq._C.GradBuckets``, csrc/torch/grad_buckets.cpp) the hooks sit on the
  parameters' gradient accumulators in C++: they count and fold without Python and call it once
  per backward (to ask whether the round is armed) and once per complete bucket (to launch its
  collective), instead of once per parameter with a Python loop per bucket. Without them (an
  extension built without, or none) Python post-accumulate-grad hooks do the same. The hook that completes a bucket
  writes the bucket's gradients into its range of the flat buffer in one multi-tensor copy,
  divides the range by the world size in one kernel, makes every ``p.grad`` its slice (the
  fresh tensors autograd produced are freed, and the workspace sync later copies nothing), and
  hands the bucket to an asynchronous ``all_reduce(SUM)``: a few kernels per bucket, not one
  per parameter.
  Buckets are launched strictly in the global order, so every rank issues the same
  collectives in the same sequence whatever order its hooks fire in.
* End of the backward. The first hook of a round queues a callback that runs when the
  backward pass finishes, before ``backward()`` returns (a reentrant backward nested in it, as
  reentrant activation checkpointing runs one, is told apart and waited out). It fills the
  slices of parameters whose hook never fired the way the synchronous path fills them (zero
  without a gradient, the gradient divided by the world size otherwise) and launches the
  remaining buckets. All of a round's collectives are thus issued inside the backward pass,
  as PyTorch's DDP does: a collective issued between the backward and the optimizer
  (fairseq's Trainer all-reduces its logging statistics there) cannot interleave with them on
  one rank and not on another, even when a parameter got a gradient on one rank only.
* :meth:`OverlappedReducer.finish` (after the backward) waits for the round's collectives.
  On NCCL ``work.wait()`` makes the current CUDA stream wait; the host never blocks.
* Sharded optimizer state (``shard=True``). Each bucket is split into ``world_size`` equal
  parts and rank r owns part r (:meth:`~ls_fairseq.optim.buckets.Bucket.own`). The bucket then goes out as a
  ``reduce_scatter(SUM)`` in place: only the owned part receives the average, which is all
  that :class:`~ls_fairseq.optim.adam.LSAdam` reads when it updates that part only and
  all-gathers the weights afterwards. It moves half the bytes of an all-reduce while the
  backward runs. :func:`~ls_fairseq.optim.buckets.shardable` says whether every bucket splits evenly.
* Peer copies (two ranks whose GPUs map each other's memory, :meth:`OverlappedReducer.use_peer_copies`).
  Instead of NCCL's reduce-scatter, each complete bucket's part that the other rank owns is copied
  into that rank's "inbox" (symmetric memory) by a copy engine, from a stream of the reducer's own;
  :meth:`OverlappedReducer.finish` waits for both ranks' copies (a one-element all-reduce: each rank
  enters it after its own copies) and adds the inbox to the owned parts. Rounds alternate between
  two halves of the inbox (the part this rank owns, and the other, otherwise unused), so a rank's
  copies never overwrite what the other has not added yet: its copies of round k + 2 follow its
  all-reduce of round k + 1, which the other rank enters after its additions of round k. NCCL's kernels wait on the
  GPU for the other rank's matching call, holding SMs that the backward's kernels need while they
  wait (on two H200s the backward took 1.5 ms longer with them running beside it); a copy engine
  holds none. Both give the same sums: one addition of two numbers per element.

Armed means: the ``arm`` object's ``accumulate_grads`` is False (fairseq's legacy DDP wrapper
sets it inside ``no_sync()``, for all but the last micro-batch of ``--update-freq``). An
unarmed hook returns after two attribute reads. Each parameter's slice is divided by the
world size and the buckets are summed, so the result equals dividing the whole buffer and
all-reducing it at once, bit for bit.

A second backward pass into the same gradients within one armed round (before ``finish``),
armed or inside ``no_sync()``, would accumulate into slices that are already averaged and
possibly being reduced: the hook raises a RuntimeError instead of producing wrong gradients
(as PyTorch's DDP does; the same holds for a parameter whose gradient arrives twice in one
backward, used both inside and outside a reentrant activation checkpoint).
"""

import logging
import weakref
from typing import List, Sequence, Tuple

import torch
import torch.distributed as dist

from ls_fairseq import _ext
from ls_fairseq.optim.buckets import (
    DEFAULT_BUCKET_MB,
    SHARD_ALIGN_ELEMENTS,
    Bucket,
    bucket_order,
    plan_buckets,
    shardable,
)
from ls_fairseq.optim.workspace import FlatBuffer, FlatWorkspace

logger = logging.getLogger(__name__)


class _Round:
    """The state of one armed backward pass, from its first hook to :meth:`OverlappedReducer.finish`."""

    __slots__ = ("done", "pending", "next", "works", "ended", "early", "tasks")

    def __init__(self, n_slots: int, pending: List[int]):
        self.done = bytearray(n_slots)  # slot -> its slice holds the averaged local gradient
        self.pending = pending          # bucket -> parameters not done yet
        self.next = 0                   # the next bucket to launch
        self.works = []
        self.ended = False              # the end-of-backward fill ran: every bucket is launched
        self.early = 0                  # buckets launched from hooks, before the backward ended
        self.tasks = set()              # autograd graph tasks that will call back when they end


_WRITTEN_AGAIN = (
    "ls_adam overlapped all-reduce: a parameter's gradient was written again after it had been "
    "averaged for the all-reduce: a second backward pass before optimizer.all_reduce_grads(model) "
    "(run every backward but the last of an update inside model.no_sync(), as fairseq's Trainer "
    "does for --update-freq), or a parameter used both inside and outside a reentrant activation "
    "checkpoint. LS_FAIRSEQ_SYNC_ALL_REDUCE=1 all-reduces after the backward instead."
)


def _grad_buckets_class():
    """The extension's C++ hooks (``ls_fairseq._C.GradBuckets``), or None where it has none."""
    return getattr(_ext.get(), "GradBuckets", None)


# the running autograd graph task, and the node being evaluated (None outside any backward, also in
# the end-of-backward callback of an outermost backward; in a reentrant backward's it is the outer node)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: 0)
_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class OverlappedReducer:
    """Average the gradients of ``workspaces`` over ``process_group`` during the backward pass.

    ``arm`` is any object with a boolean ``accumulate_grads`` (fairseq's legacy DDP wrapper):
    hooks act only while it is False. Install once; :meth:`finish` after each armed backward;
    :meth:`remove` takes the hooks off again.
    """

    def __init__(self, workspaces: Sequence[FlatWorkspace], world_size: int, process_group, arm,
                 bucket_bytes: int = DEFAULT_BUCKET_MB << 20, shard: bool = False):
        if world_size < 2:
            raise ValueError("overlapped all-reduce: needs a world size of at least 2")
        self.workspaces = list(workspaces)
        self.buffers = [buf for ws in self.workspaces for buf in ws.buffers]
        self.world_size = world_size
        self.process_group = process_group
        self.arm = arm
        self.bucket_bytes = bucket_bytes
        self.buckets = bucket_order(self.workspaces, bucket_bytes)
        self.rank = None
        if shard:
            if not shardable(self.buckets, world_size):
                raise ValueError(f"overlapped reduce-scatter: the buckets do not split into {world_size} equal, "
                                 "aligned parts (see shardable())")
            self.rank = dist.get_rank(process_group)
        self._own = [bk.buffer.grad[slice(*bk.own(self.rank, world_size))] for bk in self.buckets] if shard else None
        # one slot per (buffer, parameter), numbered bucket by bucket
        self._slots: List[Tuple[FlatBuffer, int, int]] = []  # slot -> (buffer, index, bucket)
        self._sizes = []
        for n, bk in enumerate(self.buckets):
            for i in bk.members:
                self._slots.append((bk.buffer, i, n))
            self._sizes.append(len(bk.members))
        self._round = None
        self._told_missed = False
        self._peer = None  # _PeerCopies, see use_peer_copies
        self._handles = []
        self._native = None  # the C++ hooks (GradBuckets), when used
        native_cls = _grad_buckets_class()
        if native_cls is not None:
            first = [0]
            for size in self._sizes:
                first.append(first[-1] + size)
            self._native = native_cls(
                [buf.params[i] for buf, i, _ in self._slots], [buf.grad_view(i) for buf, i, _ in self._slots],
                first, [bk.flat for bk in self.buckets], world_size, self._events(), _WRITTEN_AGAIN)
        for s, (buf, i, n) in enumerate(self._slots):
            p = buf.params[i]
            if not p.requires_grad:  # a frozen parameter's slice is filled at the end of the backward
                continue
            if self._native is not None:
                self._native.attach(s)
            else:
                self._handles.append(p.register_post_accumulate_grad_hook(self._hook(s)))
        logger.info(
            "ls_adam: gradient %s overlapped with the backward pass (%d buckets of ~%.1f MB, %s hooks)",
            "reduce-scatter" if shard else "all-reduce", len(self.buckets), bucket_bytes / 2**20,
            "Python" if self._native is None else "C++",
        )

    def use_peer_copies(self, inboxes) -> None:
        """Move each complete bucket's other part to the peer by a copy engine instead of NCCL's
        reduce-scatter (two ranks, sharded). ``inboxes``: per flat buffer, in the order of
        ``self.buffers``, (this rank's inbox, the peer's inbox as addressable from this device, an object
        to keep alive with them or None): gradient-sized tensors
        (:func:`ls_fairseq.optim.peer.map_peer_inboxes`)."""
        if not self.sharded or self.world_size != 2:
            raise ValueError("peer copies: the reduction must be sharded over two ranks")
        if len(inboxes) != len(self.buffers):
            raise ValueError(f"peer copies: {len(inboxes)} inboxes for {len(self.buffers)} buffers")
        box, keep = {}, []
        for buf, (mine, theirs, keep_alive) in zip(self.buffers, inboxes):
            keep.append(keep_alive)
            for t in (mine, theirs):
                if t.shape != buf.grad.shape or t.dtype != buf.grad.dtype or t.device != buf.grad.device:
                    raise ValueError("peer copies: an inbox must match its flat gradient buffer")
            box[id(buf)] = (mine, theirs)
        peer = 1 - self.rank
        incoming, outgoing = ([], []), ([], [])
        for n, bk in enumerate(self.buckets):
            mine, theirs = box[id(bk.buffer)]
            olo, ohi = bk.own(self.rank, 2)
            plo, phi = bk.own(peer, 2)
            incoming[0].append(mine[olo:ohi])
            incoming[1].append(mine[plo:phi])
            outgoing[0].append((theirs[plo:phi], bk.buffer.grad[plo:phi]))
            outgoing[1].append((theirs[olo:ohi], bk.buffer.grad[plo:phi]))
        self._peer = _PeerCopies(self.buffers[0].grad.device, incoming, outgoing, keep)
        logger.info("ls_adam: gradient parts copied to the other GPU by a copy engine (no NCCL reduce-scatter)")

    @property
    def sharded(self) -> bool:
        """Whether buckets are reduce-scattered (each rank gets the average of its own parts only)."""
        return self.rank is not None

    def covers(self, workspaces: Sequence[FlatWorkspace]) -> bool:
        """Whether this reducer was built for exactly these workspaces' buffers."""
        return [buf for ws in workspaces for buf in ws.buffers] == self.buffers

    def remove(self):
        """Take the hooks off (after waiting for a round in flight)."""
        self.finish()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._native is not None:
            self._native.remove()

    # ------------------------------------------------------------------ hooks
    def _hook(self, slot: int):
        # The hook lives on the parameter, in autograd's C++ state, where Python's garbage collector
        # cannot see it: a strong reference to the reducer (and through it to the DDP wrapper, its
        # module and its process group) would make a cycle that is freed only at interpreter shutdown,
        # after torch.distributed was torn down. A weak one breaks it; without a reducer the hook does
        # nothing and the gradient accumulates as usual.
        me = weakref.ref(self)

        def hook(p):
            reducer = me()
            if reducer is None or (reducer._round is None and reducer.arm.accumulate_grads):
                return  # not armed: the gradient accumulates locally, as without the reducer
            reducer._ready(slot, p)

        return hook

    def _ready(self, slot: int, p: torch.Tensor):
        r = self._armed_round()  # not None: the hook returned already when nothing is armed
        if r.done[slot]:
            raise RuntimeError(_WRITTEN_AGAIN)
        self._enter_task(r, _graph_task_id())
        n = self._slots[slot][2]
        r.done[slot] = 1
        r.pending[n] -= 1
        if r.pending[n] == 0:
            self._fold(n)
            self._folded(r, n)

    def _armed_round(self):
        """The round a gradient arriving now belongs to: the current one, a new one when the reduction
        is armed and none runs, None when it is not armed (the gradient accumulates locally). A gradient
        after the round's end-of-backward fill, or from a backward inside ``no_sync()`` while a round
        runs, would land in slices already averaged: RuntimeError."""
        r = self._round
        if r is None:
            if self.arm.accumulate_grads:
                return None
            r = self._round = _Round(len(self._slots), list(self._sizes))
        elif r.ended or self.arm.accumulate_grads:
            raise RuntimeError(_WRITTEN_AGAIN)
        return r

    def _folded(self, r: _Round, n: int):
        """Bucket ``n`` is folded: launch it and every complete bucket after it, when it is next in order."""
        r.pending[n] = 0
        if n == r.next:
            r.early += self._launch_ready(r)

    def _enter_task(self, r: _Round, task: int):
        """The round's first gradient from autograd graph task ``task``: queue the end-of-backward
        callback there (a reentrant backward, as activation checkpointing runs, is a task of its own)."""
        if task in r.tasks:
            return
        r.tasks.add(task)
        try:
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_of_backward(r))
        except RuntimeError:  # not inside an autograd backward: finish() does the rest
            pass

    def _events(self):
        """The C++ hooks' callback (csrc/torch/grad_buckets.cpp), holding the reducer weakly (see
        :meth:`_hook`). The hooks keep the per-parameter state; the round's ``pending`` here is per
        bucket (zero once folded) and its ``done`` is not used."""
        me = weakref.ref(self)

        def on_event(kind: int, value: int):
            reducer = me()
            if reducer is None:
                return False
            if kind == 0:  # the first gradient of graph task `value`: is the round armed for it?
                r = reducer._armed_round()
                if r is None:
                    return False
                reducer._enter_task(r, value)
                return True
            reducer._folded(reducer._round, value)  # kind 1: bucket `value` is complete and folded
            return True

        return on_event

    @torch.no_grad()
    def _fold(self, n: int):
        """Bucket ``n`` is complete: write its parameters' gradients into its range of the flat
        buffer (one multi-tensor copy; zero without a gradient), divide the range by the world size
        in one kernel, and make every ``p.grad`` its view (the tensors autograd produced are freed)."""
        bk = self.buckets[n]
        bk.buffer.adopt_grads(bk.members)
        bk.flat.div_(self.world_size)

    def _launch_ready(self, r: _Round) -> int:
        launched = 0
        buckets, pending = self.buckets, r.pending
        own, group = self._own, self.process_group
        while r.next < len(buckets) and pending[r.next] == 0:
            flat = buckets[r.next].flat
            if own is None:
                r.works.append(dist.all_reduce(flat, group=group, async_op=True))
            elif self._peer is not None:  # the other rank's part, into its inbox, from our copy stream
                self._peer.send(r.next)
            else:  # in place: the output is this rank's part of the input
                r.works.append(dist.reduce_scatter_tensor(own[r.next], flat, group=group, async_op=True))
            r.next += 1
            launched += 1
        return launched

    def _end_of_backward(self, r: _Round):
        if self._round is not r or r.ended or _autograd_node() is not None:
            return  # a reentrant backward ended inside the outer one, which goes on
        self._fill_rest(r)

    @torch.no_grad()
    def _fill_rest(self, r: _Round):
        """Fold the buckets that are not complete (their parameters whose hook did not fire get zero
        without a gradient, the gradient divided by the world size otherwise, as on the synchronous
        path) and launch every bucket not launched yet."""
        s = missed = 0
        for n, size in enumerate(self._sizes):
            if r.pending[n]:  # not folded yet (a complete bucket was folded by its last hook)
                if self._native is not None:  # the C++ hooks know which parameters are done
                    missed += self._native.fold(n)
                else:
                    for slot in range(s, s + size):
                        if not r.done[slot]:
                            buf, i, _ = self._slots[slot]
                            missed += buf.params[i].requires_grad
                            r.done[slot] = 1
                    self._fold(n)
                r.pending[n] = 0
            s += size
        self._launch_ready(r)
        r.ended = True
        if self._native is not None:
            self._native.end()
        if missed and not self._told_missed:
            self._told_missed = True
            logger.info(
                "ls_adam: %d trainable parameter(s) got no gradient in a backward pass; the bucket holding "
                "the first of them and all buckets after it were all-reduced after the backward (said once)",
                missed,
            )

    # ----------------------------------------------------------------- finish
    @property
    def in_flight(self) -> bool:
        """Whether an armed backward has started a round that :meth:`finish` has not closed."""
        return self._round is not None

    def finish(self) -> bool:
        """Close the current round: complete it if the backward's end did not (every bucket gets
        launched) and wait for its collectives. Returns False when no armed backward ran since
        the last call (nothing was reduced: the caller reduces synchronously)."""
        r = self._round
        if r is None:
            return False
        try:
            if not r.ended:
                self._fill_rest(r)
            for w in r.works:
                w.wait()
            if self._peer is not None:
                self._peer.receive(self._own, self.process_group)
        finally:
            self._round = None
            if self._native is not None:
                self._native.reset()
        return True


class _PeerCopies:
    """The state of :meth:`OverlappedReducer.use_peer_copies`: per round parity (even rounds use the
    receiver's own range of its inbox, odd rounds the other range) ``incoming[parity][n]`` (what the other
    rank copied for our part of bucket n) and ``outgoing[parity][n]`` (where our copy of its part goes,
    that part). CPU tensors (tests with gloo and shared memory) copy synchronously, without a stream."""

    __slots__ = ("stream", "incoming", "outgoing", "flag", "keep", "rounds")

    def __init__(self, device: torch.device, incoming, outgoing, keep):
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self.incoming, self.outgoing, self.keep = incoming, outgoing, keep
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)
        self.rounds = 0  # rounds received (their parity picks the inbox half)

    def send(self, n: int):
        """Copy bucket ``n``'s part of the other rank into its inbox (after the work queued so far)."""
        dst, src = self.outgoing[self.rounds % 2][n]
        if self.stream is None:
            dst.copy_(src)
            return
        self.stream.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src)

    def receive(self, own: List[torch.Tensor], group):
        """Wait (on the GPU) until both ranks' copies are done, then add the inbox to the owned parts
        ``own``. The copies of this rank are on its copy stream, which the current stream waits for before
        it enters a one-element all-reduce; the other rank enters it after its own copies. So past it this
        round's half of the inbox holds the other rank's parts of this update."""
        if self.stream is not None:
            torch.cuda.current_stream(self.flag.device).wait_stream(self.stream)
        dist.all_reduce(self.flag, group=group)
        torch._foreach_add_(own, self.incoming[self.rounds % 2])
        self.rounds += 1


__all__ = ["Bucket", "DEFAULT_BUCKET_MB", "OverlappedReducer", "SHARD_ALIGN_ELEMENTS", "bucket_order", "plan_buckets",
           "shardable"]
