"""``--optimizer ls_adam``: fairseq's Adam over a flat fused workspace.

Same flags and formula as fairseq's ``adam`` (--adam-betas, --adam-eps, --weight-decay, --lr;
decoupled weight decay, eps added to sqrt(v), bias corrections folded into the step size), one fused
update per dtype buffer, under every fairseq precision mode (fp32, ``--fp16``,
``--memory-efficient-fp16``). On several GPUs (``--ddp-backend legacy_ddp``)
:meth:`LSFairseqAdam.all_reduce_grads` averages the gradients in the flat buffers through one
:class:`~ls_fairseq.optim.reduction.GradReduction` per DDP wrapper, and after
:meth:`LSFairseqAdam.request_sharding` each rank may update only its own part of the state;
checkpoints always hold the whole state. docs/optimizer.md ("ls_adam in fairseq") has the details.
"""

import ast
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, List

from omegaconf import II, OmegaConf

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.optim import FairseqOptimizer, register_optimizer

from ls_fairseq.fairseq_ext.step.settings import DEFAULT_GRAPH_BUCKETS
from ls_fairseq.fairseq_ext.wrappers import wrapper_chain
from ls_fairseq.optim.adam import LSAdam, check_hyperparams
from ls_fairseq.optim.buckets import DEFAULT_BUCKET_MB
from ls_fairseq import env

logger = logging.getLogger(__name__)


LS_TRAINER_CHOICES = ChoiceEnum(["auto", "off"])
GRAPH_STEP_CHOICES = ChoiceEnum(["auto", "on", "off"])
LS_TRAINER_HELP = (
    "auto: train on ls_fairseq's trainer (the deferred step, CUDA graphs, pinned batch copies): always in "
    "lightseq-train, in fairseq-train when the model is an ls_transformer and the criterion "
    "ls_label_smoothed_cross_entropy; off: fairseq's own Trainer")
GRAPH_STEP_HELP = (
    "replay each micro-batch's forward and backward from CUDA graphs (ls_transformer, "
    "ls_label_smoothed_cross_entropy; batches are grown to a few fixed shapes, packed or padded, which leaves "
    "the loss and gradients unchanged). auto: on one GPU; on several GPUs the eager step, whose gradient "
    "all-reduce overlaps the backward (on: the graphs there too, with the all-reduce after the backward); off: "
    "the eager step. Runs that cannot take it use the eager step and say why in the log")
SHARD_STATE_CHOICES = ChoiceEnum(["auto", "on", "off"])
SHARD_STATE_HELP = (
    "on several GPUs, each keeps and updates only its part of the optimizer state (the gradients are "
    "reduce-scattered, the new weights gathered; checkpoints still hold the whole state). auto: where the GPUs "
    "write each other's weights directly (two GPUs of one host); on: wherever the gradient buckets split evenly; "
    "off: the whole state on every GPU. The CUDA-graph step keeps the whole state")
GRAPH_BUCKETS_HELP = (
    "at most this many batch shapes (one pair of CUDA graphs each) for --ls-graph-step: packed buckets (the "
    "real tokens back to back) in fp16 / bf16, padded ones in fp32; fewer buckets capture faster but compute "
    "more padding")


@dataclass
class LSAdamConfig(FairseqDataclass):
    adam_betas: Any = field(default=(0.9, 0.999), metadata={"help": "betas for Adam optimizer"})
    adam_eps: float = field(default=1e-8, metadata={"help": "epsilon for Adam optimizer"})
    weight_decay: float = field(default=0.0, metadata={"help": "weight decay (decoupled, as fairseq's adam)"})
    lr: List[float] = II("optimization.lr")
    # fairseq's --bucket-cap-mb: the bucket size of the all-reduce overlapped with the backward
    bucket_cap_mb: int = II("distributed_training.bucket_cap_mb")
    # the training step (ls_fairseq/fairseq_ext/step, docs/step.md): options of ls_adam, which the step needs
    ls_trainer: LS_TRAINER_CHOICES = field(default="auto", metadata={"help": LS_TRAINER_HELP})
    ls_graph_step: GRAPH_STEP_CHOICES = field(default="auto", metadata={"help": GRAPH_STEP_HELP})
    ls_graph_buckets: int = field(default=DEFAULT_GRAPH_BUCKETS, metadata={"help": GRAPH_BUCKETS_HELP})
    ls_shard_state: SHARD_STATE_CHOICES = field(default="auto", metadata={"help": SHARD_STATE_HELP})


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
        self._after_backward_only = None
        self.driven_by_ls_trainer = False  # LSTrainer takes the update's step (set by it)
        self._said_trainer = False
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

    def step(self, closure=None, scale=1.0, groups=None, with_norm=False):
        if not self.driven_by_ls_trainer and not self._said_trainer:
            self._said_trainer = True
            if any(p.is_cuda for g in self._optimizer.param_groups for p in g["params"]):
                logger.info("ls_adam under fairseq's own Trainer: the deferred step and the CUDA-graph step are not "
                            "used (they come with an ls_transformer, ls_label_smoothed_cross_entropy and "
                            "--ls-trainer auto)")
        return self._optimizer.step(closure, scale=scale, with_norm=with_norm)

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
        reduction = self.__dict__.get("_reduction")
        if reduction is not None:
            reduction.shard = on  # read when it chooses its strategy (after its first update)

    def reduce_after_backward_only(self, reason: str):
        """Under ``--ddp-backend legacy_ddp``: reduce the gradients after the backward in every update
        (one all-reduce per flat buffer), never from hooks in the backward, with the whole optimizer
        state on every rank (:meth:`GradReduction.reduce_after_backward_only
        <ls_fairseq.optim.reduction.GradReduction.reduce_after_backward_only>`); ``reason`` is logged
        once. The CUDA-graph step calls it: its backwards are graph replays, where no hook runs."""
        if self._after_backward_only == reason:
            return
        self._after_backward_only = reason
        reduction = self.__dict__.get("_reduction")
        if reduction is not None:
            reduction.reduce_after_backward_only(reason)

    @property
    def sharded(self) -> bool:
        return self._optimizer.sharded

    def zero_grad(self, in_place: bool = False, fill: bool = True):
        if self.__dict__.get("_reduction") is not None:
            self._reduction.finish()  # a round nobody closed (an error between backward and step)
        self._optimizer.zero_grad(in_place=in_place, fill=fill)

    def all_reduce_grads(self, module):
        """Under ``--ddp-backend legacy_ddp``: average the flat gradient buffers over the workers.

        fairseq's legacy wrapper copies every gradient into a staging buffer of its own, reduces
        it piecewise after the backward and copies the results back; the flat workspace already
        holds all gradients in one buffer per dtype, so they are reduced in place, by the
        :class:`~ls_fairseq.optim.reduction.GradReduction` of the wrapper: after the backward in the
        first update, from then on in buckets while the backward runs (this call only waits for
        them). Any other wrapper is left to fairseq."""
        ddp = _legacy_ddp(module)
        reduction = self._reduction_of(ddp) if ddp is not None else None
        if reduction is None:
            super().all_reduce_grads(module)
            return
        reduction.reduce()

    def _reduction_of(self, ddp):
        """The reduction of ``ddp``'s gradients, or None where they are not all in our flat workspace
        (on one device, no MoE experts). The parameter sets do not change during training: decided
        once per wrapper (a new wrapper takes the reduction of the previous one off); a parameter group
        added since gets a new reduction (its buckets cover the new buffers from the next update on)."""
        seen = self.__dict__.get("_flat_reduce_decision")
        if seen is None or seen[0] is not ddp:
            self._drop_reduction()
            ours = {id(p) for ws in self._optimizer.workspaces for p in ws.params}
            mine = [p for p in ddp.module.parameters() if p.requires_grad]
            ok = len(ddp.per_device_params) == 1 and all(id(p) in ours and not hasattr(p, "expert") for p in mine)
            self._flat_reduce_decision = (ddp, ok)
            if ok:
                self._reduction = self._new_reduction(ddp)
        elif self.__dict__.get("_reduction") is not None and not self._reduction.covers(self._optimizer.workspaces):
            if self._reduction.in_flight:
                raise RuntimeError("ls_adam: a parameter group was added during an update whose gradients "
                                   "were being all-reduced; add parameter groups between updates")
            self._drop_reduction()
            self._reduction = self._new_reduction(ddp)
        return self.__dict__.get("_reduction")

    def _new_reduction(self, ddp):
        from fairseq.distributed import utils as distributed_utils

        from ls_fairseq.optim.reduction import GradReduction

        group = ddp.process_group
        reduction = GradReduction(self._optimizer, ddp, lambda t: distributed_utils.all_reduce(t, group),
                                  can_overlap=not distributed_utils.use_xla() and not isinstance(group, tuple),
                                  bucket_bytes=self._bucket_bytes(), shard=self._shard_requested)
        if self._after_backward_only is not None:
            reduction.reduce_after_backward_only(self._after_backward_only)
        return reduction

    def _drop_reduction(self):
        reduction = self.__dict__.pop("_reduction", None)
        if reduction is not None:
            reduction.remove()

    def wait_for_weights(self):
        """Make the current stream wait for the weights' all-gathers still in flight (a no-op when
        none are): call before reading the weights outside the model's forward."""
        self._optimizer.wait_gathers()

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
