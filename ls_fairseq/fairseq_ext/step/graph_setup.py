"""Whether a run replays its micro-batches from CUDA graphs, the engine that does, and its warm-up.

The engine is :class:`~ls_fairseq.fairseq_ext.graph.graph_step.GraphStep`; with it the layers' products
run through cuBLASLt (:mod:`~ls_fairseq.fairseq_ext.graph.gemm_lt`), whose kernels for the planned batch
shapes are loaded, with the first update's, by :class:`~ls_fairseq.fairseq_ext.graph.prewarm.Prewarm`
while the optimizer is built.
"""

import logging
from typing import Optional

logger = logging.getLogger("fairseq.trainer")


class GraphSetup:
    """The CUDA-graph engine of ``trainer`` (made once, when the first update asks for it) and the warm-up of
    its kernels; ``settings`` holds ``--ls-graph-step`` and ``--ls-graph-buckets``."""

    def __init__(self, trainer, settings):
        self.trainer = trainer
        self.settings = settings
        self.decided = False
        self.graphs = None  # the GraphStep, or None: each micro-batch is launched eagerly
        self.prewarm = None  # the running Prewarm, until the first update joins it
        self.prewarm_started = False

    def refused(self) -> Optional[str]:
        """Why this run does not replay graphs (None: it does)."""
        from ls_fairseq.fairseq_ext.graph import graph_step

        if self.settings.graph_step == "off":  # also every optimizer but ls_adam (StepSettings.from_cfg)
            return "--ls-graph-step off, or an optimizer other than ls_adam"
        return graph_step.unsupported_reason(self.trainer, several_gpus=self.settings.graph_step == "on")

    def engine(self):
        """The GraphStep, or None; decided once per run, the reason it is off logged once."""
        if self.decided:
            return self.graphs
        from ls_fairseq.fairseq_ext.graph import graph_step

        self.decided = True
        reason = self.refused()
        if reason is None:
            self.graphs = graph_step.GraphStep(self.trainer, self.settings.graph_buckets)
            self.plan(self.trainer.epoch_itr)
        elif self.settings.graph_step != "off":
            logger.info("CUDA-graph step off (%s): each micro-batch is launched eagerly", reason)
        return self.graphs

    def plan(self, epoch_itr) -> None:
        """The engine's batch shapes chosen from ``epoch_itr``'s batches (once the engine exists)."""
        if self.graphs is not None and epoch_itr is not None:
            self.graphs.plan(epoch_itr)

    def start_prewarm(self, prep) -> None:
        """Start the warm-up on the first batch (marked by ``prep``), once per run, when the run replays graphs;
        the layers' products through cuBLASLt then, through ATen otherwise."""
        from ls_fairseq.fairseq_ext.graph import gemm_lt, prewarm

        if self.prewarm_started:
            return
        self.prewarm_started = True
        trainer = self.trainer
        if not trainer.cuda or self.refused() is not None:
            gemm_lt.disable()  # the eager step's products: ATen's (an earlier run in this process may have set it)
            return
        preload = self._lt_products()
        sample = getattr(trainer, "_dummy_batch", None)
        if not isinstance(sample, dict) or not sample:
            return
        try:
            self.prewarm = prewarm.Prewarm(trainer._model, trainer._criterion, prep.marked_copy(sample),
                                           trainer.device, preload_tokens=preload)
        except Exception as e:  # noqa: BLE001 - the warm-up only
            logger.info("kernel warm-up before the first update not started (%s: %s)", type(e).__name__, e)

    def _lt_products(self):
        """The layers' products through cuBLASLt: one kernel per exact shape, known before it runs, so the
        warm-up loads those of the planned buckets. Returns the buckets' token counts to preload, or None."""
        from ls_fairseq.fairseq_ext.graph import gemm_lt

        if not gemm_lt.enable():
            logger.info("cuBLASLt not available in this build: the layers' products through ATen")
            return None
        logger.info("the layers' products through cuBLASLt (one algorithm per exact shape)")
        engine = self.engine()  # the bucket plan, made now rather than at the first update
        return gemm_lt.bucket_token_counts(engine.buckets) if engine is not None and engine.buckets else None

    def join_prewarm(self) -> None:
        """Wait for the warm-up (if one runs): the model runs on the trainer's thread from here."""
        if self.prewarm is not None:
            warm, self.prewarm = self.prewarm, None
            warm.join()

    def log_summary(self) -> None:
        """The epoch's graph counts and cuBLASLt's, in the log."""
        if self.graphs is not None:
            self.graphs.log_summary()
        if self.trainer.cuda:
            from ls_fairseq.fairseq_ext.graph import gemm_lt

            if gemm_lt.is_on():
                logger.info("cuBLASLt products: %s", gemm_lt.describe())
