"""A flat, contiguous workspace for a list of parameters.

For every (device, dtype) among the parameters the workspace owns one contiguous ``param`` buffer
(every ``p.data`` a view of its slice), one ``grad`` buffer of the same dtype, fp32 ``master``
weights (``param`` itself for fp32; split into the weights and an int16 rest for bf16) and the fp32
moments ``exp_avg``, ``exp_avg_sq``. :meth:`FlatWorkspace.sync` detects and repairs views broken
from outside before an optimizer step. Layout, alignment and the repairs: docs/optimizer.md,
section "The flat workspace".
"""

import logging
from collections import OrderedDict
from typing import Dict, Iterable, List, Tuple

import torch

from ls_fairseq.ops.adam import join_master, split_master

logger = logging.getLogger(__name__)

ALIGN_BYTES = 256
LOW_PRECISION = (torch.float16, torch.bfloat16)
SUPPORTED = (torch.float32,) + LOW_PRECISION


def unique_params(params: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """Parameters in first-seen order, each once (tied weights appear a single time)."""
    seen, out = set(), []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


class FlatBuffer:
    """The buffers of one (device, dtype) group of parameters."""

    def __init__(self, params: List[torch.Tensor]):
        dtype, device = params[0].dtype, params[0].device
        self.dtype, self.device = dtype, device
        self.params = params
        self.shapes = [tuple(p.shape) for p in params]
        align = max(1, ALIGN_BYTES // params[0].element_size())
        self.offsets: List[Tuple[int, int]] = []
        n = 0
        for p in params:
            self.offsets.append((n, p.numel()))
            n += (p.numel() + align - 1) // align * align
        self.numel = n

        with torch.no_grad():
            self.param = torch.zeros(n, dtype=dtype, device=device)
            self.grad = torch.zeros(n, dtype=dtype, device=device)
            for p, (o, k) in zip(params, self.offsets):
                self.param[o:o + k].copy_(p.data.reshape(-1))
                if p.grad is not None:
                    self.grad[o:o + k].copy_(p.grad.reshape(-1))
            self.lo = None
            if dtype == torch.float32:
                self._master = self.param
            elif dtype == torch.bfloat16:
                self._master = None
                self.lo = torch.zeros(n, dtype=torch.int16, device=device)  # the master is the weights exactly
            else:
                self._master = self.param.float()
            self.exp_avg = torch.zeros(n, dtype=torch.float32, device=device)
            self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=device)
        self._attach_all()

    @property
    def has_separate_master(self) -> bool:
        return self._master is not self.param

    @property
    def split(self) -> bool:
        """Whether the fp32 master is split between ``param`` and ``lo`` (bf16 weights)."""
        return self.lo is not None

    @property
    def master(self) -> torch.Tensor:
        """The fp32 master weights: the buffer itself (fp32, fp16), or a joined copy of a split master (bf16)."""
        if self.split:
            return join_master(self.param, self.lo)
        return self._master

    @property
    def param_lp(self):
        """The low-precision copy adam_ rewrites after the update, or None for fp32."""
        return self.param if self.has_separate_master else None

    def adam_buffers(self, lo: int = 0, hi: int = None):
        """(the tensor ``adam_`` updates, its keyword arguments for the master's other parts) over [lo, hi)."""
        sl = slice(lo, hi)
        if self.split:
            return self.param[sl], {"param_lo": self.lo[sl]}
        lp = self.param_lp
        return self._master[sl], {"param_lp": None if lp is None else lp[sl]}

    def master_state(self, i: int, device=None) -> torch.Tensor:
        """Parameter i's fp32 master weights, shaped like it: a view of the master buffer, or for a split master
        a joined copy (on ``device``, default the buffer's)."""
        if not self.split:
            return self.slice(self._master, i)
        o, k = self.offsets[i]
        out = torch.empty(k, dtype=torch.float32, device=self.device if device is None else device)
        return join_master(self.param[o:o + k], self.lo[o:o + k], out=out).view(self.shapes[i])

    @torch.no_grad()
    def set_master_state(self, i: int, values: torch.Tensor) -> None:
        """Set parameter i's fp32 master weights to ``values`` (its weights follow for a split master; for an fp16
        master the caller copies the weights afterwards, as :meth:`LSAdam.load_state_dict` does)."""
        o, k = self.offsets[i]
        values = values.reshape(-1).to(device=self.device, dtype=torch.float32)
        if self.split:
            split_master(values, out=(self.param[o:o + k], self.lo[o:o + k]))
        else:
            self._master[o:o + k].copy_(values)

    def _reset_master(self, o: int, k: int) -> None:
        """After the weights [o, o + k) were written from outside: the master takes their values exactly."""
        if self.split:
            self.lo[o:o + k].zero_()
        elif self.has_separate_master:
            self._master[o:o + k].copy_(self.param[o:o + k])

    # ------------------------------------------------------------------ views
    def param_view(self, i: int) -> torch.Tensor:
        o, k = self.offsets[i]
        return self.param[o:o + k].view(self.shapes[i])

    def grad_view(self, i: int) -> torch.Tensor:
        """The view of parameter i's gradient slice (made once: sync hands it out every step)."""
        views = self.__dict__.get("_grad_views")
        if views is None:
            views = self._grad_views = [None] * len(self.params)
        v = views[i]
        if v is None:
            o, k = self.offsets[i]
            v = views[i] = self.grad[o:o + k].view(self.shapes[i])
        return v

    def slice(self, buf: torch.Tensor, i: int) -> torch.Tensor:
        o, k = self.offsets[i]
        return buf[o:o + k].view(self.shapes[i])

    def _attach(self, i: int):
        p = self.params[i]
        p.data = self.param_view(i)
        p.grad = self.grad_view(i)

    def _attach_all(self):
        for i in range(len(self.params)):
            self._attach(i)
        self._versions = [p._version for p in self.params]

    # ------------------------------------------------------------------- sync
    def sync(self, keep_grads: bool = True) -> int:
        """Repair broken views; returns how many parameters needed repair.

        With ``keep_grads`` a gradient tensor that is not our view is copied into the flat
        buffer (and a missing one zeroes its slice); without, views are only re-attached.
        The copies of one call go out as one multi-tensor copy (a handful of kernels for all
        parameters, not one each): after :meth:`FlatWorkspace.zero_grad` every gradient is a
        fresh tensor that autograd handed over without an accumulation kernel.
        """
        fast = self._sync_fast(keep_grads)
        if fast is not None:
            return fast
        return self._sync_each(keep_grads)

    def _expected(self):
        """(indices of the non-empty parameters, their expected weight addresses, their gradient
        views, the views' addresses, their shapes), for the current weight and gradient buffers."""
        key = (self.param.data_ptr(), self.grad.data_ptr())
        cached = self.__dict__.get("_expected_cache")
        if cached is not None and cached[0] == key:
            return cached[1]
        esize = self.param.element_size()
        idx = [i for i, (_, k) in enumerate(self.offsets) if k > 0]
        views = [self.grad_view(i) for i in idx]
        out = (idx, [key[0] + self.offsets[i][0] * esize for i in idx], views, [v.data_ptr() for v in views],
               [torch.Size(self.shapes[i]) for i in idx])
        self._expected_cache = (key, out)
        return out

    def _sync_fast(self, keep_grads: bool):
        """:meth:`sync` for the usual states, with list-wide comparisons instead of a Python pass
        per parameter (a step calls it once, and a Python pass per parameter is host time the step
        waits for): every weight is still its view and unchanged
        from outside, and every gradient is its view, None or a fresh tensor of autograd.
        Returns the repair count, or None when :meth:`_sync_each` must look at each parameter."""
        idx, ptrs, views, view_ptrs, shapes = self._expected()
        params = [self.params[i] for i in idx] if len(idx) != len(self.params) else self.params
        if [p.data_ptr() for p in params] != ptrs or [p.shape for p in params] != shapes:
            return None
        dtype = self.dtype
        if any(p.dtype != dtype for p in params):
            return None
        versions = [p._version for p in self.params]
        if self.has_separate_master and versions != self._versions:
            return None
        grads = [p.grad for p in params]
        if [g.data_ptr() if g is not None else -1 for g in grads] == view_ptrs:
            return 0  # every gradient is its view (autograd accumulated into them)
        if any(g is not None and (g.is_sparse or g.dtype != dtype) for g in grads):
            return None
        with torch.no_grad():
            pending, repaired = self._attach_grad_views(params, grads, views, view_ptrs)
            if keep_grads:
                self._write(pending)
        self._versions = versions
        return repaired

    @staticmethod
    def _attach_grad_views(params, grads, views, view_ptrs):
        """Make each ``p.grad`` that is not yet its view (address in ``view_ptrs``) the view; returns
        (copy destinations, copy sources, slices to zero) that keep the gradients' values, and how many
        views were attached. The gradients must be dense and of the buffer's dtype, or None."""
        copy_dst, copy_src, zero_dst = [], [], []
        attached = 0
        for p, g, v, vp in zip(params, grads, views, view_ptrs):
            if g is not None and g.data_ptr() == vp:
                continue
            if g is None:
                zero_dst.append(v)
            else:
                copy_dst.append(v)
                copy_src.append(g)
            p.grad = v
            attached += 1
        return (copy_dst, copy_src, zero_dst), attached

    def _sync_each(self, keep_grads: bool) -> int:
        """:meth:`sync`, one parameter at a time (handles every state)."""
        repaired = 0
        base_p = self.param.data_ptr()
        esize = self.param.element_size()
        pending = ([], [], [])  # copy destinations, copy sources, slices to zero
        with torch.no_grad():
            for i, p in enumerate(self.params):
                o, k = self.offsets[i]
                if k == 0:
                    continue  # an empty parameter has no storage to compare
                fixed = False
                if p.data_ptr() != base_p + o * esize or p.dtype != self.dtype or tuple(p.shape) != self.shapes[i]:
                    # p.data was replaced: the new values are the truth for both copies
                    if tuple(p.shape) != self.shapes[i]:
                        raise RuntimeError(
                            f"flat workspace: parameter {i} changed shape to {tuple(p.shape)}; "
                            "rebuild the optimizer after resizing parameters"
                        )
                    self.param[o:o + k].copy_(p.data.reshape(-1))
                    self._reset_master(o, k)
                    p.data = self.param_view(i)
                    fixed = True
                elif self.has_separate_master and p._version != self._versions[i]:
                    # written in place from outside (e.g. Module.load_state_dict): refresh the master
                    self._reset_master(o, k)
                    fixed = True
                if self._adopt_grad(i, pending if keep_grads else None):
                    fixed = True
                self._versions[i] = p._version
                repaired += int(fixed)
            self._write(pending)
        return repaired

    @torch.no_grad()
    def adopt_grads(self, indices) -> None:
        """Make ``p.grad`` of every parameter in ``indices`` its view of the flat buffer: a gradient
        tensor that is not the view is copied in (one multi-tensor copy for all), a missing one
        zeroes its slice (the overlapped reduction folds a complete bucket so)."""
        if self._adopt_fresh(indices):
            return
        pending = ([], [], [])
        for i in indices:
            self._adopt_grad(i, pending)
        self._write(pending)

    def _adopt_fresh(self, indices) -> bool:
        """:meth:`adopt_grads` where every parameter in ``indices`` has a fresh,
        dense gradient of the buffer's dtype (autograd's, after zero_grad) or none: list-wide, without
        the per-parameter calls of the general path (an overlapped reduction adopts every bucket in
        the backward, where the host is often the bottleneck). Returns False, having changed
        nothing, when some gradient is in another state."""
        params = self.params
        ps = [params[i] for i in indices]
        grads = [p.grad for p in ps]
        dtype = self.dtype
        for g in grads:
            if g is not None and (g.is_sparse or g.dtype != dtype):
                return False
        views = [self.grad_view(i) for i in indices]
        view_ptrs = [v.data_ptr() for v in views]
        if any(g is not None and g.data_ptr() == vp for g, vp in zip(grads, view_ptrs)):
            return False  # some gradients already are their views: the general path
        pending, _ = self._attach_grad_views(ps, grads, views, view_ptrs)
        self._write(pending)
        return True

    def _adopt_grad(self, i: int, pending) -> bool:
        """Attach parameter i's gradient view unless ``p.grad`` already is it; with ``pending``
        (copy destinations, copy sources, slices to zero) queue what keeps its value. Returns whether
        the view had to be attached."""
        p = self.params[i]
        g, view = p.grad, self.grad_view(i)
        if g is not None and g.data_ptr() == view.data_ptr() and g.dtype == self.dtype:
            return False
        if pending is not None:
            if g is None:
                pending[2].append(view)
            else:
                pending[0].append(view)
                pending[1].append(g.to_dense() if g.is_sparse else g)
        p.grad = view
        return True

    @staticmethod
    def _write(pending):
        copy_dst, copy_src, zero_dst = pending
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        if zero_dst:
            torch._foreach_zero_(zero_dst)

    def mark_params_written(self):
        """Record parameter versions after the optimizer wrote the buffers itself."""
        self._versions = [p._version for p in self.params]

    @torch.no_grad()
    def move_params_to(self, storage: torch.Tensor, keep_alive=None) -> None:
        """Make ``storage`` (same length, dtype and device) the weight buffer: it receives the current
        weights and every ``p.data`` becomes a view of it (fp32 weights stay their own master).
        ``keep_alive``: an object kept as long as this buffer (say, the handle of a peer mapping)."""
        if storage.shape != (self.numel,) or storage.dtype != self.dtype or storage.device != self.device:
            raise ValueError(f"flat workspace: a new weight buffer must be a {self.dtype} vector of {self.numel} "
                             f"elements on {self.device}, got {storage.dtype} {tuple(storage.shape)} on "
                             f"{storage.device}")
        if storage.data_ptr() != self.param.data_ptr():
            storage.copy_(self.param)
        if self._master is self.param:
            self._master = storage
        self.param = storage
        self.storage_owner = keep_alive
        for i, p in enumerate(self.params):
            p.data = self.param_view(i)
        self._versions = [p._version for p in self.params]


class FlatWorkspace:
    """Flat buffers for a list of parameters, one :class:`FlatBuffer` per (device, dtype)."""

    def __init__(self, params: Iterable[torch.Tensor]):
        params = unique_params(params)
        if not params:
            raise ValueError("flat workspace: empty parameter list")
        groups: "OrderedDict[Tuple[torch.device, torch.dtype], List[torch.Tensor]]" = OrderedDict()
        for p in params:
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"flat workspace: expected tensors, got {type(p).__name__}")
            if p.dtype not in SUPPORTED:
                raise TypeError(
                    f"flat workspace: parameter dtype {p.dtype} is not supported "
                    f"(supported: {', '.join(str(d) for d in SUPPORTED)})"
                )
            if p.is_sparse:
                raise TypeError("flat workspace: sparse parameters are not supported")
            groups.setdefault((p.device, p.dtype), []).append(p)
        self.params = params
        self.buffers: List[FlatBuffer] = [FlatBuffer(ps) for ps in groups.values()]
        self._index: Dict[int, Tuple[int, int]] = {}
        for b, buf in enumerate(self.buffers):
            for i, p in enumerate(buf.params):
                self._index[id(p)] = (b, i)
        logger.debug(
            "flat workspace: %s",
            ", ".join(f"{buf.dtype}x{buf.numel} on {buf.device}" for buf in self.buffers),
        )

    def locate(self, p: torch.Tensor) -> Tuple[FlatBuffer, int]:
        b, i = self._index[id(p)]
        return self.buffers[b], i

    def sync(self) -> int:
        """Repair every broken view (see :meth:`FlatBuffer.sync`); returns the repair count."""
        return sum(buf.sync() for buf in self.buffers)

    def zero_grad(self):
        """Set every ``p.grad`` to None (the flat buffers are refilled by the next :meth:`sync`).

        The backward then hands each parameter its fresh gradient tensor as is, where an
        existing ``p.grad`` view would cost one accumulation kernel per parameter; the next
        :meth:`sync` (the optimizer calls it before reading gradients) copies them all into
        the flat buffer at once and zeroes the slices of parameters that got no gradient.
        """
        for p in self.params:
            p.grad = None

    def mark_params_written(self):
        for buf in self.buffers:
            buf.mark_params_written()

    @property
    def numel(self) -> int:
        return sum(sum(k for _, k in buf.offsets) for buf in self.buffers)
