"""ls_adam's flat gradient buffers as the CUDA-graph step writes them.

A captured backward cannot hand its gradients to autograd's accumulation at replay time: the
addresses it writes are fixed at capture. The graph step therefore captures, per bucket, the
backward with every body parameter's ``p.grad`` unset (autograd then leaves each gradient as a
tensor of the graph pool, without an addition kernel), followed by one of two small graphs that
move those tensors into ls_adam's flat gradient buffer with one multi-tensor operation:

* ``copy`` for the first micro-batch of an update: the buffer is not zeroed beforehand, the copy
  overwrites each parameter's slice (and zeroes the slices of parameters the body does not reach);
* ``add`` for the later micro-batches of ``--update-freq``.

The head (vocabulary projection and loss) runs eagerly between the forward and the backward replay
and accumulates into the output projection's slice as autograd does, so that slice alone is zeroed
at the start of each update. A micro-batch that takes the eager step adds into the buffers, so they
are zeroed first (:meth:`GraphGrads.make_zero`).
"""

from typing import List, Tuple

import torch


class GraphGrads:
    """The gradient side of :class:`~ls_fairseq.fairseq_ext.graph_step.GraphStep` (module docstring)."""

    def __init__(self, model, world_size: int = 1):
        self.model = model
        self.world_size = world_size
        self.ls_adam = None
        self._views = None  # ([(param, view)] of the head, the same of the body), for ls_adam
        self.fresh = False  # the buffers hold the last update's values, which the next copy overwrites

    # ------------------------------------------------------------------ per update
    def begin_update(self, ls_adam) -> None:
        """Before an update's micro-batches (in place of ``ls_adam.zero_grad(in_place=True)``): every
        ``p.grad`` becomes its view of ls_adam's flat gradient buffers and only the head's slices are
        zeroed.

        With several GPUs ls_adam all-reduces those buffers after the last micro-batch's backward,
        between graph launches: the hooks that overlap the reduction with the backward would run only
        while a graph is captured, not when it is replayed. (The graphed micro-batches skip the DDP
        wrapper's ``no_sync()``; under legacy_ddp that only tells the reduction to wait, and the
        reduction runs once per update, after all of them.)"""
        ls_adam.zero_grad(in_place=True, fill=False)
        if self.world_size > 1:
            ls_adam.reduce_after_backward_only("the CUDA-graph step replays the backward, where hooks do not run")
        if ls_adam is not self.ls_adam:
            self.ls_adam, self._views = ls_adam, None
        head, _ = self.views()
        if head:
            torch._foreach_zero_([v for _, v in head])
        self.fresh = True

    def make_zero(self) -> None:
        """Zero the buffers if no micro-batch has written them in this update (before an eager
        micro-batch, and after the last micro-batch)."""
        if self.fresh and self.ls_adam is not None:
            self.fresh = False
            for buf in self._buffers():
                buf.grad.zero_()

    def attached(self) -> bool:
        """Whether :meth:`begin_update` ran and the head's parameters still have their flat views as
        ``p.grad`` (an OOM's ``zero_grad`` unsets them)."""
        if self.ls_adam is None:
            return False
        head, _ = self.views()
        return all(p.grad is not None and p.grad.data_ptr() == v.data_ptr() for p, v in head)

    # ------------------------------------------------------------------ capture and replay
    def detach_body(self) -> None:
        """Unset every body parameter's ``p.grad`` (before capturing a backward)."""
        for p, _ in self.views()[1]:
            p.grad = None

    def reattach_body(self) -> None:
        """Every body parameter's ``p.grad`` is its flat view again."""
        for p, v in self.views()[1]:
            p.grad = v

    def capture_writes(self, pool) -> Tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]:
        """(copy, add) graphs moving the gradients that the backward just captured left in the pool into
        the flat buffers (call on the capture stream, right after the backward's capture); the body's
        ``p.grad`` are the flat views again afterwards."""
        _, body = self.views()
        dst = [v for p, v in body if p.grad is not None]
        src = [p.grad for p, _ in body if p.grad is not None]
        unreached = [v for p, v in body if p.grad is None]
        copy, add = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        try:
            copy.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                if dst:
                    torch._foreach_copy_(dst, src)
                if unreached:
                    torch._foreach_zero_(unreached)
            finally:
                copy.capture_end()
            add.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                if dst:
                    torch._foreach_add_(dst, src)
            finally:
                add.capture_end()
        finally:
            self.reattach_body()  # the pool's gradient tensors belong to the graphs from here on
        return copy, add

    def replay_write(self, copy, add) -> None:
        """After a bucket's backward replay: its gradients into the flat buffers."""
        (copy if self.fresh else add).replay()
        self.fresh = False

    # ------------------------------------------------------------------ views
    def _buffers(self):
        return [buf for ws in self.ls_adam._optimizer.workspaces for buf in ws.buffers]

    def views(self) -> Tuple[List[Tuple[torch.Tensor, torch.Tensor]], List[Tuple[torch.Tensor, torch.Tensor]]]:
        """([(parameter, gradient view)] of the head's parameters, the same of all others), for ls_adam's
        buffers (made once per ls_adam: a buffer hands out the same views for its lifetime)."""
        if self._views is None:
            head_ids = {id(p) for p in self.model.decoder.output_projection.parameters()}
            head, body = [], []
            for buf in self._buffers():
                for i, p in enumerate(buf.params):
                    if p.numel() == 0:
                        continue
                    (head if id(p) in head_ids else body).append((p, buf.grad_view(i)))
            self._views = (head, body)
        return self._views
