"""lightseq-deepspeed: train a fairseq model under DeepSpeed.

    deepspeed --num_gpus 2 $(which lightseq-deepspeed) data-bin/wmt14_en_de \\
        --arch ls_transformer_wmt_en_de_big_t2t --share-all-embeddings \\
        --criterion ls_label_smoothed_cross_entropy --max-tokens 8192 \\
        --deepspeed_config configs/deepspeed/ds_fp16_zero2.json

fairseq builds what defines the experiment (task, data, batching, model, criterion, learning-rate
schedule, validation, logging, checkpoint files); DeepSpeed owns what is in the JSON (optimizer,
fp16 / bf16, ZeRO stage 0-2, gradient clipping). This module is the command: its arguments, the
DeepSpeed config and the training loop; the trainer it drives (one update, validation,
checkpoints) is :mod:`ls_fairseq.cli.deepspeed_trainer`. docs/deepspeed.md has the rules the JSON
must follow, how the fairseq flags and the JSON meet, and the checkpoint files.
"""

import json
import logging
import math
import os
import sys
import time
from typing import Any, Dict, List, Optional

from ls_fairseq.cli import _common
from ls_fairseq.cli.deepspeed_trainer import DeepSpeedTrainer

logger = logging.getLogger("ls_fairseq.cli.deepspeed_train")


# ---------------------------------------------------------------------------------------------
# arguments and the DeepSpeed config
# ---------------------------------------------------------------------------------------------


def parse(argv: Optional[List[str]] = None):
    argv = _common.prepare(argv)
    from fairseq import options

    _common.set_argv(argv)
    parser = options.get_training_parser()
    group = parser.add_argument_group("DeepSpeed")
    group.add_argument("--deepspeed_config", "--deepspeed-config", metavar="JSON", required=True,
                       help="DeepSpeed config file (optimizer, fp16/bf16, zero_optimization)")
    group.add_argument("--deepspeed", action="store_true", help="accepted for compatibility; always on")
    args = options.parse_args_and_arch(parser, input_args=argv)
    for flag in ("--fp16", "--bf16", "--memory-efficient-fp16", "--memory-efficient-bf16", "--amp"):
        if _common.has_flag(argv, flag):
            raise SystemExit(f"lightseq-deepspeed: {flag} is not used here: precision comes from the "
                             f"\"fp16\" / \"bf16\" sections of --deepspeed_config")
    args.tpu = False
    return args


def _fairseq_adam(cfg) -> Dict[str, Any]:
    """A DeepSpeed "optimizer" section from fairseq's optimizer flags (Adam, no decoupled decay)."""
    opt = cfg.optimizer
    betas = getattr(opt, "adam_betas", "(0.9, 0.999)") if opt is not None else "(0.9, 0.999)"
    if isinstance(betas, str):
        betas = eval(betas)  # fairseq keeps "--adam-betas '(0.9, 0.98)'" as a string
    params = {
        "lr": float(cfg.optimization.lr[0]),
        "betas": [float(b) for b in betas],
        "eps": float(getattr(opt, "adam_eps", 1e-8) if opt is not None else 1e-8),
        "weight_decay": float(getattr(opt, "weight_decay", 0.0) if opt is not None else 0.0),
        "torch_adam": True,
        "adam_w_mode": False,
    }
    return {"type": "Adam", "params": params}


def load_ds_config(path: str, cfg) -> Dict[str, Any]:
    """Read the JSON and fill in the keys that follow from fairseq's flags."""
    if not os.path.isfile(path):
        raise SystemExit(f"lightseq-deepspeed: --deepspeed_config {path} not found")
    with open(path) as f:
        try:
            ds = json.load(f)
        except json.JSONDecodeError as e:
            raise SystemExit(f"lightseq-deepspeed: {path} is not valid JSON: {e}") from None
    if "scheduler" in ds:
        raise SystemExit(f"lightseq-deepspeed: {path} has a \"scheduler\" section; remove it, the learning "
                         "rate comes from fairseq's --lr / --lr-scheduler")
    stage = int(ds.get("zero_optimization", {}).get("stage", 0))
    if stage > 2:
        raise SystemExit(f"lightseq-deepspeed: ZeRO stage {stage} is not supported (stages 0-2 keep the "
                         "whole model on every rank, which the fairseq-format checkpoints need)")
    if ds.get("fp16", {}).get("enabled") and ds.get("bf16", {}).get("enabled"):
        raise SystemExit(f"lightseq-deepspeed: {path} enables both fp16 and bf16")
    update_freq = int(cfg.optimization.update_freq[0])
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in ds:
            logger.info(f"deepspeed config: ignoring {key}={ds[key]} (batches come from --max-tokens / --update-freq)")
    ds.pop("train_batch_size", None)
    ds["train_micro_batch_size_per_gpu"] = 1
    ds["gradient_accumulation_steps"] = update_freq
    if "gradient_clipping" not in ds and cfg.optimization.clip_norm > 0:
        ds["gradient_clipping"] = float(cfg.optimization.clip_norm)
    if "optimizer" not in ds:
        ds["optimizer"] = _fairseq_adam(cfg)
    ds.setdefault("steps_per_print", 10 ** 9)  # fairseq does the logging
    return ds


def _skip_cpu_shm_comm():
    """On the CPU accelerator DeepSpeed JIT-compiles a shared-memory all-reduce (a C++ build on
    first use). gloo's all-reduce works without it; LS_DEEPSPEED_CPU_SHM=1 builds it."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu" or os.environ.get("LS_DEEPSPEED_CPU_SHM") == "1":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    logger.info("CPU accelerator: using gloo all-reduce without DeepSpeed's shm op (LS_DEEPSPEED_CPU_SHM=1 builds it)")


# ---------------------------------------------------------------------------------------------
# training (the trainer itself: ls_fairseq/cli/deepspeed_trainer.py)
# ---------------------------------------------------------------------------------------------


def train(cfg, trainer: DeepSpeedTrainer, epoch_itr):
    from fairseq.data import iterators
    from fairseq.logging import metrics, progress_bar

    from ls_fairseq.fairseq_ext.step.heap import settle_heap

    max_epoch = cfg.optimization.max_epoch or math.inf
    max_update = cfg.optimization.max_update or math.inf
    trainer.lr_scheduler.step_begin_epoch(epoch_itr.next_epoch_idx)
    trainer.lr_scheduler.step_update(trainer.num_updates)
    while epoch_itr.next_epoch_idx <= max_epoch and trainer.num_updates < max_update:
        itr = epoch_itr.next_epoch_itr(fix_batches_to_gpus=cfg.distributed_training.fix_batches_to_gpus,
                                       shuffle=epoch_itr.next_epoch_idx > cfg.dataset.curriculum)
        itr = iterators.GroupedIterator(itr, int(cfg.optimization.update_freq[0]))
        progress = progress_bar.progress_bar(
            itr, log_format=cfg.common.log_format, log_interval=cfg.common.log_interval, epoch=epoch_itr.epoch,
            default_log_format="tqdm" if not cfg.common.no_progress_bar else "simple")
        logger.info(f"begin training epoch {epoch_itr.epoch}")
        settle_heap()  # no pause of the garbage collector's in the epoch's updates (fairseq_ext/step/heap.py)
        stop = False
        val = None
        with metrics.aggregate("train"):
            for samples in progress:
                with metrics.aggregate("train_inner"):
                    done = trainer.train_step(samples)
                if done is not None and trainer.num_updates % cfg.common.log_interval == 0:
                    stats = metrics.get_smoothed_values("train_inner")
                    stats["wall"] = round(metrics.get_meter("default", "wall").elapsed_time, 0)
                    progress.log(stats, tag="train_inner", step=trainer.num_updates)
                    metrics.reset_meters("train_inner")
                stop = trainer.num_updates >= max_update
                n = trainer.num_updates
                mid_epoch = done is not None and not epoch_itr.end_of_epoch() and not stop
                if mid_epoch and cfg.dataset.validate_interval_updates > 0 and n % cfg.dataset.validate_interval_updates == 0:
                    val = trainer.validate(epoch_itr.epoch)
                if mid_epoch and cfg.checkpoint.save_interval_updates > 0 and n % cfg.checkpoint.save_interval_updates == 0:
                    trainer.save(epoch_itr, val, end_of_epoch=False)
                if stop:
                    break
        stats = metrics.get_smoothed_values("train")
        stats["wall"] = round(metrics.get_meter("default", "wall").elapsed_time, 0)
        progress.print(stats, tag="train", step=trainer.num_updates)
        metrics.reset_meters("train")
        end_of_epoch = epoch_itr.end_of_epoch()
        if stop or epoch_itr.epoch % cfg.dataset.validate_interval == 0:
            val = trainer.validate(epoch_itr.epoch)
        trainer.lr_scheduler.step(epoch_itr.epoch, val)
        if stop or epoch_itr.epoch % cfg.checkpoint.save_interval == 0:
            trainer.save(epoch_itr, val, end_of_epoch=end_of_epoch)
        if stop:
            break
        epoch_itr = trainer.train_iterator(epoch_itr.next_epoch_idx, load=trainer.task.has_sharded_data("train"))
    logger.info(f"done training: {trainer.num_updates} updates, best {cfg.checkpoint.best_checkpoint_metric} "
                f"{trainer.best}")


def main(args) -> None:
    import deepspeed
    from fairseq import utils
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf
    from fairseq.logging import metrics
    from omegaconf import open_dict

    from ls_fairseq.fairseq_ext.step.heap import release_heap

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cfg = convert_namespace_to_omegaconf(args)
    utils.import_user_module(cfg.common)
    with open_dict(cfg):
        cfg.distributed_training.distributed_world_size = world_size
        cfg.distributed_training.distributed_rank = rank
        cfg.distributed_training.device_id = int(os.environ.get("LOCAL_RANK", cfg.distributed_training.device_id))
    if rank != 0:
        logging.getLogger().setLevel(logging.WARNING)
    ds_config = load_ds_config(args.deepspeed_config, cfg)
    _skip_cpu_shm_comm()
    if "RANK" not in os.environ:
        logger.info("not started by the deepspeed launcher: running as a single process")
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    deepspeed.init_distributed()
    utils.set_torch_seed(cfg.common.seed)
    os.makedirs(cfg.checkpoint.save_dir, exist_ok=True)
    logger.info(cfg)
    logger.info(f"deepspeed config: {json.dumps(ds_config)}")
    metrics.reset()
    metrics.log_start_time("wall", priority=790, round=0)
    trainer = DeepSpeedTrainer(cfg, ds_config)
    epoch_itr = trainer.load()
    start = time.time()
    try:
        train(cfg, trainer, epoch_itr)
    finally:
        release_heap()  # what train() froze (fairseq_ext/step/heap.py) is collectable again
    logger.info(f"training took {time.time() - start:.1f} s")
    from ls_fairseq.cli.train import destroy_process_group

    destroy_process_group()  # while the process runs normally, not at interpreter shutdown


def cli_main(argv: Optional[List[str]] = None) -> None:
    args = parse(argv)
    main(args)


if __name__ == "__main__":
    cli_main(sys.argv[1:])
