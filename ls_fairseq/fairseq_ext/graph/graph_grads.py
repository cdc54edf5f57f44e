"""ls_adam's flat gradient buffers as the CUDA-graph step writes them.

A captured backward cannot hand its gradients to autograd's accumulation at replay time: the
addresses it writes are fixed at capture. Each bucket's backward is therefore captured with the body
parameters' ``p.grad`` unset: the linear layers' weight-gradient GEMMs and the embedding tables'
backward write straight into each parameter's slice of the flat buffer, its *sink*
(csrc/torch/weight_grads.cpp), and the other gradients, which autograd hands over in the graph pool,
are moved there by one multi-tensor operation at the end of the capture. Two modes, chosen per update:
``write`` (one micro-batch: overwrite, no zeroing beforehand) and ``add`` (``--update-freq`` > 1: the
buffer zeroed when the update begins, then accumulated into); a bucket's graphs are captured again
when the mode changes. docs/graph_step.md ("Gradients") has the details.
"""

from typing import List, Tuple

import torch


class GraphGrads:
    """The gradient side of :class:`~ls_fairseq.fairseq_ext.graph.graph_step.GraphStep` (module docstring)."""

    def __init__(self, model, world_size: int = 1, sinks=None):
        self.model = model
        self.world_size = world_size
        # the module with set_weight_grad_sinks / take_weight_grad_sinks: ls_fairseq._C by default (absent:
        # no sinks, every gradient goes through the pool)
        self._sinks = sinks
        self.ls_adam = None
        self._views = None  # ([(param, view)] of the head, the same of the body), for ls_adam
        self.fresh = False  # the buffers hold the last update's values, which the next write overwrites
        self.mode = "write"  # this update's: "write" (one micro-batch) or "add" (several; module docstring)

    # ------------------------------------------------------------------ per update
    def begin_update(self, ls_adam, micro_batches: int = 1) -> None:
        """Before an update's micro-batches (in place of ``ls_adam.zero_grad(in_place=True)``): every
        ``p.grad`` becomes its view of ls_adam's flat gradient buffers; with one micro-batch only the
        head's slices are zeroed (``write`` mode), with several the whole buffers (``add`` mode).

        With several GPUs ls_adam all-reduces those buffers after the last micro-batch's backward,
        between graph launches: the hooks that overlap the reduction with the backward would run only
        while a graph is captured, not when it is replayed. (The graphed micro-batches skip the DDP
        wrapper's ``no_sync()``; under legacy_ddp that only tells the reduction to wait, and the
        reduction runs once per update, after all of them.)"""
        self.mode = "write" if micro_batches <= 1 else "add"
        ls_adam.zero_grad(in_place=True, fill=self.mode == "add")
        if self.world_size > 1:
            ls_adam.reduce_after_backward_only("the CUDA-graph step replays the backward, where hooks do not run")
        if ls_adam is not self.ls_adam:
            self.ls_adam, self._views = ls_adam, None
        if self.mode == "write":
            head, _ = self.views()
            if head:
                torch._foreach_zero_([v for _, v in head])
        self.fresh = self.mode == "write"

    def make_zero(self) -> None:
        """Zero the buffers if no micro-batch has written them in this update (before an eager
        micro-batch, and after the last micro-batch; in ``add`` mode they were zeroed at the start)."""
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
        """Before capturing a backward: unset every body parameter's ``p.grad`` and name its slice of the
        flat buffer as its weight gradient's sink, for this update's mode."""
        head, body = self.views()
        for p, _ in body:
            p.grad = None
        mod = self._sink_module()
        if mod is not None:
            sunk = [(p, v) for p, v in body if p.dim() == 2]
            mod.set_weight_grad_sinks([p for p, _ in sunk], [v for _, v in sunk], self.mode == "add")
            # the head's weight (with shared embeddings also the tables the body looks up): its slice holds the
            # head's part already, so the body's nodes add theirs there
            head_weights = [(p, v) for p, v in head if p.dim() == 2]
            if head_weights:
                mod.add_weight_grad_sinks([p for p, _ in head_weights], [v for _, v in head_weights])

    def take_sinks(self) -> set:
        """After capturing a backward (or when it failed): the data pointers of the parameters whose
        gradients the backward wrote into their sinks; no sinks from then on."""
        mod = self._sink_module()
        return set(mod.take_weight_grad_sinks()) if mod is not None else set()

    def _sink_module(self):
        if self._sinks is None:
            from ls_fairseq import _ext

            return _ext.get()
        return self._sinks

    def reattach_body(self) -> None:
        """Every body parameter's ``p.grad`` is its flat view again."""
        for p, v in self.views()[1]:
            p.grad = v

    def move_pool_grads(self, sunk: set) -> None:
        """Move the gradients that autograd just handed over in the pool into the flat buffers, for this
        update's mode; called inside the backward's capture, right after ``torch.autograd.backward``, so the
        moves are the last kernels of the backward graph (``sunk``: :meth:`take_sinks`' answer). ``write``: a
        copy, and the slices of parameters the body does not reach are zeroed; ``add``: an addition. The
        body's ``p.grad`` are the flat views again afterwards."""
        _, body = self.views()
        # in write mode a gradient adds to its slice where a sink already wrote part of it (a weight that a
        # node writing its sink and a node handing its gradient to autograd both use)
        add, copy = [], []
        for p, v in body:
            if p.grad is not None:
                (add if self.mode == "add" or p.data_ptr() in sunk else copy).append((v, p.grad))
        unreached = [v for p, v in body if p.grad is None and p.data_ptr() not in sunk]
        try:
            if copy:
                torch._foreach_copy_([d for d, _ in copy], [g for _, g in copy])
            if add:
                torch._foreach_add_([d for d, _ in add], [g for _, g in add])
            if unreached and self.mode == "write":
                torch._foreach_zero_(unreached)
        finally:
            self.reattach_body()  # the pool's gradient tensors belong to the graph from here on

    def can_replay(self, mode: str) -> bool:
        """Whether graphs captured for ``mode`` may write this micro-batch's gradients: ``write`` graphs
        overwrite, so only as the update's first writer."""
        return mode == self.mode and (mode == "add" or self.fresh)

    def replayed(self) -> None:
        """After a bucket's backward replay: the buffers hold this update's gradients."""
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
