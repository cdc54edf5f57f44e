"""LSAdam: Adam over a flat workspace, one fused ``adam_`` call per dtype buffer.

fp16 / bf16 parameters are updated through fp32 master weights kept in the workspace (a bf16
master split into the weights and an int16 rest); gradient scaling and clipping are deferred
into the update's ``grad_scale``; the optimizer state can be sharded over data-parallel ranks,
with the weights' all-gathers waited for layer by layer in the next forward. How each of these
works, and the state dict's layout: docs/optimizer.md, section "LSAdam".
"""

import logging
from typing import Dict, List, Sequence

import torch
import torch.distributed as dist

from ls_fairseq.ops import adam_, grad_norm as flat_grad_norm
from ls_fairseq.ops.adam import MODES
from ls_fairseq.optim.shard import Shard
from ls_fairseq.optim.workspace import FlatWorkspace, unique_params

logger = logging.getLogger(__name__)


def check_hyperparams(lr, betas, eps, weight_decay, mode="fairseq"):
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"adam betas must be two numbers, e.g. (0.9, 0.98); got {betas!r}") from None
    for name, b in (("beta1", b1), ("beta2", b2)):
        if not (0.0 <= b < 1.0):
            raise ValueError(f"adam {name} must be in [0, 1), got {b}")
    if not (float(lr) >= 0.0):
        raise ValueError(f"adam learning rate must be >= 0, got {lr}")
    if not (float(eps) >= 0.0):
        raise ValueError(f"adam eps must be >= 0, got {eps}")
    if not (float(weight_decay) >= 0.0):
        raise ValueError(f"adam weight decay must be >= 0, got {weight_decay}")
    if mode not in MODES:
        raise ValueError(f"adam mode must be one of {MODES}, got {mode!r}")
    return b1, b2


def _combined_norm(norms):
    """The L2 norm over several flat buffers from each one's norm (at least one), on the first one's device."""
    if len(norms) == 1:
        return norms[0]
    dev = norms[0].device
    return torch.stack([n.to(dev) for n in norms]).norm(2)


class LSAdam(torch.optim.Optimizer):
    """Adam with fairseq's formula (``mode="fairseq"``) or torch AdamW's (``mode="torch"``)."""

    supports_memory_efficient_fp16 = True  # keeps its own fp32 master weights
    supports_flat_params = True
    supports_step_with_scale = True
    # our state is fp32 by design: fairseq's memory-efficient wrapper must not re-insert it
    disable_mem_eff_fp16_loading_hack = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, mode="fairseq"):
        betas = check_hyperparams(lr, betas, eps, weight_decay, mode)
        params = list(params)
        if params and isinstance(params[0], dict):
            groups = [dict(g, params=unique_params(g["params"])) for g in params]
        else:
            groups = [{"params": unique_params(params)}]
        self._workspaces: List[FlatWorkspace] = []
        self._steps: List[int] = []
        self._grad_factor = 1.0
        self._shard = None   # a Shard while the state is sharded across data-parallel ranks
        self._stale = False  # the parts other ranks own are out of date here (consolidate first)
        self._gathers = {}   # bucket key -> all-gather in flight (deferred gathers)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, mode=mode)
        super().__init__(groups, defaults)

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_hyperparams(group["lr"], group["betas"], group["eps"], group["weight_decay"], group["mode"])
        self._workspaces.append(FlatWorkspace(group["params"]))
        self._steps.append(0)

    @property
    def workspaces(self) -> List[FlatWorkspace]:
        return self._workspaces

    # ------------------------------------------------------------ gradients
    def multiply_grads(self, c):
        """Multiply the gradients by ``c`` (deferred to the next step)."""
        self._grad_factor = self._grad_factor * c

    def grad_norm(self):
        """L2 norm of all gradients (pending factor included), fp32 0-dim tensor; inf/NaN propagate.

        Sharded: the norm of every rank's owned parts, combined by one all-reduce (collective)."""
        norms = []
        shard = self._shard
        self.wait_gathers()
        for ws in self._workspaces:
            ws.sync()
            for buf in ws.buffers:
                owned = shard.ranges.get(id(buf)) if shard is not None else None  # sharded: the owned parts
                norms.append(flat_grad_norm(buf.grad, ranges=owned))
        self._synced = True  # the next step() reads the buffers as this norm saw them
        total = _combined_norm(norms)
        if shard is not None:
            squares = total * total
            dist.all_reduce(squares, group=shard.group)
            total = squares.sqrt()
        f = self._grad_factor
        if torch.is_tensor(f) or f != 1.0:
            total = total * (f.abs() if torch.is_tensor(f) else abs(f))
        return total

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        """fairseq's ``clip_grad_norm_`` semantics, with the clip folded into the pending factor."""
        total = self.grad_norm()
        if aggregate_norm_fn is not None:
            total = aggregate_norm_fn(total)
        if max_norm > 0:
            clip_coef = (float(max_norm) / (total + 1e-6)).clamp_(max=1)
            self._grad_factor = self._grad_factor * clip_coef
        return total

    def zero_grad(self, set_to_none: bool = True, in_place: bool = False, fill: bool = True):
        """Clear the gradients: ``p.grad`` becomes None (``set_to_none`` is ignored); the flat
        buffers are refilled from the next backward's gradients when they are read. With
        ``in_place`` every ``p.grad`` is its view of the flat buffer instead, and the buffers are
        zeroed: the next backward adds into them (what a captured CUDA-graph backward needs, whose
        gradient writes are fixed to those addresses). ``fill=False`` (with ``in_place``) attaches
        the views but leaves the buffers as they are, for a caller that overwrites them itself."""
        for ws in self._workspaces:
            if in_place:
                for buf in ws.buffers:
                    buf.sync(keep_grads=False)
                    if fill:
                        buf.grad.zero_()
            else:
                ws.zero_grad()
        self._grad_factor = 1.0
        self._synced = False

    # ----------------------------------------------------------------- step
    @torch.no_grad()
    def step(self, closure=None, scale=1.0, with_norm=False):
        """One Adam step. Gradients are divided by ``scale`` (fairseq's step-with-scale).

        ``with_norm``: return the L2 norm of all gradients as they were before the step's factors (what
        :meth:`grad_norm` returns with no factor pending), summed in the update's own pass instead of one
        of its own; the update is then taken whatever the norm, so the caller tests it afterwards. Not with
        sharded state (each rank's update reads only the parts it owns)."""
        if with_norm and self._shard is not None:
            raise RuntimeError("ls_adam: step(with_norm=True) needs unsharded state; take grad_norm() first")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        norms = []
        grad_scale, factor = self._step_factor(scale)
        synced, self._synced = self.__dict__.get("_synced", False), False
        self.wait_gathers()  # the last step's gathers read the parts this step writes
        for gi, (group, ws) in enumerate(zip(self.param_groups, self._workspaces)):
            if not synced:  # grad_norm() (clipping, the overflow test) synced them just before
                ws.sync()
            self._steps[gi] += 1
            beta1, beta2 = group["betas"]
            works = []
            for buf in ws.buffers:
                dev_factor = None if factor is None else factor.to(buf.device)
                kw = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                          weight_decay=group["weight_decay"], step=self._steps[gi], grad_scale=grad_scale,
                          mode=group["mode"], grad_scale_tensor=dev_factor)
                parts = self._shard.parts.get(id(buf)) if self._shard is not None else None
                if parts is None:
                    target, extra = buf.adam_buffers()
                    norm = adam_(target, buf.grad, buf.exp_avg, buf.exp_avg_sq, with_norm=with_norm, **extra, **kw)
                    if with_norm:
                        norms.append(norm)
                    continue
                defer = self._shard.defer
                peer = self._shard.peers.get(id(buf)) if self._shard.peers else None
                if peer is not None:
                    # one launch for all owned parts; it writes them on the peer too, so nothing is gathered
                    target, extra = buf.adam_buffers()
                    adam_(target, buf.grad, buf.exp_avg, buf.exp_avg_sq, param_lp_peer=peer,
                          ranges=self._shard.ranges[id(buf)], **extra, **kw)
                    self._stale = True
                    continue
                for start, end, lo, hi in parts:
                    target, extra = buf.adam_buffers(lo, hi)
                    adam_(target, buf.grad[lo:hi], buf.exp_avg[lo:hi], buf.exp_avg_sq[lo:hi], **extra, **kw)
                    # the new weights of this bucket go out while Adam runs on the next one
                    work = dist.all_gather_into_tensor(buf.param[start:end], buf.param[lo:hi],
                                                       group=self._shard.group, async_op=True)
                    if defer:
                        self._gathers[(id(buf), start)] = work
                    else:
                        works.append(work)
                self._stale = True
            for w in works:
                w.wait()  # NCCL: the current stream waits; the host does not
            ws.mark_params_written()
        if self._shard is not None and self._shard.peers:
            # the peer's stores into our weights are done once its stream reaches this collective
            dist.all_reduce(self._shard.flag, group=self._shard.group)
        self._grad_factor = 1.0
        if with_norm:
            return _combined_norm(norms) if norms else torch.zeros((), dtype=torch.float32)
        return loss

    def _step_factor(self, scale):
        """(host float, device tensor or None) whose product multiplies the gradients in the step.

        A factor that is a tensor (a clip coefficient, a loss scale kept on the device) stays on the
        device and is read by the kernel: no host sync. A non-finite device factor skips the step."""
        f = self._grad_factor
        if not torch.is_tensor(f) and not torch.is_tensor(scale):
            return (f / scale if scale != 1.0 else f), None
        t = f if torch.is_tensor(f) else None
        host = 1.0 if t is not None else float(f)
        if torch.is_tensor(scale):
            t = (1.0 / scale) if t is None else t / scale
        elif scale != 1.0:
            host = host / scale
        return host, t.detach().reshape(()).float()

    def forget_last_step(self):
        """Take back the step count of the last :meth:`step` whose update the device skipped (its
        device factor was not finite): the bias corrections of the next step then use the same
        count, as if that step had never been taken."""
        self._steps = [max(0, s - 1) for s in self._steps]

    # ------------------------------------------------------------ sharding
    @property
    def sharded(self) -> bool:
        return self._shard is not None

    def shard_(self, buckets: Sequence, rank: int, world_size: int, group=None, peers=None) -> None:
        """Keep the optimizer state sharded over ``world_size`` data-parallel ranks from the next
        :meth:`step` on: this rank owns part ``rank`` of every bucket (:class:`~ls_fairseq.optim.shard.Shard`
        checks that the buckets tile every flat buffer). The gradients handed to the following steps must
        hold the average at least in the owned parts (a reduce-scatter of these buckets, or a full all-reduce).

        ``peers`` (two ranks; :func:`ls_fairseq.optim.peer.map_peer_weights`): ``{id(buffer): the
        other rank's copy of that buffer's weights, addressable from this device}``. The update then
        writes each owned part on both GPUs in the same kernel, and a one-element all-reduce at the
        end of :meth:`step` replaces the all-gathers."""
        buffers = [buf for ws in self._workspaces for buf in ws.buffers]
        shard = Shard(buckets, rank, world_size, group, buffers, peers)  # checked before anything changes
        if self._shard is not None:
            self.unshard_()
        self._shard = shard

    def bucket_key(self, p: torch.Tensor):
        """The key of the shard bucket holding parameter ``p`` (what :meth:`wait_gathers` takes), or
        None when the state is not sharded or ``p`` is not one of this optimizer's parameters."""
        shard = self._shard
        if shard is None:
            return None
        for ws in self._workspaces:
            try:
                buf, i = ws.locate(p)
            except KeyError:
                continue
            return shard.bucket_key(buf, buf.offsets[i][0])
        return None

    def defer_gathers(self, need: Dict) -> None:
        """From the next :meth:`step` on, leave its all-gathers in flight (see the module docstring)
        and update the buckets in the order of ``need[key]`` (smaller first; keys from
        :meth:`bucket_key`, missing keys last)."""
        if self._shard is None:
            raise RuntimeError("ls_adam: defer_gathers needs sharded state (shard_ first)")
        self._shard.order_by(need)

    def wait_gathers(self, keys=None) -> None:
        """Make the current stream wait for the deferred all-gathers of ``keys`` (all when None)."""
        pending = self._gathers
        if not pending:
            return
        if keys is None:
            works, self._gathers = list(pending.values()), {}
        else:
            works = [w for w in (pending.pop(k, None) for k in keys) if w is not None]
        for w in works:
            w.wait()

    @torch.no_grad()
    def consolidate_state_dict(self) -> None:
        """Collective (every rank of the shard group calls it): all-gather the master weights and
        moments that other ranks own, so that :meth:`state_dict` is complete on every rank. A no-op
        when nothing is stale."""
        self.wait_gathers()
        if self._shard is None or not self._stale:
            return
        works = []
        for ws in self._workspaces:
            ws.sync()
            for buf in ws.buffers:
                # a split master's upper halves are the weights, which every rank holds whole already; its int16
                # remainders travel as 2-byte bf16 (NCCL and gloo gather no int16; the gather copies bits)
                master = [buf.lo.view(torch.bfloat16)] if buf.split else \
                    [buf.master] if buf.has_separate_master else []
                kinds = [buf.exp_avg, buf.exp_avg_sq] + master
                for start, end, lo, hi in self._shard.parts.get(id(buf), ()):
                    for t in kinds:
                        works.append(dist.all_gather_into_tensor(t[start:end], t[lo:hi], group=self._shard.group,
                                                                 async_op=True))
        for w in works:
            w.wait()
        self._stale = False

    def unshard_(self) -> None:
        """Collective: consolidate, then keep the whole state on every rank again."""
        self.consolidate_state_dict()
        self._shard = None

    # ----------------------------------------------------------- state dict
    def state_dict(self):
        self.wait_gathers()
        if self._stale:
            raise RuntimeError(
                "ls_adam: the optimizer state is sharded across the data-parallel ranks and this rank holds "
                "only its own part; call consolidate_state_dict() on every rank first (fairseq's "
                "Trainer.consolidate_optimizer(), which checkpoint saving runs)")
        state, groups, idx = {}, [], 0
        for gi, (group, ws) in enumerate(zip(self.param_groups, self._workspaces)):
            ws.sync()
            ids = []
            for p in group["params"]:
                buf, i = ws.locate(p)
                entry = {
                    "step": self._steps[gi],
                    "exp_avg": buf.slice(buf.exp_avg, i),
                    "exp_avg_sq": buf.slice(buf.exp_avg_sq, i),
                }
                if buf.has_separate_master:  # a split master: a joined copy, on the CPU (it is saved from there)
                    entry["master"] = buf.master_state(i, device="cpu" if buf.split else None)
                state[idx] = entry
                ids.append(idx)
                idx += 1
            saved = {k: v for k, v in group.items() if k != "params"}
            saved["params"] = ids
            groups.append(saved)
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        self.wait_gathers()
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"ls_adam state dict has {len(saved_groups)} parameter groups, this optimizer has "
                f"{len(self.param_groups)}"
            )
        for gi, (group, sg, ws) in enumerate(zip(self.param_groups, saved_groups, self._workspaces)):
            if len(sg["params"]) != len(group["params"]):
                raise ValueError(
                    f"ls_adam state dict group {gi} has {len(sg['params'])} parameters, this optimizer has "
                    f"{len(group['params'])} (a different model?)"
                )
            ws.sync()  # absorb any outside change to the parameters first
            steps = set()
            for p, pid in zip(group["params"], sg["params"]):
                buf, i = ws.locate(p)
                entry = saved_state.get(pid, saved_state.get(str(pid)))
                if not entry:
                    buf.slice(buf.exp_avg, i).zero_()
                    buf.slice(buf.exp_avg_sq, i).zero_()
                    continue
                for key in ("exp_avg", "exp_avg_sq", "master"):
                    if key in entry and entry[key].numel() != p.numel():
                        raise ValueError(
                            f"ls_adam state dict: '{key}' of parameter {pid} has {entry[key].numel()} elements, "
                            f"the parameter has {p.numel()} (shape {tuple(p.shape)})"
                        )
                buf.slice(buf.exp_avg, i).copy_(entry["exp_avg"].reshape(p.shape))
                buf.slice(buf.exp_avg_sq, i).copy_(entry["exp_avg_sq"].reshape(p.shape))
                if "master" in entry:
                    buf.set_master_state(i, entry["master"])
                steps.add(int(entry["step"]))
            if len(steps) > 1:
                logger.warning("ls_adam: per-parameter step counts differ (%s); using the largest", sorted(steps))
            self._steps[gi] = max(steps) if steps else 0
            for k, v in sg.items():
                if k != "params":
                    group[k] = tuple(v) if k == "betas" else v
            for buf in ws.buffers:
                if buf.has_separate_master and not buf.split:
                    buf.param.copy_(buf.master)  # the low-precision weights follow the master
            ws.mark_params_written()
        self._grad_factor = 1.0
        self._synced = False
        self._stale = False  # every rank loaded the whole state

    @property
    def steps(self) -> List[int]:
        return list(self._steps)
