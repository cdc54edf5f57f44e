"""Weights that a peer GPU writes directly: the all-gather of sharded ls_adam without a collective.

With the optimizer state sharded over two data-parallel ranks (:meth:`LSAdam.shard_
<ls_fairseq.optim.adam.LSAdam.shard_>`), each rank computes the new weights of its own half of
every bucket, and the other rank needs them before its next forward pass. Instead of an
all-gather after the update, :func:`map_peer_weights` moves every flat weight buffer into PyTorch
symmetric memory, where each GPU can address the other's copy over NVLink. The fused Adam kernel
then stores each new weight twice, in its own copy and in the peer's (``param_lp_peer`` of
:func:`ls_fairseq.ops.adam_`), in the same pass that reads the optimizer state. A one-element
all-reduce after the update orders those stores before either rank reads the weights again.

Only for two ranks on one host, each on its own CUDA device, with NCCL. The mapping is set up
once, collectively; when any rank cannot set it up, no rank uses it and the step all-gathers
instead. ``LS_FAIRSEQ_SHARD_P2P=0`` turns it off.
"""

import logging
import os
import socket
import zlib
from typing import Dict, Optional, Sequence

import torch
import torch.distributed as dist

from ls_fairseq.optim.workspace import FlatWorkspace

logger = logging.getLogger(__name__)


def peer_writes_requested() -> bool:
    return os.environ.get("LS_FAIRSEQ_SHARD_P2P", "1") != "0"


def _why_not(workspaces: Sequence[FlatWorkspace], world_size: int, group) -> Optional[str]:
    if not peer_writes_requested():
        return "LS_FAIRSEQ_SHARD_P2P=0"
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
    reason = _why_not(workspaces, world_size, group)
    buffers = [buf for ws in workspaces for buf in ws.buffers]
    fresh = {}
    if reason is None:
        try:
            import torch.distributed._symmetric_memory as symm_mem

            for buf in buffers:  # filled by move_params_to once every rank has mapped
                fresh[id(buf)] = symm_mem.empty(buf.numel, dtype=buf.param.dtype, device=buf.device)
        except Exception as e:  # noqa: BLE001 - allocation refused: fall back on every rank
            reason, fresh = f"symmetric memory allocation failed ({e})", {}
    # every rank must be able to, and all on one host: (min of "able", min and max of a host checksum)
    host = zlib.crc32(socket.gethostname().encode())
    device = buffers[0].device if reason is None else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    votes = torch.tensor([int(reason is None), host, -host], dtype=torch.int64, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MIN, group=group)
    able, lo, neg_hi = (int(v) for v in votes.tolist())
    if reason is None and not able:
        reason = "another rank cannot"
    elif reason is None and lo != -neg_hi:
        reason = "the ranks run on different hosts"
    if reason is not None:
        logger.info("ls_adam: %s (no peer writes: %s)", fallback, reason)
        return None
    import torch.distributed._symmetric_memory as symm_mem

    peer, peers, handles = 1 - rank, {}, {}
    try:
        for buf in buffers:
            t = fresh[id(buf)]
            handles[id(buf)] = handle = symm_mem.rendezvous(t, group)
            peers[id(buf)] = handle.get_buffer(peer, (buf.numel,), t.dtype, 0)
        mapped = all(v.device == buf.device for buf, v in zip(buffers, peers.values()))
        reason = None if mapped else "the peer's weights are not addressable from this device"
    except Exception as e:  # noqa: BLE001 - e.g. two GPUs without peer access: every rank falls back together
        reason = f"symmetric memory mapping failed ({e})"
    ok = torch.tensor([int(reason is None)], dtype=torch.int32, device=buffers[0].device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if int(ok.item()) == 0:
        logger.info("ls_adam: %s (no peer writes: %s)", fallback, reason or "another rank cannot")
        return None
    for buf in buffers:
        buf.move_params_to(fresh[id(buf)], keep_alive=handles[id(buf)])  # the mapping lives as long
    logger.info("ls_adam: each rank writes its half of the new weights into the other GPU's copy directly "
                "(%d buffers in symmetric memory)", len(buffers))
    return peers
