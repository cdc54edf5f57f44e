"""The statistics of a training update, as fairseq's loop reads them.

* :class:`DeferredLoggingOutput`: the dictionary ``train_step`` returns, computed from the step's
  meters when something first reads it (it may settle an update still on the GPU first);
* :class:`SummedLogs` and :meth:`StepStats.sum_on_device`: with several ranks, the logging outputs and
  the sample size summed across ranks in one all-reduce on the device, read back on the host only when
  the update is settled;
* :meth:`StepStats.log`: what fairseq's ``_reduce_and_log_stats`` logs for one update.
"""

import logging
import math
from collections.abc import Mapping

import torch
from fairseq import metrics
from fairseq.distributed import utils as distributed_utils

logger = logging.getLogger("fairseq.trainer")  # fairseq's own logger: the same lines as its Trainer


class DeferredLoggingOutput(Mapping):
    """The dictionary ``train_step`` returns, computed from the step's meters on first read.

    ``resolve`` (optional) is called first: it settles a step whose outcome is still on the GPU.
    A step that overflowed has no statistics (fairseq returns None for it): the mapping is empty."""

    def __init__(self, agg=None, sample_size=None, resolve=None):
        self._agg = agg
        self._sample_size = sample_size
        self._resolve = resolve
        self._values = None

    def settle(self, agg, sample_size):
        """The settled update's aggregator and sample size (None, None: it overflowed and logs nothing)."""
        self._agg, self._sample_size = agg, sample_size

    def _get(self):
        if self._values is None:
            if self._resolve is not None:
                resolve, self._resolve = self._resolve, None
                resolve()
            values = {}
            if self._agg is not None:
                values = self._agg.get_smoothed_values()
                values["sample_size"] = self._sample_size
                for key in ("ppl", "wps", "wpb", "bsz"):
                    values.pop(key, None)
            self._values = values
            self._agg = None
        return self._values

    def __getitem__(self, key):
        return self._get()[key]

    def __iter__(self):
        return iter(self._get())

    def __len__(self):
        return len(self._get())

    def __repr__(self):
        return repr(self._get())


class SummedLogs:
    """Where each summed logging output sits in the all-reduced statistics buffer; ``read`` turns
    the host copy of that buffer into fairseq's one-element list of logging outputs (Python
    numbers, or CPU tensors for outputs with more than one element)."""

    def __init__(self, layout):
        self.layout = layout  # (key, start, shape)

    def read(self, values):
        out = {}
        for key, start, shape in self.layout:
            if shape == ():
                out[key] = values[start]
            else:
                n = math.prod(shape)
                out[key] = torch.tensor(values[start:start + n], dtype=torch.double).view(shape)
        return [out]


class StepStats:
    """The statistics of an update: summed across the ranks of ``group()`` on ``device``, logged through
    ``task.reduce_metrics`` with ``criterion`` as fairseq logs them."""

    def __init__(self, task, criterion, device, group):
        self.task = task
        self.criterion = criterion
        self.device = device
        self.group = group  # () -> the data-parallel process group (fairseq makes it lazily)
        self.warned = set()

    def sum_on_device(self, logging_outputs, *extra_stats, ignore=False):
        """fairseq's _fast_stat_sync_sum without host waits: one all-reduce of a double buffer on the
        device; host numbers reach it through pinned memory.

        Returns the summed ``extra_stats`` as device tensors, the summed buffer and a
        :class:`SummedLogs` that rebuilds the summed logging outputs from a host copy of that
        buffer. The logging outputs are read only when the update is settled, from host numbers:
        as device tensors, fairseq's meters would test their weights (``n > 0``) on the host and
        wait for the GPU at every update."""
        entries = [(True, i, stat) for i, stat in enumerate(extra_stats)]  # (extra stat?, index or key, value)
        if logging_outputs:
            for k in logging_outputs[0].keys():
                if not ignore:
                    v = sum(log[k] for log in logging_outputs if k in log)
                else:
                    v = logging_outputs[0][k]
                    v = torch.zeros_like(v) if torch.is_tensor(v) else 0
                entries.append((False, k, v))

        def on_device(v):
            return torch.is_tensor(v) and v.device.type == self.device.type

        host = [e for e in entries if not on_device(e[2])]
        dev = [e for e in entries if on_device(e[2])]
        parts = []
        if host:
            host_vals = torch.tensor([float(v) for _, _, v in host], dtype=torch.double)
            if self.device.type == "cuda":
                host_vals = host_vals.pin_memory().to(self.device, non_blocking=True)
            parts.append(host_vals)
        parts += [v.detach().to(torch.double).reshape(-1) for _, _, v in dev]
        buf = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.double, device=self.device)
        distributed_utils.all_reduce(buf, group=self.group())
        stats, layout, pos = [None] * len(extra_stats), [], 0
        for is_stat, key, v in host + dev:  # the order of buf
            shape = tuple(v.shape) if on_device(v) else ()
            if is_stat:
                stats[key] = buf[pos:pos + math.prod(shape)].view(shape)
            else:
                layout.append((key, pos, shape))
            pos += math.prod(shape)
        return stats, buf, (SummedLogs(layout) if logging_outputs else None)

    def log(self, logging_outputs, grad_norm, clip):
        """What fairseq's _reduce_and_log_stats logs for one update; returns the step's aggregator."""
        if grad_norm is not None:
            metrics.log_speed("ups", 1.0, priority=100, round=2)
            metrics.log_scalar("gnorm", grad_norm, priority=400, round=3)
            if clip > 0:
                if torch.is_tensor(grad_norm):
                    clipped = torch.where(grad_norm > clip, grad_norm.new_tensor(100), grad_norm.new_tensor(0))
                else:
                    clipped = 100.0 if grad_norm > clip else 0.0
                metrics.log_scalar("clip", clipped, priority=500, round=1)
        with metrics.aggregate() as agg:
            if logging_outputs is not None:
                self.task.reduce_metrics(logging_outputs, self.criterion)
            if "loss" not in agg:
                if "loss" not in self.warned:
                    self.warned.add("loss")
                    logger.warning("the criterion's reduce_metrics logged no 'loss'; logging -1 in its place "
                                   "(progress lines and best-checkpoint selection read it)")
                metrics.log_scalar("loss", -1)
        return agg
