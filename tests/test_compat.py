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


_GROUP_FREED = r"""
import gc, sys, weakref
import ls_fairseq.fairseq_ext  # the plugin, imported before any process group exists (as fairseq does)
import torch.distributed as dist
from ls_fairseq.fairseq_ext.optimizer import LSAdamConfig, LSFairseqAdam
import torch

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
group = weakref.ref(dist.group.WORLD)
net = torch.nn.Linear(4, 4)
LSFairseqAdam(LSAdamConfig(lr=[0.01], adam_betas="(0.9, 0.98)"), list(net.parameters()))  # imports torch._dynamo
assert "torch._dynamo" in sys.modules
dist.destroy_process_group()
gc.collect()
print("freed" if group() is None else "alive")
"""


def test_destroyed_process_group_is_freed_after_the_first_optimizer(tmp_path):
    """torch.distributed.nn.functional, imported by torch.optim's first optimizer, captures the default
    group in its collectives' default arguments unless it was imported before the group existed;
    the plugin imports it early, so destroy_process_group() frees the group and its threads stop
    before the interpreter shuts down (where a gloo thread could otherwise abort the process)."""
    import subprocess
    import sys

    from _models import free_port

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _GROUP_FREED, str(free_port())], env=env, cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "freed"
