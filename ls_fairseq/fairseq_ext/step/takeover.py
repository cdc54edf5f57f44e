"""Which trainer fairseq's training loop builds, and what the ls components adjust in its configuration.

fairseq's ``fairseq_cli.train.main`` builds ``Trainer(cfg, task, model, criterion, quantizer)`` through the
module's global name. :func:`install` points that name at :func:`choose_trainer`, which builds
:class:`~ls_fairseq.fairseq_ext.step.trainer.LSTrainer` when the run uses the ls model, ls_adam and the
ls criterion (lightseq-train: always) and ``--ls-trainer`` is not ``off``, and fairseq's Trainer otherwise,
so a run without the ls components trains exactly as without the plugin. :func:`adapt` makes the
settings lightseq-train makes at parse time (bf16 on the GPU, ls_adam's own master weights, legacy_ddp,
the epoch iterator kept under --grouped-shuffling) on either a parsed Namespace or fairseq's config.
"""

import logging
import sys
from typing import List, Optional

from ls_fairseq.argv import has_flag

logger = logging.getLogger("ls_fairseq.takeover")

# lightseq-train's --bucket-cap-mb where ls_adam reduces the gradients itself: few buckets, each costing the
# autograd thread the fold of its gradients and an NCCL call (benchmarks/RESULTS.md, section 'Scaling')
LS_ADAM_BUCKET_MB = 100
_GROUPS = ("common", "optimization", "dataset", "distributed_training", "checkpoint")


class FlatConfig:
    """fairseq's grouped config seen as the flat Namespace its parser makes (``cfg.common.fp16`` as
    ``fp16``; ``optimizer`` is the optimizer's name), so one function adjusts either."""

    def __init__(self, cfg):
        object.__setattr__(self, "_cfg", cfg)

    def _group(self, name):
        cfg = object.__getattribute__(self, "_cfg")
        for g in _GROUPS:
            group = getattr(cfg, g, None)
            if group is not None and name in group:
                return group
        if cfg.optimizer is not None and name in cfg.optimizer:
            return cfg.optimizer
        if getattr(cfg, "model", None) is not None and name in cfg.model:
            return cfg.model
        return None

    def __getattr__(self, name):
        cfg = object.__getattribute__(self, "_cfg")
        if name == "optimizer":
            return getattr(cfg.optimizer, "_name", None)
        group = self._group(name)
        return getattr(group, name) if group is not None else None

    def __setattr__(self, name, value):
        group = self._group(name)
        if group is None:
            raise AttributeError(f"fairseq's config has no {name}")
        setattr(group, name, value)


# ------------------------------------------------------------------ the adjustments
def fix_bf16(args, argv) -> bool:
    """Undo fairseq's ``--bf16 implies --tpu`` unless ``--tpu`` was given. Returns True when it changed ``args``."""
    if getattr(args, "bf16", False) and getattr(args, "tpu", False) and not has_flag(argv, "--tpu"):
        args.tpu = False
        return True
    return False


def ls_adam_owns_master_weights(args) -> bool:
    """Under --fp16 / --bf16, ls_adam holds the fp32 master weights (fairseq's memory-efficient wrapper): one fp32
    copy of the weights and gradients fewer than fairseq's FP16Optimizer, and the unscaling folded into ls_adam's
    fused update. Returns True when it switched the wrapper."""
    if getattr(args, "optimizer", None) != "ls_adam":
        return False
    if getattr(args, "fp16", False) and not getattr(args, "memory_efficient_fp16", False):
        args.memory_efficient_fp16 = True
        return True
    if getattr(args, "bf16", False) and not getattr(args, "memory_efficient_bf16", False):
        args.memory_efficient_bf16 = True
        return True
    return False


def _ls_adam_on_several_workers(args) -> bool:
    return getattr(args, "optimizer", None) == "ls_adam" and int(getattr(args, "distributed_world_size", 1) or 1) >= 2


def ls_adam_reduces_gradients(args, argv) -> bool:
    """A distributed ls_adam run trains under ``--ddp-backend legacy_ddp`` unless ``--ddp-backend`` is given:
    ls_adam then all-reduces its flat gradient buffers itself (ls_fairseq/optim/overlap.py). Returns True when
    it switched the backend."""
    if not _ls_adam_on_several_workers(args) or has_flag(argv, "--ddp-backend") or getattr(args, "tpu", False):
        return False
    if getattr(args, "ddp_backend", None) == "legacy_ddp":
        return False
    mixed = getattr(args, "fp16", False) or getattr(args, "bf16", False)
    if mixed and not (getattr(args, "memory_efficient_fp16", False) or getattr(args, "memory_efficient_bf16", False)):
        return False
    args.ddp_backend = "legacy_ddp"
    return True


def ls_adam_bucket_size(args, argv) -> bool:
    """Under legacy_ddp with ls_adam, buckets of :data:`LS_ADAM_BUCKET_MB` unless ``--bucket-cap-mb`` is given.
    Returns True when it changed it."""
    if not _ls_adam_on_several_workers(args) or getattr(args, "ddp_backend", None) != "legacy_ddp":
        return False
    if has_flag(argv, "--bucket-cap-mb"):
        return False
    args.bucket_cap_mb = LS_ADAM_BUCKET_MB
    return True


def keep_epoch_iterator(args, argv) -> bool:
    """Under ``--grouped-shuffling`` fairseq rebuilds the batch iterator (and the batches) every epoch; LSTrainer
    groups whichever iterator it gets, so the rebuild is not needed and is turned off unless
    ``--update-epoch-batch-itr`` is given. Returns True when it changed the setting."""
    if not getattr(args, "grouped_shuffling", False) or not getattr(args, "update_epoch_batch_itr", False):
        return False
    if getattr(args, "ls_trainer", "auto") == "off" or has_flag(argv, "--update-epoch-batch-itr"):
        return False
    args.update_epoch_batch_itr = False
    return True


def adapt(args, argv) -> List[str]:
    """Every adjustment above, on a parsed Namespace or a :class:`FlatConfig`; returns what changed, in words."""
    said = []
    if fix_bf16(args, argv):
        said.append("--bf16 trains in bfloat16 on this device (fairseq's implied --tpu turned off)")
    if ls_adam_owns_master_weights(args):
        said.append("ls_adam keeps the fp32 master weights (fairseq's memory-efficient wrapper)")
    if ls_adam_reduces_gradients(args, argv):
        said.append("--ddp-backend legacy_ddp, under which ls_adam all-reduces its flat gradient buffers itself")
    if ls_adam_bucket_size(args, argv):
        said.append(f"gradient buckets of {LS_ADAM_BUCKET_MB} MB")
    if keep_epoch_iterator(args, argv):
        said.append("--grouped-shuffling keeps the epoch's batches (no rebuild every epoch)")
    return said


# ------------------------------------------------------------------ the choice
def ls_components_missing(cfg, model, criterion) -> Optional[str]:
    """What of the ls model, ls_adam and the ls criterion this run lacks (None: it has all three)."""
    from ls_fairseq.fairseq_ext.criterion import LSLabelSmoothedCrossEntropyCriterion
    from ls_fairseq.fairseq_ext.model import LSTransformerModel

    if getattr(cfg.optimizer, "_name", None) != "ls_adam":
        return "--optimizer is not ls_adam"
    if not isinstance(model, LSTransformerModel):
        return "the model is not an ls_transformer"
    if not isinstance(criterion, LSLabelSmoothedCrossEntropyCriterion):
        return "--criterion is not ls_label_smoothed_cross_entropy"
    return None


def choose_trainer(cfg, task, model, criterion, quantizer=None, always: bool = False, prepare=None):
    """The trainer fairseq's loop trains on (module docstring). ``always``: LSTrainer whatever the components
    (lightseq-train, which prepares its run itself), unless ``--ls-trainer off``; ``prepare()`` (fairseq-train):
    called before LSTrainer is built (the fairseq patches a run on it needs)."""
    from fairseq.trainer import Trainer

    from ls_fairseq.fairseq_ext.step.trainer import LSTrainer

    if getattr(cfg.optimizer, "ls_trainer", "auto") == "off":
        logger.info("--ls-trainer off: fairseq's own Trainer")
        return Trainer(cfg, task, model, criterion, quantizer)
    if always:  # lightseq-train adapted, checked and patched its run before it started its processes
        return LSTrainer(cfg, task, model, criterion, quantizer)
    if ls_components_missing(cfg, model, criterion) is not None:
        return Trainer(cfg, task, model, criterion, quantizer)
    from ls_fairseq.fairseq_ext.step import run_checks

    flat = FlatConfig(cfg)
    said = adapt(flat, sys.argv)
    if prepare is not None:
        prepare()
    first = not cfg.distributed_training.distributed_rank
    run_checks.prepare_checkpoints(cfg, prog="fairseq-train", first_process=first)
    run_checks.check_data(cfg, prog="fairseq-train")
    run_checks.check_device(flat, prog="fairseq-train")
    logger.info("ls_fairseq trains this run on its own trainer (the deferred step, CUDA graphs where the run "
                "allows, atomic checkpoints, data checks)%s; not taken over: lightseq-train's split of the CPU "
                "cores between the training processes of a machine and its process-group teardown, which "
                "belong to its own start; --ls-trainer off keeps fairseq's Trainer",
                "; " + "; ".join(said) if said else "")
    return LSTrainer(cfg, task, model, criterion, quantizer)


def install(fairseq_train_module=None, always: bool = False, prepare=None) -> bool:
    """Point fairseq's training loop (``fairseq_cli.train``, when imported) at :func:`choose_trainer` (``always``,
    ``prepare``: its arguments). Idempotent; returns True when the loop's module was there."""
    module = fairseq_train_module or sys.modules.get("fairseq_cli.train")
    main = sys.modules.get("__main__")
    if module is None and getattr(getattr(main, "__spec__", None), "name", None) == "fairseq_cli.train":
        module = main  # python -m fairseq_cli.train
    if module is None:
        return False
    if getattr(module.Trainer, "ls_fairseq_always", False) and not always:
        return True  # lightseq-train's choice stays

    def Trainer(cfg, task, model, criterion, quantizer=None):  # noqa: N802 - fairseq's name for it
        return choose_trainer(cfg, task, model, criterion, quantizer, always=always, prepare=prepare)

    Trainer.ls_fairseq_always = always
    module.Trainer = Trainer
    return True
