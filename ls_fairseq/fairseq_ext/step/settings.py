"""The configuration values the training step reads, read once from fairseq's config.

Attribute reads on fairseq's omegaconf config cost microseconds each, and the step reads these at
every update. The CUDA-graph flags (``--ls-graph-step``, ``--ls-graph-buckets``) are ls_adam's
options (:class:`~ls_fairseq.fairseq_ext.optimizer.LSAdamConfig`): the graphs need ls_adam.
"""

from dataclasses import dataclass, field
from typing import List

DEFAULT_GRAPH_BUCKETS = 64


@dataclass(frozen=True)
class StepSettings:
    clip: float = 0.0
    empty_cache_freq: int = 0
    log_interval: int = 1
    every: List[int] = field(default_factory=list)  # --save-interval-updates, --validate-interval-updates
    max_update: int = 0
    timed_stop: bool = False
    fp16: bool = False
    bf16: bool = False
    seed: int = 1
    graph_step: str = "off"  # auto: one GPU; on: several GPUs too; off
    graph_buckets: int = DEFAULT_GRAPH_BUCKETS

    @classmethod
    def from_cfg(cls, cfg) -> "StepSettings":
        opt = cfg.optimizer
        ls_adam = getattr(opt, "_name", None) == "ls_adam"
        buckets = int(getattr(opt, "ls_graph_buckets", DEFAULT_GRAPH_BUCKETS)) if ls_adam else DEFAULT_GRAPH_BUCKETS
        if buckets < 1:
            raise ValueError(f"--ls-graph-buckets must be >= 1, got {buckets}")
        return cls(
            clip=float(cfg.optimization.clip_norm),
            empty_cache_freq=int(cfg.common.empty_cache_freq),
            log_interval=max(1, int(cfg.common.log_interval)),
            every=[int(e) for e in (cfg.checkpoint.save_interval_updates, cfg.dataset.validate_interval_updates)
                   if e and e > 0],
            max_update=int(cfg.optimization.max_update or 0),
            timed_stop=cfg.optimization.stop_time_hours > 0,
            fp16=bool(cfg.common.fp16),
            bf16=bool(cfg.common.bf16),
            seed=int(cfg.common.seed),
            graph_step=str(getattr(opt, "ls_graph_step", "auto")) if ls_adam else "off",
            graph_buckets=buckets,
        )

    def count_is_read_after(self, num_updates: int) -> bool:
        """Whether fairseq's loop acts on the update count after update ``num_updates`` by the settings alone
        (a log line, a checkpoint, validation, the last update, a timed stop)."""
        if num_updates % self.log_interval == 0 or any(num_updates % e == 0 for e in self.every):
            return True
        return bool((self.max_update and num_updates >= self.max_update) or self.timed_stop)
