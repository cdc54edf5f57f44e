"""lightseq-train: fairseq-train with the ls_fairseq plugin loaded, and bf16 on GPU.

Every fairseq-train flag works unchanged. Differences from plain ``fairseq-train``:

* ``--user-dir`` points at the plugin unless you give one, so ``--arch ls_transformer_*``,
  ``--optimizer ls_adam`` and ``--criterion ls_label_smoothed_cross_entropy`` are known;
* checkpoints load under torch >= 2.6 (fairseq's torch.load needs ``weights_only=False``);
* the training loop runs on :class:`ls_fairseq.fairseq_ext.trainer.LSTrainer`, fairseq's Trainer
  without its per-step host waits (pinned batch copies, statistics read only when logged, and for
  ls_adam an update step that reads nothing back from the GPU; see that module for the two visible
  differences after an fp16 overflow). ``LS_FAIRSEQ_PLAIN_TRAINER=1`` keeps fairseq's Trainer;
  the process group of a multi-GPU run is torn down after training;
* ``--grouped-shuffling`` shuffles whole updates (:mod:`ls_fairseq.fairseq_ext.batching`): the
  batches of one update, on every GPU and every micro-batch, are length neighbours, and a 1-GPU
  run with ``--update-freq N*k`` takes exactly the updates of N GPUs with ``--update-freq k``;
* ``--optimizer ls_adam`` in a distributed run (``--distributed-world-size`` > 1, whose default
  is the number of visible GPUs) without ``--ddp-backend`` on the command line trains under
  ``--ddp-backend legacy_ddp``: ls_adam then all-reduces its flat gradient buffers itself (in
  buckets overlapped with the backward pass in the eager step, after the backward in the CUDA-graph
  step). A ``--ddp-backend`` you give is kept;
* ``--bf16`` / ``--memory-efficient-bf16`` train in bfloat16 on the GPU (or the CPU with
  ``--cpu``). In fairseq 0.12 ``--bf16`` also switches on ``--tpu``, which makes the trainer
  ask torch_xla for a device and fail on any machine without one. lightseq-train parses the
  arguments exactly like fairseq-train, then turns that implied ``--tpu`` off again unless
  you wrote ``--tpu`` yourself. Everything else is fairseq's own bf16 path: the model and
  criterion are cast to bfloat16, batches are cast to bfloat16, and the optimizer runs
  behind fairseq's FP16Optimizer wrapper with fp32 master weights and no loss scaling
  (bf16 has fp32's exponent range). One fairseq bug is fixed on the way: FP16Optimizer never
  resets its pending gradient factor when there is no loss scaler (bf16), so with an optimizer
  that takes the factor in its step (``supports_step_with_scale``, as ls_adam does) the factors
  of all past updates multiply up and the gradients vanish after the first update.
"""

import argparse
import os
import logging
import sys
from typing import List, Optional

from ls_fairseq._collective_defaults import import_collective_defaults_early
from ls_fairseq.cli import _common
from ls_fairseq import env

# the workers that fairseq spawns import this module (for _train_main) before they join the group
import_collective_defaults_early()

logger = logging.getLogger("ls_fairseq.cli.train")

BF16_HELP = (
    "train in bfloat16. lightseq-train: on a GPU (or with --cpu) this trains in bf16 on that "
    "device; fairseq's implied --tpu is dropped unless --tpu is given explicitly"
)
MEM_BF16_HELP = "bf16 with fairseq's memory-efficient wrapper (no fp32 copy of the grads); implies --bf16"
GROUPED_HELP = (
    "shuffle whole updates: the num_shards x update_freq batches of an update are neighbours in "
    "the length-sorted order, so every GPU gets batches of similar cost (lightseq-train; a 1-GPU "
    "run with --update-freq N*k and this flag sees the data order of N GPUs with --update-freq k)"
)
EPILOG = (
    "lightseq-train is fairseq-train with the ls_fairseq plugin as --user-dir (unless you give "
    "one). --bf16 trains in bfloat16 on the GPU instead of implying --tpu."
)


def explicit_tpu(argv: List[str]) -> bool:
    return _common.has_flag(argv, "--tpu")


def fix_bf16(args: argparse.Namespace, argv: List[str]) -> bool:
    """Undo fairseq's ``--bf16 implies --tpu`` unless the user asked for a TPU.

    Returns True when it changed ``args``.
    """
    if getattr(args, "bf16", False) and getattr(args, "tpu", False) and not explicit_tpu(argv):
        args.tpu = False
        return True
    return False


def patch_fp16_optimizer_for_bf16() -> None:
    """Make fairseq's FP16Optimizer.zero_grad reset the gradient factor without a scaler.

    fairseq 0.12's MemoryEfficientFP16Optimizer resets ``_multiply_factor`` to 1 in zero_grad
    when ``scaler is None`` (bf16); FP16Optimizer only resets it from the loss scale, so under
    ``--bf16`` the factor of every update (1/sample_size, clip coefficients) keeps multiplying
    into the next whenever the wrapped optimizer steps with a scale instead of unscaling the
    gradients first. Idempotent.
    """
    from fairseq.optim import fp16_optimizer

    mixin = fp16_optimizer._FP16OptimizerMixin
    if getattr(mixin.zero_grad, "_ls_fairseq_bf16_fix", False):
        return
    original = mixin.zero_grad

    def zero_grad(self):
        original(self)
        if self.scaler is None:
            self._multiply_factor = 1.0

    zero_grad._ls_fairseq_bf16_fix = True
    mixin.zero_grad = zero_grad


def _train_main(cfg, **kwargs):
    """fairseq_cli.train.main with lightseq-train's fixes applied in this process.

    distributed_utils.call_main may run this in freshly spawned workers: it is referenced
    by name, so each worker imports this module and applies the fixes itself."""
    from fairseq_cli import train as fairseq_train

    from ls_fairseq.cli import affinity
    from ls_fairseq.fairseq_ext import graph_step
    from ls_fairseq.fairseq_ext.heap import release_heap

    graph_step.OPTIONS.update(kwargs.pop("ls_graph", None) or {})
    from ls_fairseq.fairseq_ext.checkpoint_files import install_atomic_copies

    install_atomic_copies()  # checkpoint_last / checkpoint_best are never left half-written
    keep_nan_from_best()

    dt = cfg.distributed_training
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or getattr(dt, "distributed_num_procs", None) or 1)
    local_rank = int(os.environ.get("LOCAL_RANK") or getattr(dt, "device_id", 0) or 0)
    if local_rank < local_world:
        affinity.apply(local_rank, local_world)
    patch_fp16_optimizer_for_bf16()
    use_ls_trainer(fairseq_train)
    try:
        out = fairseq_train.main(cfg, **kwargs)
    finally:
        release_heap()  # what the trainer froze (fairseq_ext/heap.py) is collectable again
    destroy_process_group()
    return out


def destroy_process_group() -> bool:
    """Tear down torch.distributed after training (fairseq leaves it up: every rank then prints
    PyTorch's resource-leak warning, and a rank whose peer exited first prints a store error).
    Returns True when there was a group to destroy.

    fairseq keeps the group ``get_global_group()`` made on that function; that reference is dropped
    too, so the group is freed (its gloo worker threads joined) here, not while the interpreter shuts
    down, where a rank could abort with "terminate called without an active exception"."""
    import torch.distributed as dist
    from fairseq.distributed import utils as distributed_utils

    destroyed = False
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        destroyed = True
    distributed_utils.get_global_group.__dict__.pop("_global_group", None)
    return destroyed


def use_ls_trainer(fairseq_train_module) -> bool:
    """Let fairseq's training loop build LSTrainer (fewer host stalls per step; same updates).

    ``LS_FAIRSEQ_PLAIN_TRAINER=1`` keeps fairseq's Trainer. Returns True when it switched."""
    from ls_fairseq.fairseq_ext.trainer import LSTrainer

    if env.plain_trainer():
        return False
    fairseq_train_module.Trainer = LSTrainer
    return True


GRAPH_STEP_HELP = (
    "lightseq-train: replay each micro-batch's forward and backward from CUDA graphs (ls_transformer, "
    "ls_label_smoothed_cross_entropy, ls_adam; batches are grown to a few fixed shapes, packed or padded, "
    "which leaves the loss and gradients unchanged). auto: on one GPU; on several GPUs the eager step, whose gradient "
    "all-reduce overlaps the backward (on: the graphs there too, with the all-reduce after the backward). "
    "Runs that cannot take it use the eager step and say why in the log (default: %(default)s)"
)
GRAPH_BUCKETS_HELP = (
    "lightseq-train: at most this many batch shapes (one pair of CUDA graphs each) for --ls-graph-step: "
    "packed buckets (the real tokens back to back) in fp16 / bf16, padded ones in fp32; fewer buckets "
    "capture faster but compute more padding (default: %(default)s)"
)


def _modify_parser(parser: argparse.ArgumentParser) -> None:
    from ls_fairseq.fairseq_ext.graph_step import DEFAULT_BUCKETS

    parser.epilog = EPILOG
    for action in parser._actions:
        if action.dest == "bf16":
            action.help = BF16_HELP
        elif action.dest == "memory_efficient_bf16":
            action.help = MEM_BF16_HELP
        elif action.dest == "grouped_shuffling":
            action.help = GROUPED_HELP
    if not any(a.dest == "ls_graph_step" for a in parser._actions):  # fairseq calls this more than once
        group = parser.add_argument_group("lightseq-train")
        group.add_argument("--ls-graph-step", choices=("auto", "on", "off"), default="auto",
                           help=GRAPH_STEP_HELP)
        group.add_argument("--ls-graph-buckets", type=int, default=DEFAULT_BUCKETS, metavar="N",
                           help=GRAPH_BUCKETS_HELP)


def check_precision_flags(argv: List[str]) -> None:
    """Clear errors for precision combinations that fairseq reports confusingly."""
    bf16 = _common.has_flag(argv, "--bf16") or _common.has_flag(argv, "--memory-efficient-bf16")
    fp16 = _common.has_flag(argv, "--fp16") or _common.has_flag(argv, "--memory-efficient-fp16")
    if bf16 and fp16:
        raise SystemExit("lightseq-train: choose one of --fp16 / --bf16 (both were given)")
    if bf16 and _common.has_flag(argv, "--amp"):
        raise SystemExit("lightseq-train: --amp is fp16 autocast; do not combine it with --bf16")


def parse(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """Parse lightseq-train's arguments (sys.argv[1:] when None) into fairseq's Namespace."""
    argv = _common.prepare(argv)  # logging set up before fairseq is imported
    from fairseq import options

    check_precision_flags(argv)
    # fairseq imports --user-dir from sys.argv while it builds the parser: keep them in step.
    _common.set_argv(argv)
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=argv, modify_parser=_modify_parser)
    if fix_bf16(args, argv):
        import torch

        where = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
        logger.info("--bf16: training in bfloat16 on %s (fairseq's implied --tpu turned off)", where)
    if ls_adam_owns_master_weights(args):
        logger.info("--optimizer ls_adam with --%s: ls_adam keeps the fp32 master weights itself "
                    "(fairseq's memory-efficient wrapper; set LS_FAIRSEQ_FP16_OPTIMIZER=1 to keep "
                    "fairseq's FP16Optimizer copy)", "bf16" if args.bf16 else "fp16")
    if ls_adam_reduces_gradients(args, argv):
        logger.info("--optimizer ls_adam with --distributed-world-size %d: --ddp-backend legacy_ddp, under "
                    "which ls_adam all-reduces its flat gradient buffers itself (overlapped with the backward "
                    "pass in the eager step, after it in the CUDA-graph step; give --ddp-backend to choose another "
                    "backend)", args.distributed_world_size)
    if ls_adam_bucket_size(args, argv):
        logger.info("--optimizer ls_adam under legacy_ddp: gradient buckets of %d MB (give --bucket-cap-mb to "
                    "choose another size)", args.bucket_cap_mb)
    keep_epoch_iterator(args, argv)
    check_training_args(args)
    if args.ls_graph_buckets < 1:
        raise SystemExit(f"lightseq-train: --ls-graph-buckets must be >= 1, got {args.ls_graph_buckets}")
    return args


def check_training_args(args: argparse.Namespace) -> None:
    """Clear errors for flags fairseq accepts and then fails on deep inside, or silently ignores."""
    freqs = list(getattr(args, "update_freq", None) or [1])
    if any(int(f) < 1 for f in freqs):
        raise SystemExit(f"lightseq-train: --update-freq must be >= 1, got {','.join(str(f) for f in freqs)}")
    if float(getattr(args, "quant_noise_scalar", 0) or 0) > 0 and str(getattr(args, "arch", "")).startswith("ls_"):
        raise SystemExit("lightseq-train: --quant-noise-scalar (quantization noise) is not supported by ls_transformer")


def check_device_args(args: argparse.Namespace) -> None:
    """Before training starts (not at parse time, where a GPU configuration may be parsed anywhere): flags that
    cannot run on this machine."""
    if getattr(args, "fp8", False):
        import torch

        from ls_fairseq.ops.fp8 import fp8_unavailable_reason

        on_gpu = not getattr(args, "cpu", False) and torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        dtype = (torch.bfloat16 if getattr(args, "bf16", False) else
                 torch.float16 if getattr(args, "fp16", False) or getattr(args, "memory_efficient_fp16", False)
                 else torch.float32)
        reason = fp8_unavailable_reason(device, dtype)
        if reason is not None:
            raise SystemExit(f"lightseq-train: {reason}")
    if env.fp16_optimizer() and getattr(args, "fp16", False):
        import torch

        if getattr(args, "cpu", False) or not torch.cuda.is_available():
            raise SystemExit("lightseq-train: LS_FAIRSEQ_FP16_OPTIMIZER=1 with --fp16 needs a CUDA GPU (fairseq's "
                             "FP16Optimizer keeps its copies on the GPU); drop one of them to train on the CPU")


def graph_options(args: argparse.Namespace) -> dict:
    """lightseq-train's CUDA-graph flags, as :data:`ls_fairseq.fairseq_ext.graph_step.OPTIONS` takes them."""
    mode = getattr(args, "ls_graph_step", "off")
    return {"on": mode != "off", "several_gpus": mode == "on", "buckets": int(getattr(args, "ls_graph_buckets", 1))}


# lightseq-train's --bucket-cap-mb where ls_adam reduces the gradients itself. Each bucket costs the
# autograd thread the fold of its gradients and an NCCL call in the middle of the backward; four
# buckets of 100 MB instead of twelve of 25 MB (transformer big) took 1.3-1.9 ms of host time off a
# 2-GPU backward and ran 1.3-2.6% faster (benchmarks/RESULTS.md), the last bucket (the shared
# embedding's gradient, complete only when the backward ends) being exposed either way.
LS_ADAM_BUCKET_MB = 100


def ls_adam_bucket_size(args: argparse.Namespace, argv: List[str]) -> bool:
    """Under legacy_ddp with ls_adam (the overlapped reduction of ls_fairseq/optim/overlap.py), buckets of
    :data:`LS_ADAM_BUCKET_MB` unless ``--bucket-cap-mb`` is given. Returns True when it changed it."""
    if not _ls_adam_on_several_workers(args) or getattr(args, "ddp_backend", None) != "legacy_ddp":
        return False
    if _common.has_flag(argv, "--bucket-cap-mb"):
        return False
    args.bucket_cap_mb = LS_ADAM_BUCKET_MB
    return True


def keep_epoch_iterator(args: argparse.Namespace, argv: List[str]) -> bool:
    """Under ``--grouped-shuffling`` fairseq defaults ``--update-epoch-batch-itr`` to True and
    rebuilds the batch iterator (and the batches) at every epoch. LSTrainer's grouping is applied
    to whichever iterator it gets, so the rebuild is not needed; without it a run with
    ``--grouped-shuffling`` batches the data exactly as one without (only the order of the batches
    differs). An explicit ``--update-epoch-batch-itr`` is kept. Returns True when it changed the
    setting."""
    if not getattr(args, "grouped_shuffling", False) or not getattr(args, "update_epoch_batch_itr", False):
        return False
    if env.plain_trainer() or _common.has_flag(argv, "--update-epoch-batch-itr"):
        return False
    args.update_epoch_batch_itr = False
    return True


def _ls_adam_on_several_workers(args: argparse.Namespace) -> bool:
    """--optimizer ls_adam with --distributed-world-size > 1 (as fairseq decides it: its default is the number
    of visible GPUs; a torchrun or Slurm start needs it > 1 too)."""
    return getattr(args, "optimizer", None) == "ls_adam" and int(getattr(args, "distributed_world_size", 1) or 1) >= 2


def ls_adam_reduces_gradients(args: argparse.Namespace, argv: List[str]) -> bool:
    """A distributed ls_adam run trains under ``--ddp-backend legacy_ddp`` unless ``--ddp-backend``
    is given on the command line.

    Distributed as fairseq decides it: ``--distributed-world-size`` > 1 (its default is the number
    of visible GPUs; a torchrun or Slurm start needs it > 1 too, fairseq reads the actual size
    from the environment later). Under legacy_ddp ls_adam averages the gradients itself: its
    flat gradient buffers are all-reduced in buckets while the backward pass runs
    (ls_fairseq/optim/overlap.py), without the gradient copies of PyTorch's DDP. Not when
    fairseq's FP16Optimizer holds an fp32 copy of the parameters (LS_FAIRSEQ_FP16_OPTIMIZER=1):
    ls_adam then never sees the model's gradients, and fairseq's legacy wrapper would reduce
    them after the backward. Returns True when it switched the backend.
    """
    if not _ls_adam_on_several_workers(args) or _common.has_flag(argv, "--ddp-backend") or getattr(args, "tpu", False):
        return False
    if getattr(args, "ddp_backend", None) == "legacy_ddp":
        return False
    mixed = getattr(args, "fp16", False) or getattr(args, "bf16", False)
    if mixed and not (getattr(args, "memory_efficient_fp16", False) or getattr(args, "memory_efficient_bf16", False)):
        return False
    args.ddp_backend = "legacy_ddp"
    return True


def ls_adam_owns_master_weights(args: argparse.Namespace) -> bool:
    """Under --fp16/--bf16, let ls_adam hold the fp32 master weights (memory-efficient wrapper).

    fairseq's default FP16Optimizer keeps a second fp32 copy of every parameter and gradient
    and copies them tensor by tensor each step; ls_adam already keeps fp32 masters in its flat
    workspace and folds the unscaling into its single fused step: one fp32 copy fewer, and on
    an H200 the same speed or slightly faster (benchmarks/RESULTS.md). Returns True when it
    switched the wrapper.
    """
    if getattr(args, "optimizer", None) != "ls_adam" or env.fp16_optimizer():
        return False
    if getattr(args, "fp16", False) and not getattr(args, "memory_efficient_fp16", False):
        args.memory_efficient_fp16 = True
        return True
    if getattr(args, "bf16", False) and not getattr(args, "memory_efficient_bf16", False):
        args.memory_efficient_bf16 = True
        return True
    return False


def keep_nan_from_best() -> None:
    """A validation loss that is NaN or infinite never makes a checkpoint_best.pt: the save goes on without it
    (fairseq saves the first one as best, since nothing compares better than a first value)."""
    import math

    from fairseq import checkpoint_utils

    save = checkpoint_utils.save_checkpoint
    if getattr(save, "_ls_nan_guard", False):
        return

    def guarded(cfg, trainer, epoch_itr, val_loss):
        if val_loss is not None and not math.isfinite(float(val_loss)):
            logger.warning("validation loss is %s: not a best checkpoint (checkpoint_best.pt is kept as it is)",
                           val_loss)
            val_loss = None
        return save(cfg, trainer, epoch_itr, val_loss)

    guarded._ls_nan_guard = True
    for attr in ("best",):
        if hasattr(save, attr):
            setattr(guarded, attr, getattr(save, attr))
    checkpoint_utils.save_checkpoint = guarded


def prepare_checkpoints(cfg) -> None:
    """Before training: a --restore-file that does not exist is an error (fairseq would train from scratch);
    temporaries of an interrupted save are removed and an unreadable checkpoint_last.pt is replaced by the newest
    readable checkpoint (:mod:`ls_fairseq.fairseq_ext.checkpoint_files`; done by the first process only)."""
    from ls_fairseq.fairseq_ext.checkpoint_files import recover_last_checkpoint

    from ls_fairseq.fairseq_ext.checkpoint_files import readable

    ckpt = cfg.checkpoint
    restore = ckpt.restore_file
    if restore != "checkpoint_last.pt" and "://" not in restore:
        if not os.path.exists(restore):
            raise SystemExit(f"lightseq-train: --restore-file {restore} does not exist (without --restore-file "
                             f"training resumes from {os.path.join(ckpt.save_dir, 'checkpoint_last.pt')} when there "
                             "is one)")
        if not readable(restore):
            raise SystemExit(f"lightseq-train: --restore-file {restore} is not a readable checkpoint (truncated, or "
                             "not a checkpoint file)")
    if restore == "checkpoint_last.pt" and int(os.environ.get("RANK", "0") or 0) == 0 and not ckpt.no_save:
        recover_last_checkpoint(ckpt.save_dir)


def check_data(cfg) -> None:
    """A translation data-bin whose train files do not fit their dictionaries is an error naming the file
    (:mod:`ls_fairseq.fairseq_ext.data_checks`)."""
    from ls_fairseq.fairseq_ext.data_checks import check_translation_data

    task = cfg.task
    if getattr(task, "_name", None) != "translation" or not getattr(task, "data", None):
        return
    problems = check_translation_data(task.data, cfg.dataset.train_subset)
    if problems:
        raise SystemExit("lightseq-train: " + "\nlightseq-train: ".join(problems))


def cli_main(argv: Optional[List[str]] = None) -> None:
    args = parse(argv)

    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils

    check_device_args(args)
    cfg = convert_namespace_to_omegaconf(args)
    prepare_checkpoints(cfg)
    check_data(cfg)
    if cfg.common.use_plasma_view:
        from fairseq.data.plasma_utils import PlasmaStore

        server = PlasmaStore(path=cfg.common.plasma_path)
        logger.info(f"Started plasma server pid {server.server.pid} {cfg.common.plasma_path}")
    if args.profile:
        import torch

        with torch.cuda.profiler.profile():
            with torch.autograd.profiler.emit_nvtx():
                distributed_utils.call_main(cfg, _train_main, ls_graph=graph_options(args))
    else:
        distributed_utils.call_main(cfg, _train_main, ls_graph=graph_options(args))


if __name__ == "__main__":
    cli_main(sys.argv[1:])
