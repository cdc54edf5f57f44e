"""Run lightseq-train as where the two GPUs cannot map each other's memory, so that the automatic fallback of
sharded ls_adam runs on two GPUs that could (tests/gpu/test_multi_gpu.py):

    python tests/_peer_fallback.py weights <lightseq-train args>   # no peer writes: the weights are all-gathered
    python tests/_peer_fallback.py inboxes <lightseq-train args>   # no peer copies: NCCL's reduce-scatter

Each stand-in answers on every rank as the real mapping does when it cannot map (a reason, the same on every
rank), so the rest of the choice (ls_fairseq.optim.reduction) runs as it would on such a machine."""

import os
import sys

REASON = "symmetric memory mapping refused by tests/_peer_fallback.py"


def main():
    which, argv = sys.argv[1], sys.argv[2:]
    if which not in ("weights", "inboxes"):
        raise SystemExit(f"tests/_peer_fallback.py: the first argument must be weights or inboxes, not {which!r}")
    # run as a script, this file's folder is first on sys.path: put the checkout there too
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import torch.distributed as dist

    from ls_fairseq.cli import train
    from ls_fairseq.optim import peer, reduction

    if which == "weights":  # both mappings ask this first: neither maps
        peer._why_not = lambda workspaces, world_size, group: REASON
    else:  # the weights map; the inboxes' collective vote is told this rank cannot

        def map_peer_inboxes(workspaces, rank, world_size, group=None):
            buffers = [buf for ws in workspaces for buf in ws.buffers]
            return peer._map_symmetric([(buf.numel, buf.grad.dtype) for buf in buffers], buffers[0].device, rank,
                                       group if group is not None else dist.group.WORLD, REASON)

        reduction.map_peer_inboxes = map_peer_inboxes
    train.cli_main(argv)


if __name__ == "__main__":
    main()
