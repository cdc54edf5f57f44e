"""Import torch.distributed.nn.functional before any process group exists.

torch.distributed.nn.functional gives its collectives ``group=group.WORLD`` as a default
argument, evaluated when the module is first imported. torch.optim imports it (through
torch._dynamo) when the first optimizer is built, which in fairseq's training happens after the
process group exists: the defaults would then hold the default group for the rest of the
process, ``destroy_process_group()`` could not free it, and its threads (gloo's workers, NCCL's
watchdog) would still run when the interpreter shuts down. A gloo worker that releases a finished
collective's tensors at that moment needs the GIL, is ended by the finalizing interpreter, and
the process aborts ("terminate called without an active exception"). Importing the module here,
before any group exists, makes those defaults None.

Called by the plugin (ls_fairseq.fairseq_ext.compat) and by lightseq-train's module, which the
workers fairseq spawns import before they join the group.
"""


def import_collective_defaults_early() -> None:
    import torch.distributed as dist

    if dist.is_available():
        import torch.distributed.nn.functional  # noqa: F401
