"""``--optimizer ls_adam``: fairseq's Adam over a flat fused workspace.

Same flags and formula as fairseq's ``adam`` (--adam-betas, --adam-eps, --weight-decay,
--lr; decoupled weight decay, eps added to sqrt(v), bias corrections folded into the step
size), one fused update per dtype buffer.

It works under every fairseq precision mode:

* fp32: parameters are fp32 and are their own master weights.
* ``--fp16``: fairseq's FP16Optimizer hands us its flat fp32 copy; we step with the scale
  it passes (``supports_step_with_scale``), so unscaling costs no extra pass.
* ``--memory-efficient-fp16``: we get the fp16 parameters and gradients and keep fp32
  master weights ourselves (in the optimizer state, so checkpoints resume exactly); the
  wrapper's multiply_grads / clip factor is folded into the update, and
  :meth:`clip_grad_norm` returns the (possibly non-finite) gradient norm, which is what the
  wrapper's overflow check reads.

Sharded state. On several GPUs, once :meth:`LSFairseqAdam.request_sharding` was called (the
deferred step of ``lightseq-train`` does: by default, ``LS_FAIRSEQ_SHARD_ADAM=p2p``, only where the
ranks can write each other's weights; with ``=1`` always; ``=0`` keeps the whole state on every rank), the
overlapped gradient reduction becomes a reduce-scatter and each rank updates only its own part of the
state, then all-gathers the weights (:class:`~ls_fairseq.optim.adam.LSAdam`). On
two GPUs the update kernel writes the new weights into both GPUs' copies instead, through PyTorch
symmetric memory (:mod:`ls_fairseq.optim.peer`; ``LS_FAIRSEQ_SHARD_P2P=0`` keeps the all-gathers).
Checkpoints still hold the whole state: fairseq consolidates the optimizer on every rank before
saving, so they load on any number of GPUs. For models that allow it (``ls_gather_waits``, as
ls_transformer), the all-gathers of the new weights overlap the next forward pass, which waits
for them layer by layer (:mod:`ls_fairseq.optim.gather_waits`).
"""

import ast
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

from omegaconf import II, OmegaConf

from fairseq.dataclass import FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer

from ls_fairseq.fairseq_ext.wrappers import wrapper_chain
from ls_fairseq.optim.adam import LSAdam, check_hyperparams
from ls_fairseq.optim.overlap import DEFAULT_BUCKET_MB
from ls_fairseq import env

logger = logging.getLogger(__name__)


@dataclass
class LSAdamConfig(FairseqDataclass):
    adam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for Adam optimizer"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for Adam optimizer"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay (decoupled, as fairseq's adam)"})
    lr: List[float] = II("optimization.lr")
    # fairseq's --bucket-cap-mb: the bucket size of the all-reduce overlapped with the backward
    bucket_cap_mb: int = II("distributed_training.bucket_cap_mb")


def parse_betas(betas):
    """``"(0.9, 0.98)"`` / ``"0.9,0.98"`` / a sequence -> (beta1, beta2), with a clear error."""
    value = betas
    if isinstance(betas, str):
        text = betas.strip()
        try:
            value = ast.literal_eval(text if text[:1] in "([" else f"({text})")
        except (ValueError, SyntaxError):
            raise ValueError(f"--adam-betas must be two numbers like '(0.9, 0.98)', got {betas!r}") from None
    elif not isinstance(betas, (list, tuple)):
        value = OmegaConf.to_container(betas) if OmegaConf.is_config(betas) else betas
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise ValueError(f"--adam-betas must be two numbers like '(0.9, 0.98)', got {betas!r}")
    try:
        return check_hyperparams(0.0, value, 0.0, 0.0)
    except ValueError as e:
        raise ValueError(f"--adam-betas {betas!r}: {e}") from None


@register_optimizer("ls_adam", dataclass=LSAdamConfig)
class LSFairseqAdam(FairseqOptimizer):
    """fairseq's Adam (AdamW-style decoupled weight decay) on a flat fp32-master workspace."""

    def __init__(self, cfg: LSAdamConfig, params):
        super().__init__(cfg)
        self._optimizer = LSAdam(params, **self.optimizer_config)
        self._shard_requested = False
        ws = self._optimizer.workspaces
        logger.info(
            "ls_adam: %d parameters in %s",
            sum(w.numel for w in ws),
            ", ".join(f"{b.dtype} buffer of {b.numel}" for w in ws for b in w.buffers),
        )

    @property
    def optimizer_config(self):
        lr = self.cfg.lr[0] if isinstance(self.cfg.lr, Collection) else self.cfg.lr
        return {
            "lr": float(lr),
            "betas": parse_betas(self.cfg.adam_betas),
            "eps": float(self.cfg.adam_eps),
            "weight_decay": float(self.cfg.weight_decay),
        }

    # the fused path: scaling is deferred into the update, norms read the flat buffers
    def multiply_grads(self, c):
        self._optimizer.multiply_grads(c)

    def clip_grad_norm(self, max_norm, aggregate_norm_fn=None):
        return self._optimizer.clip_grad_norm(max_norm, aggregate_norm_fn)

    def step(self, closure=None, scale=1.0, groups=None):
        if not self.__dict__.get("_ls_trainer") and not self.__dict__.get("_said_trainer"):
            self._said_trainer = True
            if any(p.is_cuda for g in self._optimizer.param_groups for p in g["params"]):
                logger.info("ls_adam under fairseq's own Trainer (fairseq-train): the deferred step and the CUDA-graph "
                            "step of lightseq-train are not used; run lightseq-train with the same flags for them")
        self._optimizer.step(closure, scale=scale)

    def request_sharding(self, on=True):
        """Shard the optimizer state over the data-parallel ranks whenever the gradients are
        reduced from the backward pass in buckets that split evenly (from the update that installs
        the overlapped reduction on). ``on="p2p"``: only where the ranks can write each other's
        weights (two GPUs of one host, :func:`~ls_fairseq.optim.peer.map_peer_weights`); elsewhere
        every rank keeps the whole state. The caller must consolidate on every rank before it reads
        the state (fairseq's ``Trainer.consolidate_optimizer``)."""
        if on not in (True, False, "p2p"):
            raise ValueError(f"ls_adam: request_sharding takes True, False or 'p2p', not {on!r}")
        self._shard_requested = on

    @property
    def sharded(self) -> bool:
        return self._optimizer.sharded

    def zero_grad(self, in_place: bool = False):
        if self.__dict__.get("_reducer") is not None:
            self._reducer.finish()  # a round nobody closed (an error between backward and step)
        self._optimizer.zero_grad(in_place=in_place)

    def all_reduce_grads(self, module):
        """Under ``--ddp-backend legacy_ddp``: average the flat gradient buffers over the workers.

        fairseq's legacy wrapper copies every gradient into a staging buffer of its own, reduces
        it piecewise after the backward and copies the results back; the flat workspace already
        holds all gradients in one buffer per dtype, so it is reduced in place. The first update
        reduces after the backward (one all-reduce per buffer) and then installs an
        :class:`~ls_fairseq.optim.overlap.OverlappedReducer`: from the next update on, buckets of
        the buffers are all-reduced while the backward runs and this call only waits for them.
        ``LS_FAIRSEQ_SYNC_ALL_REDUCE=1`` keeps the reduction after the backward. Any other
        wrapper is left to fairseq."""
        ddp = _legacy_ddp(module)
        if ddp is not None and self._flat_all_reduce_applies(ddp):
            if ddp.accumulate_grads:  # inside no_sync (--update-freq): fairseq's wrapper waits too
                return
            reducer = self.__dict__.get("_reducer")
            if reducer is not None and reducer.finish():
                return
            # first update, or no armed backward since the last reduction: reduce now
            from fairseq.distributed import utils as distributed_utils

            group = ddp.process_group
            self._optimizer.all_reduce_grads_(ddp.world_size, lambda t: distributed_utils.all_reduce(t, group))
            if reducer is None and self._overlap_applies(ddp):
                self._install_reducer(ddp, group)
            return
        super().all_reduce_grads(module)

    def _install_reducer(self, ddp, group):
        from ls_fairseq.optim.overlap import OverlappedReducer, bucket_order, shardable

        bucket_bytes = self._bucket_bytes()
        shard = self._shard_requested
        if shard and not shardable(bucket_order(self._optimizer.workspaces, bucket_bytes), ddp.world_size):
            logger.info("ls_adam: optimizer state not sharded: the gradient buckets do not split into %d equal "
                        "parts (a world size that is a power of two does)", ddp.world_size)
            shard = False
        peers = None
        if shard:
            import torch.distributed as dist

            from ls_fairseq.optim.peer import map_peer_weights

            only_p2p = shard == "p2p"
            peers = map_peer_weights(self._optimizer.workspaces, dist.get_rank(group), ddp.world_size, group,
                                     fallback="optimizer state not sharded" if only_p2p else
                                     "sharded weights are all-gathered")
            shard = not (only_p2p and peers is None)
        self._reducer = reducer = OverlappedReducer(
            self._optimizer.workspaces, ddp.world_size, group, arm=ddp, bucket_bytes=bucket_bytes, shard=shard)
        if shard:
            # the gradients of this update were all-reduced whole: the step may already be sharded
            self._optimizer.shard_(reducer.buckets, reducer.rank, ddp.world_size, group, peers=peers)
            if peers:
                import torch.distributed as dist

                from ls_fairseq.optim.peer import map_peer_inboxes

                boxes = map_peer_inboxes(self._optimizer.workspaces, dist.get_rank(group), ddp.world_size, group)
                if isinstance(boxes, str):
                    logger.info("ls_adam: gradient parts reduce-scattered by NCCL (no peer copies: %s)", boxes)
                else:
                    reducer.use_peer_copies(boxes)
            logger.info("ls_adam: optimizer state sharded over %d ranks (Adam on 1/%d of it per rank, %s)",
                        ddp.world_size, ddp.world_size,
                        "writing the new weights on both GPUs" if peers else "then an all-gather of the weights")
            if peers is None and getattr(ddp.module, "ls_gather_waits", False):
                from ls_fairseq.optim.gather_waits import GatherWaits

                self._gather_waits = GatherWaits(self._optimizer, ddp.module)

    def _flat_all_reduce_applies(self, ddp) -> bool:
        """Whether ``ddp``'s trainable parameters all live in our flat workspace (on one device,
        no MoE experts). The parameter sets do not change during training: decided once per wrapper
        (a new wrapper takes the overlap hooks of the previous one off)."""
        seen = self.__dict__.get("_flat_reduce_decision")
        if seen is None or seen[0] is not ddp:
            self._drop_reducer()
            ours = {id(p) for ws in self._optimizer.workspaces for p in ws.params}
            mine = [p for p in ddp.module.parameters() if p.requires_grad]
            ok = len(ddp.per_device_params) == 1 and all(id(p) in ours and not hasattr(p, "expert") for p in mine)
            seen = self._flat_reduce_decision = (ddp, ok)
        elif self.__dict__.get("_reducer") is not None and not self._reducer.covers(self._optimizer.workspaces):
            # a parameter group was added: rebuild the buckets (from the next update on)
            if self._reducer.in_flight:
                raise RuntimeError("ls_adam: a parameter group was added during an update whose gradients "
                                   "were being all-reduced; add parameter groups between updates")
            self._drop_reducer()
        return seen[1]

    def _overlap_applies(self, ddp) -> bool:
        """Overlap needs a real process group of two or more workers (not XLA) and post-accumulate-grad
        hooks (torch >= 2.1); ``LS_FAIRSEQ_SYNC_ALL_REDUCE=1`` turns it off."""
        import torch
        from fairseq.distributed import utils as distributed_utils

        if env.sync_all_reduce() or ddp.world_size < 2:
            return False
        if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
            return False
        return not distributed_utils.use_xla() and not isinstance(ddp.process_group, tuple)

    def wait_for_weights(self):
        """Make the current stream wait for the weights' all-gathers still in flight (a no-op when
        none are): call before reading the weights outside the model's forward."""
        self._optimizer.wait_gathers()

    def _drop_reducer(self):
        waits = self.__dict__.pop("_gather_waits", None)
        if waits is not None:
            waits.remove()
        reducer = self.__dict__.pop("_reducer", None)
        if reducer is not None:
            reducer.remove()
        if self._optimizer.sharded:  # every rank drops its reducer at the same update: collective is safe
            self._optimizer.unshard_()

    def _bucket_bytes(self) -> int:
        """fairseq's ``--bucket-cap-mb`` (25 when this optimizer is built outside fairseq's config)."""
        try:
            mb = float(getattr(self.cfg, "bucket_cap_mb", DEFAULT_BUCKET_MB))
        except Exception:  # the unresolved interpolation of a config built outside fairseq's
            mb = DEFAULT_BUCKET_MB
        return max(1, int(mb * 2**20))

    def average_params(self):
        """All-reduce the moments (BMUF), as fairseq's adam does."""
        import torch.distributed as dist

        world = float(dist.get_world_size())
        for ws in self._optimizer.workspaces:
            for buf in ws.buffers:
                for t in (buf.exp_avg, buf.exp_avg_sq):
                    t.div_(world)
                    dist.all_reduce(t, op=dist.ReduceOp.SUM)


def _legacy_ddp(module):
    """fairseq's LegacyDistributedDataParallel inside ``module`` (it wraps it in a ModuleProxyWrapper), or None."""
    from fairseq.distributed.legacy_distributed_data_parallel import LegacyDistributedDataParallel

    return next((m for m in wrapper_chain(module, 2) if isinstance(m, LegacyDistributedDataParallel)), None)


__all__ = ["LSAdamConfig", "LSFairseqAdam", "parse_betas"]
