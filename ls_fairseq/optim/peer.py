"""Weights that a peer GPU writes directly: the all-gather of sharded ls_adam without a collective.

With the optimizer state sharded over two data-parallel ranks (:meth:`LSAdam.shard_
<ls_fairseq.optim.adam.LSAdam.shard_>`), each rank computes the new weights of its own half of
every bucket, and the other rank needs them before its next forward pass. Instead of an
all-gather after the update, :func:`map_peer_weights` moves every flat weight buffer into PyTorch
symmetric memory, where each GPU can address the other's copy over NVLink. The fused Adam kernel
then stores each new weight twice, in its own copy and in the peer's (``param_lp_peer`` of
:func:`ls_fairseq.ops.adam_`), in the same pass that reads the optimizer state. A one-element
all-reduce after the update orders those stores before either rank reads the weights again.

Only for two ranks on one host, each on its own CUDA device, with NCCL, set up once collectively
(else every rank all-gathers, the path of every other world size). The same mapping gives the
sharded reduction's gradient inboxes (:func:`map_peer_inboxes`; else NCCL's reduce-scatter).
"""

import logging
import socket
import zlib
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from ls_fairseq.optim.workspace import FlatWorkspace

logger = logging.getLogger(__name__)


def _why_not(workspaces: Sequence[FlatWorkspace], world_size: int, group) -> Optional[str]:
    if world_size != 2:
        return f"a world size of {world_size} (peer writes serve two ranks)"
    devices = {buf.device for ws in workspaces for buf in ws.buffers}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        return "the weights are not on one CUDA device"
    if dist.get_backend(group) != "nccl":
        return f"the {dist.get_backend(group)} backend (needs nccl)"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except Exception as e:  # noqa: BLE001 - a torch without symmetric memory
        return f"no PyTorch symmetric memory ({e})"
    return None


def map_peer_weights(workspaces: Sequence[FlatWorkspace], rank: int, world_size: int, group=None,
                     fallback: str = "sharded weights are all-gathered") -> Optional[Dict[int, torch.Tensor]]:
    """Collective (every rank of ``group``): move each flat buffer's weights (the low-precision copy,
    or the fp32 weights when there is none) into symmetric memory and return ``{id(buffer): the peer's
    copy of that buffer's weights, addressable from this device}``; None on every rank when any rank
    cannot (logged as "``fallback`` (no peer writes: the reason)")."""
    group = group if group is not None else dist.group.WORLD
    buffers = [buf for ws in workspaces for buf in ws.buffers]
    mapped = _map_symmetric([(buf.numel, buf.param.dtype) for buf in buffers], buffers[0].device, rank, group,
                            _why_not(workspaces, world_size, group))
    if isinstance(mapped, str):
        logger.info("ls_adam: %s (no peer writes: %s)", fallback, mapped)
        return None
    mine, peers, handles = mapped
    for buf, t, handle in zip(buffers, mine, handles):
        buf.move_params_to(t, keep_alive=handle)  # the mapping lives as long
    logger.info("ls_adam: each rank writes its half of the new weights into the other GPU's copy directly "
                "(%d buffers in symmetric memory)", len(buffers))
    return {id(buf): t for buf, t in zip(buffers, peers)}


def map_peer_inboxes(workspaces: Sequence[FlatWorkspace], rank: int, world_size: int, group=None):
    """Collective: one gradient-sized "inbox" per flat buffer in symmetric memory, into which the
    other rank copies its gradients of this rank's parts
    (:class:`~ls_fairseq.optim.reduction_strategies.PeerCopyReduce`). Returns ``{id(buffer): (this
    rank's inbox, the peer's inbox addressable from this device, the mapping's handle)}``, or the
    reason why not (a string, the same on every rank)."""
    group = group if group is not None else dist.group.WORLD
    buffers = [buf for ws in workspaces for buf in ws.buffers]
    mapped = _map_symmetric([(buf.numel, buf.grad.dtype) for buf in buffers], buffers[0].device, rank, group,
                            _why_not(workspaces, world_size, group))
    if isinstance(mapped, str):
        return mapped
    for t in mapped[0]:
        t.zero_()
    return {id(buf): box for buf, box in zip(buffers, zip(*mapped))}


def _map_symmetric(specs, device: torch.device, rank: int, group, reason: Optional[str]):
    """Collective: one tensor per ``(numel, dtype)`` of ``specs`` in symmetric memory on ``device`` and the
    peer's of each, addressable from here: ``(mine, peers, handles)``, or the reason why not (a string,
    the same on every rank: when any rank cannot, none does)."""
    fresh = []
    if reason is None:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            fresh = [symm_mem.empty(n, dtype=dtype, device=device) for n, dtype in specs]
        except Exception as e:  # noqa: BLE001 - allocation refused: fall back on every rank
            reason, fresh = f"symmetric memory allocation failed ({e})", []
    # every rank must be able to, and all on one host: (min of "able", min and max of a host checksum)
    host = zlib.crc32(socket.gethostname().encode())
    vote_device = device if reason is None else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and vote_device.type != "cuda":
        vote_device = torch.device("cuda", torch.cuda.current_device())
    votes = torch.tensor([int(reason is None), host, -host], dtype=torch.int64, device=vote_device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    able, lo, neg_hi = (int(v) for v in votes.tolist())
    if reason is None and not able:
        reason = "another rank cannot"
    elif reason is None and lo != -neg_hi:
        reason = "the ranks run on different hosts"
    if reason is not None:
        return reason
    import torch.distributed._symmetric_memory as symm_mem

    peer, peers, handles = 1 - rank, [], []
    try:
        for t in fresh:
            handle = symm_mem.rendezvous(t, group)
            handles.append(handle)
            peers.append(handle.get_buffer(peer, (t.numel(),), t.dtype, 0))
        ok = all(v.device == t.device for t, v in zip(fresh, peers))
        reason = None if ok else "the peer's memory is not addressable from this device"
    except Exception as e:  # noqa: BLE001 - e.g. two GPUs without peer access: every rank falls back together
        reason = f"symmetric memory mapping failed ({e})"
    ok = torch.tensor([int(reason is None)], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if int(ok.item()) == 0:
        return reason or "another rank cannot"
    return fresh, peers, handles
