"""Every change the plugin makes to fairseq itself, installed from here.

At import (:func:`install_at_import`, by ``ls_fairseq.fairseq_ext``): fairseq's checkpoint loading under
torch >= 2.6 (:mod:`~ls_fairseq.fairseq_ext.compat`, which applies itself when imported so that it also
works without the rest of the plugin), the checks of every checkpoint fairseq loads, of ``--max-tokens``
against the data and of raw text, printed as one line (:mod:`~ls_fairseq.fairseq_ext.checkpoint_files`,
:mod:`~ls_fairseq.fairseq_ext.data_checks`), and the trainer choice of fairseq's training loop
(:mod:`~ls_fairseq.fairseq_ext.step.takeover`). For a run that trains on LSTrainer
(:func:`install_for_training`): atomic checkpoint copies, no NaN best checkpoint, and FP16Optimizer's
gradient factor reset under bf16. A run without the ls components gets none of the training ones.
"""

import logging
import math

logger = logging.getLogger("ls_fairseq.patches")


def install_at_import() -> None:
    from fairseq import utils

    from ls_fairseq.fairseq_ext import compat  # noqa: F401  (applies itself)
    from ls_fairseq.fairseq_ext import checkpoint_files, data_checks

    checkpoint_files.install_checkpoint_checks()
    data_checks.install_max_tokens_check()
    data_checks.install_raw_text_check()
    data_checks.install_error_hook()
    install_trainer_choice()
    if not getattr(utils.import_user_module, "_ls_trainer_choice", False):
        # fairseq's training loop imports the user dir first: a loop module imported after the plugin gets the
        # trainer choice there
        original = utils.import_user_module

        def import_user_module(args):
            out = original(args)
            install_trainer_choice()
            return out

        import_user_module._ls_trainer_choice = True
        utils.import_user_module = import_user_module


def install_trainer_choice() -> None:
    """fairseq's training loop (when imported) builds LSTrainer for a run with the ls components, after the
    training patches (:mod:`~ls_fairseq.fairseq_ext.step.takeover`)."""
    from ls_fairseq.fairseq_ext.step import takeover

    takeover.install(prepare=install_for_training)


def install_for_training() -> None:
    """The patches a run on LSTrainer needs (idempotent)."""
    from ls_fairseq.fairseq_ext.checkpoint_files import install_atomic_copies

    install_atomic_copies()  # checkpoint_last / checkpoint_best are never left half-written
    keep_nan_from_best()
    patch_fp16_optimizer_for_bf16()


def patch_fp16_optimizer_for_bf16() -> None:
    """FP16Optimizer.zero_grad resets the gradient factor without a scaler too.

    fairseq 0.12's MemoryEfficientFP16Optimizer resets ``_multiply_factor`` to 1 in zero_grad when ``scaler is
    None`` (bf16); FP16Optimizer only resets it from the loss scale, so under ``--bf16`` the factor of every update
    (1/sample_size, clip coefficients) keeps multiplying into the next whenever the wrapped optimizer steps with a
    scale instead of unscaling the gradients first (ls_adam does). Idempotent."""
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


def keep_nan_from_best() -> None:
    """A validation loss that is NaN or infinite never makes a checkpoint_best.pt: the save goes on without it
    (fairseq saves the first one as best, since nothing compares better than a first value). Idempotent."""
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
    if hasattr(save, "best"):
        guarded.best = save.best
    checkpoint_utils.save_checkpoint = guarded
