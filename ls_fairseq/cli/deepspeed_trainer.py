"""The trainer behind lightseq-deepspeed (:mod:`ls_fairseq.cli.deepspeed_train`).

:class:`DeepSpeedTrainer` builds fairseq's task, model and criterion, hands the model to a DeepSpeed
engine, and runs one update (its micro-batches, normalised by the whole update's sample size over
all ranks, as fairseq-train does), validation, and the checkpoints: DeepSpeed's own in
``--save-dir/deepspeed`` (training resumes from it) beside fairseq-format ``checkpoint*.pt`` files.
fairseq's learning-rate scheduler drives the DeepSpeed optimizer through :func:`_optimizer_view`.
"""

import logging
import math
import os
from typing import Any, Dict, List, Optional

logger = logging.getLogger("ls_fairseq.cli.deepspeed_train")  # the command's logger: the same log lines

DS_SUBDIR = "deepspeed"
DS_TAG = "last"


# ---------------------------------------------------------------------------------------------
# the DeepSpeed optimizer seen by fairseq's lr scheduler
# ---------------------------------------------------------------------------------------------


def _optimizer_view(cfg, engine):
    from fairseq.optim import FairseqOptimizer

    class DeepSpeedOptimizerView(FairseqOptimizer):
        """get_lr / set_lr on the DeepSpeed optimizer's param groups, for fairseq's lr schedulers.
        (DeepSpeed's fp16 / bf16 / ZeRO wrappers are not torch.optim.Optimizer instances, which
        FairseqOptimizer.optimizer insists on; their param_groups are the wrapped optimizer's.)"""

        def __init__(self):
            super().__init__(cfg.optimizer)

        @property
        def optimizer(self):
            return engine.optimizer

        @property
        def param_groups(self):
            return engine.optimizer.param_groups

    return DeepSpeedOptimizerView()


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


class DeepSpeedTrainer:
    def __init__(self, cfg, ds_config):
        import deepspeed
        import torch
        from fairseq import tasks, utils
        from fairseq.optim import lr_scheduler

        self.cfg = cfg
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.task = tasks.setup_task(cfg.task)
        for subset in cfg.dataset.valid_subset.split(","):
            self.task.load_dataset(subset, combine=False, epoch=1)
        model = self.task.build_model(cfg.model)
        self.criterion = self.task.build_criterion(cfg.criterion)
        logger.info(model)
        n_params = sum(p.numel() for p in model.parameters())
        logger.info(f"model {cfg.model._name}, criterion {self.criterion.__class__.__name__}, {n_params} parameters")
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config)
        self.device = self.engine.device
        self.criterion = self.criterion.to(self.device)
        self.fp16 = bool(ds_config.get("fp16", {}).get("enabled"))
        self.lr_scheduler = lr_scheduler.build_lr_scheduler(cfg.lr_scheduler, _optimizer_view(cfg, self.engine))
        self.num_updates = 0
        self.best = None
        self.max_positions = utils.resolve_max_positions(
            self.task.max_positions(), self.engine.module.max_positions(), cfg.dataset.max_tokens)
        self._torch = torch
        self._log_keys = None  # the logging-output keys, agreed between ranks on the first reduction
        self._dummy = None  # a batch for ranks that run out of batches before the others
        logger.info(f"DeepSpeed engine on {self.device}: world size {self.world_size}, "
                    f"fp16={self.fp16}, bf16={bool(ds_config.get('bf16', {}).get('enabled'))}, "
                    f"ZeRO stage {self.engine.zero_optimization_stage()}, "
                    f"optimizer {self.engine.optimizer.__class__.__name__}")

    # -- data -------------------------------------------------------------------------------------
    def train_iterator(self, epoch, load=True):
        cfg = self.cfg
        if load:
            self.task.load_dataset(cfg.dataset.train_subset, epoch=epoch, combine=True)
        return self.task.get_batch_iterator(
            dataset=self.task.dataset(cfg.dataset.train_subset), max_tokens=cfg.dataset.max_tokens,
            max_sentences=cfg.dataset.batch_size, max_positions=self.max_positions, ignore_invalid_inputs=True,
            required_batch_size_multiple=cfg.dataset.required_batch_size_multiple, seed=cfg.common.seed,
            num_shards=self.world_size, shard_id=self.rank, num_workers=cfg.dataset.num_workers, epoch=epoch,
            data_buffer_size=cfg.dataset.data_buffer_size)

    def _to_device(self, sample):
        from fairseq import utils

        return utils.apply_to_sample(lambda t: t.to(self.device, non_blocking=True), sample)

    def _sum_logs(self, logs: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        """Sum the logging outputs of all micro batches and all ranks into one."""
        keys = {k for log in logs for k, v in log.items() if isinstance(v, (int, float)) or
                (self._torch.is_tensor(v) and v.numel() == 1)}
        if self._log_keys is None or not keys <= self._log_keys:
            if self.world_size > 1:
                gathered = [None] * self.world_size
                self._torch.distributed.all_gather_object(gathered, sorted(keys))
                keys = set().union(*map(set, gathered))
            self._log_keys = keys | (self._log_keys or set())
        keys = sorted(self._log_keys)
        vals = self._torch.tensor([float(sum(float(log.get(k, 0)) for log in logs)) for k in keys] + [0.0],
                                  dtype=self._torch.float64, device=self.device)
        if self.world_size > 1:
            self._torch.distributed.all_reduce(vals)
        return [dict(zip(keys, vals.tolist()))]

    def _all_sum(self, x: float) -> float:
        if self.world_size == 1:
            return x
        t = self._torch.tensor([x], dtype=self._torch.float64, device=self.device)
        self._torch.distributed.all_reduce(t)
        return float(t.item())

    def _loss_scale(self) -> Optional[float]:
        if not self.fp16:
            return None
        for name in ("cur_scale", "loss_scale"):
            value = getattr(self.engine.optimizer, name, None)
            if isinstance(value, (int, float)) or self._torch.is_tensor(value):
                return float(value)
        return None

    def _grad_norm(self) -> Optional[float]:
        """The gradient norm of the update when DeepSpeed does not report one (fp32, ZeRO stage 0:
        the all-reduced gradients are in .grad after the last backward)."""
        if self.engine.zero_optimization_stage() != 0 or self.fp16 or self.engine.bfloat16_enabled():
            return None
        grads = [p.grad.detach().float().norm() for p in self.engine.module.parameters() if p.grad is not None]
        return float(self._torch.stack(grads).norm()) if grads else 0.0

    # -- one update ---------------------------------------------------------------------------------
    def train_step(self, samples):
        from fairseq.logging import metrics

        cfg = self.cfg
        samples = [self._to_device(s) for s in samples if s]
        if samples:
            self._dummy = samples[0]
        local = sum(float(s["target"].size(0) if cfg.optimization.sentence_avg else s["ntokens"]) for s in samples)
        total = self._all_sum(local)
        if total == 0:
            return None
        # DeepSpeed averages gradients over ranks; fairseq normalises by the update's total sample size.
        scale = self.world_size / total
        self.engine.train()
        self.criterion.train()
        logs = []
        metrics.log_start_time("train_wall", priority=800, round=0)
        n_micro = int(cfg.optimization.update_freq[0])
        for i in range(n_micro):
            if i < len(samples):
                loss, _sample_size, log = self.criterion(self.engine, samples[i])
                logs.append(log)
            else:  # fewer batches than --update-freq on this rank: zero-loss step keeps ranks in step
                if self._dummy is None:
                    raise RuntimeError("this rank has no training batch at all: use fewer ranks or more data")
                loss, _sample_size, log = self.criterion(self.engine, self._dummy)
                loss = loss * 0.0
            self.engine.backward(loss * scale, scale_wrt_gas=False)
            if i == n_micro - 1:
                gnorm = self._grad_norm()
            self.engine.step()
        metrics.log_stop_time("train_wall")
        logs = self._sum_logs(logs)
        if not self.engine.was_step_applied():
            scale = self._loss_scale()
            logger.info("gradient overflow: update skipped" + (f", loss scale now {scale}" if scale else ""))
            return None
        if not math.isfinite(logs[0].get("loss", 0.0)):
            raise FloatingPointError(f"non-finite loss {logs[0].get('loss')} at update {self.num_updates + 1}")
        self.num_updates += 1
        lr = self.lr_scheduler.step_update(self.num_updates)
        with metrics.aggregate() as _agg:
            self.task.reduce_metrics(logs, self.criterion)
            metrics.log_speed("ups", 1.0, priority=100, round=2)
            gnorm = self.engine.get_global_grad_norm() if gnorm is None else gnorm
            if gnorm is not None:
                metrics.log_scalar("gnorm", float(gnorm), priority=400, round=3)
            loss_scale = self._loss_scale()
            if loss_scale is not None:
                metrics.log_scalar("loss_scale", loss_scale, priority=700, round=4)
            metrics.log_scalar("lr", lr, weight=0, priority=300)
            metrics.log_scalar("num_updates", self.num_updates, weight=0, priority=200)
        return logs[0]

    # -- validation ---------------------------------------------------------------------------------
    def validate(self, epoch) -> Optional[float]:
        from fairseq.logging import metrics, progress_bar

        cfg = self.cfg
        first = None
        for idx, subset in enumerate(cfg.dataset.valid_subset.split(",")):
            logger.info(f'begin validation on "{subset}" subset')
            itr = self.task.get_batch_iterator(
                dataset=self.task.dataset(subset), max_tokens=cfg.dataset.max_tokens_valid,
                max_sentences=cfg.dataset.batch_size_valid, max_positions=self.max_positions,
                ignore_invalid_inputs=cfg.dataset.skip_invalid_size_inputs_valid_test,
                required_batch_size_multiple=cfg.dataset.required_batch_size_multiple, seed=cfg.common.seed,
                num_shards=self.world_size, shard_id=self.rank, num_workers=cfg.dataset.num_workers,
            ).next_epoch_itr(shuffle=False, set_dataset_epoch=False)
            progress = progress_bar.progress_bar(
                itr, log_format=cfg.common.log_format, log_interval=cfg.common.log_interval, epoch=epoch,
                prefix=f"valid on '{subset}' subset",
                default_log_format="tqdm" if not cfg.common.no_progress_bar else "simple")
            logs = []
            model = self.engine.module
            model.eval()
            self.criterion.eval()
            with self._torch.no_grad():
                for sample in progress:
                    if sample:
                        _loss, _size, log = self.task.valid_step(self._to_device(sample), model, self.criterion)
                        logs.append(log)
            with metrics.aggregate(new_root=True) as agg:
                self.task.reduce_metrics(self._sum_logs(logs), self.criterion)
            stats = agg.get_smoothed_values()
            stats["num_updates"] = self.num_updates
            metric = stats[cfg.checkpoint.best_checkpoint_metric]
            if idx == 0:
                first = metric
                better = max if cfg.checkpoint.maximize_best_checkpoint_metric else min
                best = metric if self.best is None else better(self.best, metric)
                stats[f"best_{cfg.checkpoint.best_checkpoint_metric}"] = best
            progress.print(stats, tag=subset, step=self.num_updates)
        return first

    # -- checkpoints --------------------------------------------------------------------------------
    def save(self, epoch_itr, val_metric, end_of_epoch):
        from fairseq import checkpoint_utils, utils
        from fairseq.logging import metrics
        from omegaconf import OmegaConf

        cfg = self.cfg
        improved = False
        if val_metric is not None:
            better = (lambda a, b: a > b) if cfg.checkpoint.maximize_best_checkpoint_metric else (lambda a, b: a < b)
            improved = self.best is None or better(val_metric, self.best)
            if improved:
                self.best = val_metric
        if cfg.checkpoint.no_save:  # --no-save: fairseq-train writes nothing either
            return
        client = {"train_iterator": epoch_itr.state_dict(), "num_updates": self.num_updates, "best": self.best,
                  "lr_scheduler": self.lr_scheduler.state_dict(), "metrics": metrics.state_dict()}
        save_dir = cfg.checkpoint.save_dir
        self.engine.save_checkpoint(os.path.join(save_dir, DS_SUBDIR), tag=DS_TAG, client_state=client)
        if self.rank != 0:
            return
        state = {
            "args": None,
            "cfg": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
            "model": self.engine.module.state_dict(),
            "criterion": self.criterion.state_dict() if utils.has_parameters(self.criterion) else None,
            "optimizer_history": [{"criterion_name": self.criterion.__class__.__name__,
                                   "optimizer_name": f"DeepSpeed{self.engine.optimizer.__class__.__name__}",
                                   "lr_scheduler_state": self.lr_scheduler.state_dict(),
                                   "num_updates": self.num_updates}],
            "task_state": self.task.state_dict(),
            "extra_state": {"train_iterator": epoch_itr.state_dict(), "val_loss": val_metric, "best": self.best,
                            "metrics": metrics.state_dict(), "deepspeed_checkpoint": os.path.join(DS_SUBDIR, DS_TAG)},
            "last_optimizer_state": None,  # the optimizer state lives in the DeepSpeed checkpoint
        }
        names = ["checkpoint_last.pt"]
        if end_of_epoch and not cfg.checkpoint.no_epoch_checkpoints and epoch_itr.epoch % cfg.checkpoint.save_interval == 0:
            names.append(f"checkpoint{epoch_itr.epoch}.pt")
        elif (not end_of_epoch and cfg.checkpoint.save_interval_updates > 0
              and self.num_updates % cfg.checkpoint.save_interval_updates == 0):
            names.append(f"checkpoint_{epoch_itr.epoch}_{self.num_updates}.pt")
        if improved:
            names.append("checkpoint_best.pt")
        for name in names:
            checkpoint_utils.torch_persistent_save(state, os.path.join(save_dir, name))
        logger.info(f"saved {', '.join(names)} and {DS_SUBDIR}/{DS_TAG} in {save_dir} (epoch {epoch_itr.epoch} "
                    f"@ {self.num_updates} updates, {cfg.checkpoint.best_checkpoint_metric} {val_metric})")

    def load(self):
        """Resume from save_dir/deepspeed when it exists; return the train iterator to continue with."""
        from fairseq.logging import meters, metrics

        cfg = self.cfg
        ds_dir = os.path.join(cfg.checkpoint.save_dir, DS_SUBDIR)
        if cfg.checkpoint.reset_optimizer or not os.path.isfile(os.path.join(ds_dir, "latest")):
            return self.train_iterator(epoch=1)
        path, client = self.engine.load_checkpoint(ds_dir, tag=None, load_optimizer_states=True,
                                                   load_lr_scheduler_states=False)
        if path is None:
            raise SystemExit(f"lightseq-deepspeed: could not load the DeepSpeed checkpoint in {ds_dir}")
        self.num_updates = int(client["num_updates"])
        self.best = client.get("best")
        if not cfg.checkpoint.reset_lr_scheduler:
            self.lr_scheduler.load_state_dict(client["lr_scheduler"])
        if not cfg.checkpoint.reset_meters and client.get("metrics"):
            metrics.load_state_dict(client["metrics"])
            for meter in metrics.get_meters("default").values():
                if isinstance(meter, (meters.TimeMeter, meters.StopwatchMeter)):
                    meter.reset()  # start times of another process mean nothing here
            metrics.log_start_time("wall", priority=790, round=0)
        self.lr_scheduler.step_update(self.num_updates)
        itr_state = client["train_iterator"]
        if cfg.checkpoint.reset_dataloader:
            itr_state = {"epoch": 1}
        epoch_itr = self.train_iterator(epoch=itr_state["epoch"])
        if "iterations_in_epoch" in itr_state:
            epoch_itr.load_state_dict(itr_state)
        logger.info(f"resumed from {path}: epoch {epoch_itr.epoch}, {self.num_updates} updates")
        return epoch_itr
