"""Wait for the sharded step's all-gathers layer by layer in the next forward pass.

With its state sharded (:meth:`~ls_fairseq.optim.adam.LSAdam.shard_`), ls_adam updates its part
of every bucket and all-gathers the new weights. Waiting for all of them at the end of the step
leaves the GPU with nothing to compute while the last gathers cross the link.
:class:`GatherWaits` lets the next forward start right away instead: each layer's forward pre-hook
waits (on the stream, not the host) for that layer's buckets only. Only for models that declare
``ls_gather_waits = True``; groups, order and the contract: docs/optimizer.md, section
"Layer-by-layer gather waits".
"""

import logging
from typing import Dict, List, Tuple

import torch.nn as nn

logger = logging.getLogger(__name__)


def layer_groups(model: nn.Module) -> Tuple[List[nn.Parameter], List[Tuple[nn.Module, List[nn.Parameter]]]]:
    """(root-group parameters, [(layer, its parameters)]) of ``model``: layers are the elements of the
    outermost ModuleLists, in registration order. A parameter that a module outside the layers also
    holds, or that several layers share, goes to the root group."""
    layers: List[nn.Module] = []
    outside = set()

    def visit(module: nn.Module):
        outside.update(id(p) for p in module.parameters(recurse=False))
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                layers.extend(child)
            else:
                visit(child)

    visit(model)
    owner: Dict[int, int] = {}
    for g, layer in enumerate(layers):
        for p in layer.parameters():
            owner[id(p)] = g if owner.get(id(p), g) == g and id(p) not in outside else -1
    root, groups = [], [(layer, []) for layer in layers]
    for p in model.parameters():
        g = owner.get(id(p), -1)
        (root if g < 0 else groups[g][1]).append(p)
    return root, groups


class GatherWaits:
    """Install the waits described in the module docstring on ``model`` for ``optimizer`` (an
    :class:`~ls_fairseq.optim.adam.LSAdam` with sharded state); :meth:`remove` takes them off and
    makes the optimizer wait at the end of each step again."""

    def __init__(self, optimizer, model: nn.Module):
        root, groups = layer_groups(model)
        need, keys = {}, []
        for rank, params in enumerate([root] + [ps for _, ps in groups]):
            mine = []
            for p in params:
                key = optimizer.bucket_key(p)
                if key is None:
                    continue
                if key not in need:
                    need[key] = rank
                    mine.append(key)
            keys.append(mine)  # each bucket is waited for where it is needed first
        self.optimizer = optimizer
        optimizer.defer_gathers(need)
        self._handles = [model.register_forward_pre_hook(self._waiter(keys[0]))]
        for (layer, _), layer_keys in zip(groups, keys[1:]):
            if layer_keys:
                self._handles.append(layer.register_forward_pre_hook(self._waiter(layer_keys)))
        logger.info("ls_adam: the forward waits for the weights' all-gathers layer by layer (%d layers, %d buckets)",
                    len(groups), len(need))

    def _waiter(self, keys):
        opt = self.optimizer

        def hook(module, args):
            opt.wait_gathers(keys)  # returns at once when nothing is in flight

        return hook

    def remove(self):
        self.optimizer.wait_gathers()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.optimizer.sharded:
            self.optimizer._shard.defer = False
