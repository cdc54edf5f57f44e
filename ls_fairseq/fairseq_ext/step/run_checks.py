"""The checks a training run makes before it starts: its checkpoints, its data and its device.

:func:`prepare_checkpoints`: a --restore-file that does not exist or cannot be read is an error (fairseq would
train from scratch, or fail deep inside torch.load); temporaries of an interrupted save are removed and an
unreadable checkpoint_last.pt is replaced by the newest readable checkpoint
(:mod:`~ls_fairseq.fairseq_ext.checkpoint_files`). :func:`check_data`: a translation data-bin whose train
files do not fit their dictionaries is an error naming the file (:mod:`~ls_fairseq.fairseq_ext.data_checks`).
:func:`check_device`: flags this machine cannot run (``--fp8`` without an FP8 GPU).
"""

import os


def prepare_checkpoints(cfg, prog: str = "lightseq-train", first_process: bool = True) -> None:
    """The checkpoint checks (module docstring); the recovery of checkpoint_last.pt on the ``first_process``
    only. Raises SystemExit with one line prefixed by ``prog``."""
    from ls_fairseq.fairseq_ext.checkpoint_files import readable, recover_last_checkpoint

    ckpt = cfg.checkpoint
    restore = ckpt.restore_file
    if restore != "checkpoint_last.pt" and "://" not in restore:
        if not os.path.exists(restore):
            raise SystemExit(f"{prog}: --restore-file {restore} does not exist (without --restore-file "
                             f"training resumes from {os.path.join(ckpt.save_dir, 'checkpoint_last.pt')} when there "
                             "is one)")
        if not readable(restore):
            raise SystemExit(f"{prog}: --restore-file {restore} is not a readable checkpoint (truncated, or "
                             "not a checkpoint file)")
    if restore == "checkpoint_last.pt" and first_process and not ckpt.no_save:
        recover_last_checkpoint(ckpt.save_dir)


def check_data(cfg, prog: str = "lightseq-train") -> None:
    """The data checks (module docstring). Raises SystemExit with one line per problem, prefixed by ``prog``."""
    from ls_fairseq.fairseq_ext.data_checks import check_translation_data

    task = cfg.task
    if getattr(task, "_name", None) != "translation" or not getattr(task, "data", None):
        return
    problems = check_translation_data(task.data, cfg.dataset.train_subset)
    if problems:
        raise SystemExit(f"{prog}: " + f"\n{prog}: ".join(problems))


def check_device(args, prog: str = "lightseq-train") -> None:
    """Flags that cannot run on this machine, checked before training starts (not at parse time, where a GPU
    configuration may be parsed anywhere). ``args``: a parsed Namespace or a flat view of fairseq's config.
    Raises SystemExit with one line prefixed by ``prog``."""
    if not getattr(args, "fp8", False):
        return
    import torch

    from ls_fairseq.ops.fp8 import fp8_unavailable_reason

    on_gpu = not getattr(args, "cpu", False) and torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    dtype = (torch.bfloat16 if getattr(args, "bf16", False) else
             torch.float16 if getattr(args, "fp16", False) or getattr(args, "memory_efficient_fp16", False)
             else torch.float32)
    reason = fp8_unavailable_reason(device, dtype)
    if reason is not None:
        raise SystemExit(f"{prog}: {reason}")
