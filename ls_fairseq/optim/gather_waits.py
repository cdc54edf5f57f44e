"""Wait for the sharded step's all-gathers layer by layer in the next forward pass.

With its state sharded (:meth:`~ls_fairseq.optim.adam.LSAdam.shard_`), ls_adam updates its part
of every bucket and all-gathers the new weights. Waiting for all of them at the end of the step
leaves the GPU with nothing to compute while the last gathers cross the link.
:class:`GatherWaits` lets the next forward start right away instead:

* Groups. Every element of the model's outermost ``nn.ModuleList`` s (the encoder and decoder
  layers of a transformer), in registration order, is a group; every other parameter belongs to
  the root group (embeddings, final layer norms, a batched cross-attention projection).
* Order. The step updates and gathers the buckets in the order the forward needs them: buckets
  holding root-group parameters first, then by the first layer that uses them
  (:meth:`~ls_fairseq.optim.adam.LSAdam.defer_gathers`).
* Waits. A forward pre-hook on the model waits for the root group's buckets; a forward pre-hook
  on each layer waits for that layer's buckets (``work.wait()``: the compute stream waits, the
  host does not). A layer's weights are thus complete before any of its kernels is queued, and
  the layers after it still receive theirs while it computes.

This is correct only for models whose layers use their own parameters only while they are
called, and use nobody else's: models declare it with a class attribute
``ls_gather_waits = True`` (ls_transformer does). Anything else that reads the weights between
two steps must call :meth:`~ls_fairseq.optim.adam.LSAdam.wait_gathers` first; LSTrainer does so
for validation, checkpoints and every access to the model from outside its train step.
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
