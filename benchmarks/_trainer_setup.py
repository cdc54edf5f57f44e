"""What the profiling scripts share: option parsing, a fairseq trainer built as lightseq-train builds it, and the
busy time of a kernel timeline."""


def pop_option(argv, name, default, cast):
    """Remove ``name VALUE`` from argv and return cast(VALUE), or default when absent."""
    if name in argv:
        i = argv.index(name)
        value = cast(argv[i + 1])
        del argv[i:i + 2]
        return value
    return default


def pop_flag(argv, name):
    """Remove the flag ``name`` from argv; True when it was there."""
    if name in argv:
        argv.remove(name)
        return True
    return False


def build(argv):
    """fairseq-train flags -> (cfg, task, model, criterion), the train split loaded.

    Flags are parsed like lightseq-train parses them (--bf16 trains on the GPU; ls_adam keeps the
    fp32 master weights under --fp16 / --bf16)."""
    import ls_fairseq.fairseq_ext  # noqa: F401  (compat fixes + ls registrations)
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from ls_fairseq.fairseq_ext.patches import patch_fp16_optimizer_for_bf16
    from ls_fairseq.fairseq_ext.step.takeover import fix_bf16, ls_adam_owns_master_weights

    args = options.parse_args_and_arch(options.get_training_parser(), argv)
    fix_bf16(args, argv)  # --bf16 on the GPU, not --tpu
    patch_fp16_optimizer_for_bf16()
    ls_adam_owns_master_weights(args)
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    task.load_dataset(cfg.dataset.train_subset, combine=False, epoch=1)
    return cfg, task, task.build_model(cfg.model), task.build_criterion(cfg.criterion)


def first_batches(trainer, n):
    """The first n batches of epoch 1 (shuffled as fairseq shuffles them)."""
    itr = trainer.get_train_iterator(epoch=1, load_dataset=False).next_epoch_itr(shuffle=True)
    return [b for _, b in zip(range(n), itr)]


def covered_time(spans):
    """Length of the union of (start, end) intervals: the time at least one of them was running."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
