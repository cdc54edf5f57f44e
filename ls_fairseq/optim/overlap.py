"""The backward-time part of the overlapped gradient reduction, shared by its strategies.

Without it the gradients of a :class:`~ls_fairseq.optim.workspace.FlatWorkspace` are averaged after the
backward pass: one all-reduce per flat gradient buffer that nothing runs beside.
:class:`OverlappedReducer` starts the reduction while the backward is still running; its subclasses
(:mod:`ls_fairseq.optim.reduction_strategies`) pick the collective of a complete bucket. Buckets, hooks,
the end of the backward, arming and the second-backward check: docs/optimizer.md, section
"Overlapped reduction: buckets and hooks".
"""

import logging
import weakref
from typing import List, Sequence, Tuple

import torch

from ls_fairseq import _ext
from ls_fairseq.optim.buckets import Bucket
from ls_fairseq.optim.workspace import FlatBuffer

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
    "checkpoint (checkpoint with use_reentrant=False instead)."
)


def _grad_buckets_class():
    """The extension's C++ hooks (``ls_fairseq._C.GradBuckets``), or None where it has none."""
    return getattr(_ext.get(), "GradBuckets", None)


# the running autograd graph task, and the node being evaluated (None outside any backward, also in
# the end-of-backward callback of an outermost backward; in a reentrant backward's it is the outer node)
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: 0)
_autograd_node = getattr(torch._C, "_current_autograd_node", lambda: None)


class OverlappedReducer:
    """Reduce the gradients in ``buckets`` (:func:`~ls_fairseq.optim.buckets.bucket_order`) over
    ``group`` of ``world_size`` ranks during the backward pass; a subclass says how (``_launch``).

    ``arm`` is any object with a boolean ``accumulate_grads`` (fairseq's legacy DDP wrapper):
    hooks act only while it is False. ``after_backward`` (a
    :class:`~ls_fairseq.optim.reduction_strategies.ReduceAfterBackward`) reduces an update whose backward
    did not arm the hooks. Install once; :meth:`reduce` (or :meth:`finish`) after each armed backward;
    :meth:`remove` takes the hooks off again.
    """

    def __init__(self, buckets: Sequence[Bucket], world_size: int, group, arm, after_backward):
        if world_size < 2:
            raise ValueError("overlapped all-reduce: needs a world size of at least 2")
        self.buckets = list(buckets)
        self.world_size = world_size
        self.group = group
        self.arm = arm
        self.after_backward = after_backward
        # one slot per (buffer, parameter), numbered bucket by bucket
        self._slots: List[Tuple[FlatBuffer, int, int]] = []  # slot -> (buffer, index, bucket)
        self._sizes = []
        for n, bk in enumerate(self.buckets):
            for i in bk.members:
                self._slots.append((bk.buffer, i, n))
            self._sizes.append(len(bk.members))
        self._round = None
        self._told_missed = False
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

    @property
    def native_hooks(self) -> bool:
        """Whether the hooks are the extension's C++ ones (else Python post-accumulate-grad hooks)."""
        return self._native is not None

    # ------------------------------------------------------------------ what a strategy provides
    def _launch(self, n: int):
        """Start the collective of bucket ``n`` (complete, divided by the world size); return its work
        (``finish`` waits for it), or None when there is nothing to wait for."""
        raise NotImplementedError

    def _settle(self) -> None:
        """After the round's collectives were waited for."""

    # ------------------------------------------------------------------ the interface
    def reduce(self) -> None:
        """Wait for the collectives this update's backward started; where no armed backward ran since
        the last call, reduce after the backward instead."""
        if not self.finish():
            self.after_backward.reduce()

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
        """Launch bucket ``r.next`` and every one after it that is complete, in the global order."""
        launched = 0
        buckets, pending = self.buckets, r.pending
        while r.next < len(buckets) and pending[r.next] == 0:
            work = self._launch(r.next)
            if work is not None:
                r.works.append(work)
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
        the last call (nothing was reduced: :meth:`reduce` reduces after the backward)."""
        r = self._round
        if r is None:
            return False
        try:
            if not r.ended:
                self._fill_rest(r)
            for w in r.works:
                w.wait()
            self._settle()
        finally:
            self._round = None
            if self._native is not None:
                self._native.reset()
        return True


__all__ = ["OverlappedReducer"]
