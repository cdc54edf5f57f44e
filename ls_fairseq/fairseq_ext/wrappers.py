"""Seeing through the wrappers around a model: fairseq's DDP wrappers (ModuleProxyWrapper,
DistributedDataParallel, LegacyDistributedDataParallel) and DeepSpeed's engine each keep the
model they wrap as their child module named ``module``."""

from typing import Iterator

import torch.nn as nn


def wrapper_chain(module: nn.Module, steps: int) -> Iterator[nn.Module]:
    """``module``, then the module it wraps, and so on: at most ``steps`` levels down."""
    yield module
    for _ in range(steps):
        module = module.__dict__.get("_modules", {}).get("module")
        if module is None:
            return
        yield module
