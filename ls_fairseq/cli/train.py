"""lightseq-train: fairseq-train with the ls_fairseq plugin loaded, and bf16 on GPU.

Every fairseq-train flag works unchanged. lightseq-train adds the plugin as ``--user-dir`` (unless you give
one) and trains every run on :class:`~ls_fairseq.fairseq_ext.step.trainer.LSTrainer` (``--ls-trainer off``
keeps fairseq's Trainer); ``fairseq-train --user-dir`` does the same when the run uses the ls model, ls_adam
and the ls criterion (:mod:`~ls_fairseq.fairseq_ext.step.takeover`, which also holds the configuration
adjustments both make: bf16 on the GPU instead of fairseq's implied ``--tpu``, ls_adam's own master weights
under --fp16 / --bf16, legacy_ddp for a distributed ls_adam run, the epoch's batches kept under
``--grouped-shuffling``). lightseq-train also checks its precision flags, its checkpoints and its data before
the processes start, keeps each process on its own CPU cores, and tears the process group down at the end.
"""

import argparse
import copy
import os
import logging
import sys
from typing import List, Optional

from ls_fairseq._collective_defaults import import_collective_defaults_early
from ls_fairseq.cli import _common

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


def _train_main(cfg, **kwargs):
    """fairseq_cli.train.main in this process, on LSTrainer. distributed_utils.call_main may run this in freshly
    spawned workers: it is referenced by name, so each worker imports this module and sets itself up."""
    from fairseq_cli import train as fairseq_train

    from ls_fairseq.cli import affinity
    from ls_fairseq.fairseq_ext import patches
    from ls_fairseq.fairseq_ext.step import takeover
    from ls_fairseq.fairseq_ext.step.heap import release_heap

    patches.install_for_training()
    dt = cfg.distributed_training
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or getattr(dt, "distributed_num_procs", None) or 1)
    local_rank = int(os.environ.get("LOCAL_RANK") or getattr(dt, "device_id", 0) or 0)
    if local_rank < local_world:
        affinity.apply(local_rank, local_world)
    loop_trainer = fairseq_train.Trainer
    takeover.install(fairseq_train, always=True)
    try:
        out = fairseq_train.main(cfg, **kwargs)
    finally:
        fairseq_train.Trainer = loop_trainer  # a later fairseq-train in this process chooses for itself
        release_heap()  # what the trainer froze (step/heap.py) is collectable again
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


def _modify_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    for action in parser._actions:
        if action.dest == "bf16":
            action.help = BF16_HELP
        elif action.dest == "memory_efficient_bf16":
            action.help = MEM_BF16_HELP
        elif action.dest == "grouped_shuffling":
            action.help = GROUPED_HELP


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

    from ls_fairseq.fairseq_ext.step import takeover

    check_precision_flags(argv)
    # fairseq imports --user-dir from sys.argv while it builds the parser: keep them in step.
    _common.set_argv(argv)
    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, input_args=argv, modify_parser=_modify_parser)
    for said in takeover.adapt(args, argv):
        logger.info("lightseq-train: %s", said)
    check_training_args(args)
    buckets = getattr(args, "ls_graph_buckets", 1)
    if buckets < 1:
        raise SystemExit(f"lightseq-train: --ls-graph-buckets must be >= 1, got {buckets}")
    return args


def check_training_args(args: argparse.Namespace) -> None:
    """Clear errors for flags fairseq accepts and then fails on deep inside, or silently ignores."""
    freqs = list(getattr(args, "update_freq", None) or [1])
    if any(int(f) < 1 for f in freqs):
        raise SystemExit(f"lightseq-train: --update-freq must be >= 1, got {','.join(str(f) for f in freqs)}")
    if str(getattr(args, "arch", "")).startswith("ls_"):  # the model's own refusals, before any process starts
        from ls_fairseq.fairseq_ext.config import OptionError
        from ls_fairseq.fairseq_ext.model import LSTransformerModel

        try:
            LSTransformerModel.check_args(copy.copy(args))
        except OptionError as e:
            raise SystemExit(f"lightseq-train: {e}") from None


def cli_main(argv: Optional[List[str]] = None) -> None:
    args = parse(argv)

    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.distributed import utils as distributed_utils

    from ls_fairseq.fairseq_ext.step import run_checks

    run_checks.check_device(args)
    cfg = convert_namespace_to_omegaconf(args)
    run_checks.prepare_checkpoints(cfg, first_process=int(os.environ.get("RANK", "0") or 0) == 0)
    run_checks.check_data(cfg)
    if cfg.common.use_plasma_view:
        from fairseq.data.plasma_utils import PlasmaStore

        server = PlasmaStore(path=cfg.common.plasma_path)
        logger.info(f"Started plasma server pid {server.server.pid} {cfg.common.plasma_path}")
    if args.profile:
        import torch

        with torch.cuda.profiler.profile():
            with torch.autograd.profiler.emit_nvtx():
                distributed_utils.call_main(cfg, _train_main)
    else:
        distributed_utils.call_main(cfg, _train_main)


if __name__ == "__main__":
    cli_main(sys.argv[1:])
