"""lightseq-train on GPUs: on two through NCCL (skipped with fewer) the update takes the same steps
as one GPU with --update-freq 2, with the CUDA-graph step and with the eager step; on one and on two,
train_step reads no tensor value on the host (each read stalls the GPU; with two ranks fairseq's meters
once did so 8 times per update)."""

import json
import os
import re
import sys

import pytest
import torch

from tests._models import assert_same_checkpoint_state, lightseq_train_two_ranks, run_checked, train_inner_records
from tests.test_end_to_end import ROOT, TRAIN_FLAGS, _params

pytestmark = pytest.mark.gpu

GPU_FLAGS = [f for f in TRAIN_FLAGS if f != "--cpu"]


def _need_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")


def _one_gpu(data, save_dir, flags, runner=None):
    """lightseq-train as one process on GPU 0: (its train_inner records by update, its log)."""
    prefix = runner or [sys.executable, "-m", "ls_fairseq.cli.train"]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    out = run_checked([*prefix, data, "--save-dir", str(save_dir), *flags], ROOT, env, timeout=300)
    return train_inner_records(out), out


def _graphed_micro_batches(log: str) -> int:
    """The micro-batches a run's log says the CUDA-graph step replayed (its last summary line)."""
    counts = re.findall(r"CUDA-graph step: (\d+) micro-batches from \d+ captured buckets", log)
    return int(counts[-1]) if counts else 0


def _ten_updates_per_setting(data_bin, tmp_path, precision, settings):
    """lightseq-train on two GPUs (NCCL), ten updates from the same batches (dropout 0, grouped shuffling),
    once per ``(name, flags, fallback)`` of ``settings``, each in ``tmp_path / name``: {name: train_inner
    records by update}. ``fallback`` "weights" / "inboxes": as where the GPUs cannot map each other's
    weights / gradient inboxes (tests/_peer_fallback.py); None: as they are. The eager step: the
    reductions overlapped with the backward and the sharded state work through hooks in the backward,
    which the CUDA-graph step does not use."""
    script = os.path.join(ROOT, "tests", "_peer_fallback.py")
    flags = [*GPU_FLAGS, *precision, "--dropout", "0", "--max-update", "10", "--log-interval", "1",
             "--grouped-shuffling", "--disable-validation", "--ls-graph-step", "off"]
    runs = {}
    for name, extra, fallback in settings:
        (tmp_path / name).mkdir()
        runner = None
        if fallback is not None:
            runner = lambda r, f=fallback: [sys.executable, script, f]  # noqa: E731
        runs[name] = lightseq_train_two_ranks(data_bin, tmp_path / name, tmp_path / name, [*flags, *extra],
                                              backend="nccl", runner=runner)
    return runs


def _assert_same_updates(a, b, keys):
    """Two runs' train_inner records agree exactly in ``keys`` at every update (at least 8 logged)."""
    assert sorted(a) == sorted(b) and len(a) >= 8
    for u in a:
        for k in keys:
            assert a[u].get(k) == b[u].get(k), (u, k, a[u], b[u])


@pytest.mark.parametrize("step", ["on", "off"], ids=["graph_step", "eager_step"])
@pytest.mark.parametrize("precision", [[], ["--fp16"]], ids=["fp32", "fp16"])
def test_two_gpus_take_the_updates_of_one_gpu_with_update_freq_2(data_bin, tmp_path, precision, step):
    """With the CUDA-graph step each GPU replays its graphs and ls_adam all-reduces the flat gradients
    between graph launches, after the backward (the CPU check of the same arithmetic with two gloo ranks:
    tests/test_graph_step_multi.py); with the eager step the all-reduce overlaps the backward."""
    from ls_fairseq.fairseq_ext.compat import patch_checkpoint_loading

    _need_two_gpus()
    patch_checkpoint_loading()  # fairseq's checkpoint reader under torch >= 2.6, as lightseq-train does
    flags = [*GPU_FLAGS, *precision, "--dropout", "0", "--max-update", "10", "--log-interval", "1",
             "--grouped-shuffling", "--ls-graph-step", step]
    two_dir, one_dir = tmp_path / "two", tmp_path / "one"
    two_dir.mkdir()
    two = lightseq_train_two_ranks(data_bin, two_dir, two_dir, flags, backend="nccl")
    one, one_log = _one_gpu(data_bin, one_dir, [*flags, "--update-freq", "2"])
    two_log = (two_dir / "rank0.log").read_text()
    if step == "on":  # the first update is eager (graph_step.WARMUP_UPDATES)
        assert _graphed_micro_batches(two_log) >= 8 and _graphed_micro_batches(one_log) >= 16, two_log[-3000:]
        assert "gradients all-reduced after the backward pass, whole buffers" in two_log
        assert "optimizer state sharded" not in two_log and "overlapped with the backward" not in two_log
    else:
        assert _graphed_micro_batches(two_log) == _graphed_micro_batches(one_log) == 0
        assert "overlapped with the backward" in two_log
    assert sorted(one) == sorted(two) == list(range(1, 11))
    for u in one:
        for k in ("wpb", "bsz"):
            assert one[u][k] == two[u][k], (u, k)
        for k in ("loss", "nll_loss", "gnorm"):
            assert float(one[u][k]) == pytest.approx(float(two[u][k]), rel=3e-3, abs=3e-3), (u, k, one[u], two[u])
    p1 = _params(os.path.join(one_dir, "checkpoint_last.pt"))
    p2 = _params(os.path.join(two_dir, "checkpoint_last.pt"))
    for k in p1:
        if k.endswith("k_proj.bias"):
            continue  # no effect on the softmax: its gradient is rounding noise that Adam scales up
        torch.testing.assert_close(p2[k].float(), p1[k].float(), rtol=2e-3, atol=2e-3, msg=k)


@pytest.mark.parametrize("precision", [["--fp16"], ["--bf16"]], ids=["fp16", "bf16"])
@pytest.mark.parametrize("peer", ["peer_writes", "all_gathers", "default"])
def test_sharded_adam_on_two_gpus_equals_the_whole_state(data_bin, tmp_path, precision, peer):
    """NCCL's in-place reduce-scatter, then the new weights reach the other GPU either through the
    update kernel's own stores into it (symmetric memory, the default on two GPUs) or through
    all-gathers (the fallback where the GPUs cannot map each other's memory, and the path of other GPU
    counts): the sharded run (``--ls-shard-state on``, or the default ``auto``, which on two GPUs of
    one host shards with peer writes) takes the updates of the run with the whole optimizer state on
    every rank (``off``) bit for bit (no clipping: the norm, summed in another order, only decides
    overflows), and its checkpoint holds the same whole state."""
    _need_two_gpus()
    sharded = [] if peer == "default" else ["--ls-shard-state", "on"]
    fallback = "weights" if peer == "all_gathers" else None
    runs = _ten_updates_per_setting(data_bin, tmp_path, precision, (("sharded", sharded, fallback),
                                                                    ("whole", ["--ls-shard-state", "off"], None)))
    log = (tmp_path / "sharded" / "rank0.log").read_text()
    assert "optimizer state sharded over 2 ranks" in log
    if peer != "all_gathers":
        assert "writing the new weights on both GPUs" in log and "all-gathers layer by layer" not in log
    else:
        assert "sharded weights are all-gathered (no peer writes: symmetric memory mapping refused" in log
        assert "then an all-gather of the weights" in log and "all-gathers layer by layer" in log
    assert "optimizer state sharded" not in (tmp_path / "whole" / "rank0.log").read_text()
    a, b = runs["sharded"], runs["whole"]
    _assert_same_updates(a, b, ("loss", "nll_loss", "wpb", "loss_scale"))
    for u in a:
        assert float(a[u]["gnorm"]) == pytest.approx(float(b[u]["gnorm"]), rel=1e-3)
    assert_same_checkpoint_state(*(tmp_path / n / "checkpoint_last.pt" for n in ("sharded", "whole")))


@pytest.mark.parametrize("precision", [["--fp16"], ["--bf16"]], ids=["fp16", "bf16"])
@pytest.mark.parametrize("gpus", [1, 2])
def test_train_step_reads_no_tensor_value_on_the_host(data_bin, tmp_path, gpus, precision):
    script = os.path.join(ROOT, "tests", "_host_reads.py")
    flags = [*GPU_FLAGS, *precision, "--max-update", "12", "--clip-norm", "0.1", "--log-interval", "2",
             "--disable-validation", "--no-save"]
    runner = lambda r: [sys.executable, script, str(tmp_path / f"reads{r}.json")]  # noqa: E731
    if gpus == 1:
        _one_gpu(data_bin, tmp_path, flags, runner=runner(0))
    else:
        _need_two_gpus()
        lightseq_train_two_ranks(data_bin, tmp_path, tmp_path, flags, backend="nccl", runner=runner)
    for r in range(gpus):
        counted = json.loads((tmp_path / f"reads{r}.json").read_text())
        assert counted["steps"] >= 10, (r, counted)
        assert counted["reads"] == {}, (r, counted)


@pytest.mark.parametrize("precision", [["--fp16"], ["--bf16"]], ids=["fp16", "bf16"])
def test_peer_copies_take_the_updates_of_nccl_reduce_scatter(data_bin, tmp_path, precision):
    """On two GPUs of one host the sharded reduction copies each complete bucket's other part into the
    other GPU's inbox by a copy engine (the default); where the inboxes cannot be mapped it
    reduce-scatters with NCCL instead (the path of other GPU counts). One addition of two numbers per
    element either way: the same updates bit for bit (rounds alternate between the two halves of the
    inbox: ten updates use both) and the same checkpoint."""
    _need_two_gpus()
    runs = _ten_updates_per_setting(data_bin, tmp_path, precision,
                                    (("peer", [], None), ("nccl", [], "inboxes")))
    assert "copied to the other GPU by a copy engine" in (tmp_path / "peer" / "rank0.log").read_text()
    nccl_log = (tmp_path / "nccl" / "rank0.log").read_text()
    assert "no peer copies: symmetric memory mapping refused" in nccl_log
    assert "writing the new weights on both GPUs" in nccl_log  # only the gradient parts took the fallback
    _assert_same_updates(runs["peer"], runs["nccl"], ("loss", "nll_loss", "gnorm", "wpb", "loss_scale"))
    assert_same_checkpoint_state(*(tmp_path / n / "checkpoint_last.pt" for n in ("peer", "nccl")))
