"""Work-arounds for fairseq-fixed 0.12.3.1 on current torch, applied once at import.

torch >= 2.6 defaults torch.load to weights_only=True, which cannot unpickle the
argparse.Namespace / omegaconf objects inside fairseq checkpoints. Two fairseq modules
call torch.load without the argument: checkpoint_utils (reading a checkpoint file) and
distributed.utils (every rank but the first unpickles the checkpoint state that rank 0
broadcasts when training resumes on several GPUs). Their loads get weights_only=False
(checkpoints are the user's own files, as with any fairseq run); nothing else changes.

torch.distributed.nn.functional gives its collectives ``group=group.WORLD`` as a default
argument, evaluated when the module is first imported. torch.optim imports it (through
torch._dynamo) when the first optimizer is built, which in fairseq's training happens after the
process group exists: the defaults would then hold the default group for the rest of the
process, ``destroy_process_group()`` could not free it, and its threads (gloo's workers, NCCL's
watchdog) would still run when the interpreter shuts down. A gloo worker that releases a finished
collective's tensors at that moment needs the GIL, is ended by the finalizing interpreter, and
the process aborts ("terminate called without an active exception"). Importing the module here,
before any group exists, makes those defaults None.
"""

import functools

import torch

_PATCHED = False


def _load_allowing_objects(*args, **kwargs):
    kwargs.setdefault("weights_only", False)
    return torch.load(*args, **kwargs)


class _TorchProxy:
    """torch as seen from a patched fairseq module: only ``load`` differs."""

    load = staticmethod(functools.wraps(torch.load)(_load_allowing_objects))

    def __getattr__(self, name):
        return getattr(torch, name)


def patch_checkpoint_loading():
    global _PATCHED
    if _PATCHED:
        return
    from fairseq import checkpoint_utils
    from fairseq.distributed import utils as distributed_utils

    for module in (checkpoint_utils, distributed_utils):
        module.torch = _TorchProxy()
    _PATCHED = True


def import_collective_defaults_early():
    """Import torch.distributed.nn.functional while no process group exists (module docstring)."""
    import torch.distributed as dist

    if dist.is_available():
        import torch.distributed.nn.functional  # noqa: F401


patch_checkpoint_loading()
import_collective_defaults_early()
