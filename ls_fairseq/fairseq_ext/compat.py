"""Work-arounds for fairseq-fixed 0.12.3.1 on current torch, applied once at import.

torch >= 2.6 defaults torch.load to weights_only=True, which cannot unpickle the
argparse.Namespace / omegaconf objects inside fairseq checkpoints. Two fairseq modules
call torch.load without the argument: checkpoint_utils (reading a checkpoint file) and
distributed.utils (every rank but the first unpickles the checkpoint state that rank 0
broadcasts when training resumes on several GPUs). Their loads get weights_only=False
(checkpoints are the user's own files, as with any fairseq run); nothing else changes.

The plugin also imports torch.distributed.nn.functional before any process group exists
(ls_fairseq/_collective_defaults.py says why).
"""

import functools

import torch

from ls_fairseq._collective_defaults import import_collective_defaults_early

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


patch_checkpoint_loading()
import_collective_defaults_early()
