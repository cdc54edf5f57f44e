"""The torch>=2.6 checkpoint-loading fix reaches every fairseq path that unpickles checkpoints."""

import argparse
import io
import os

import pytest
import torch
import torch.distributed as dist

from _models import spawn_two_ranks


def _worker(rank, port, result_dir):
    import ls_fairseq.fairseq_ext  # noqa: F401  (what --user-dir does in each fairseq worker)
    from fairseq.distributed import utils as distributed_utils

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        state = {"args": argparse.Namespace(arch="ls_transformer_tiny", lr=[5e-4]), "model": {"w": torch.ones(3)}}
        got = distributed_utils._broadcast_object_slow(state if rank == 0 else None, 0, dist.group.WORLD,
                                                       torch.device("cpu"))
        with open(os.path.join(result_dir, f"rank{rank}"), "w") as f:
            f.write(f"{got['args'].arch} {got['model']['w'].sum().item()}")
    finally:
        dist.destroy_process_group()


def test_checkpoint_state_broadcast_unpickles_on_other_ranks(tmp_path):
    # fairseq resumes multi-GPU training by loading on rank 0 and broadcasting the pickled
    # state; without the fix the other ranks fail with "Weights only load failed".
    spawn_two_ranks(_worker, tmp_path)
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == "ls_transformer_tiny 3.0"


def test_checkpoint_utils_loads_namespace(tmp_path):
    import ls_fairseq.fairseq_ext  # noqa: F401
    from fairseq import checkpoint_utils

    path = tmp_path / "ck.pt"
    torch.save({"args": argparse.Namespace(arch="x"), "model": {}}, path)
    with pytest.raises(Exception):
        torch.load(path)  # torch's own default refuses it
    assert checkpoint_utils.torch.load(path)["args"].arch == "x"
