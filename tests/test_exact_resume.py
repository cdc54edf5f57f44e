"""Exact resume: N updates straight and the same run stopped and resumed give the same losses and weights,
also when the resume lands in a later epoch (where fairseq alone re-makes the batches with another random
tie-breaking and trains on other batches), mid-epoch and at an epoch boundary, with dropout and with
--update-freq 2."""

import os

import pytest
import torch

from _models import inner_by_update, lightseq_train

# data_bin (tests/conftest.py): 240 pairs, which make 9 batches an epoch at --max-tokens 300


def _train(data, save_dir, max_update, dropout, update_freq, *extra):
    """lightseq-train in this process (a resume is lightseq-train started again on the same --save-dir; a
    process of its own adds nothing that is checked here); {update: its train_inner record}."""
    records = lightseq_train([*extra,
        data, "--arch", "ls_transformer_tiny", "--optimizer", "ls_adam", "--lr", "1e-3", "--criterion",
        "ls_label_smoothed_cross_entropy", "--max-tokens", "300", "--cpu", "--num-workers", "0", "--seed", "3",
        "--log-format", "json", "--log-interval", "1", "--no-epoch-checkpoints", "--disable-validation",
        "--dropout", str(dropout), "--update-freq", str(update_freq), "--max-update", str(max_update),
        "--save-dir", str(save_dir)])
    return inner_by_update(records)


def _weights(save_dir):
    state = torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=False)
    return state["model"]


def _epochs(run):
    return {u: int(r["epoch"]) for u, r in run.items()}


def _assert_same_run(straight, straight_dir, parts, resumed_dir):
    resumed = {}
    for p in parts:
        resumed.update(p)
    assert sorted(resumed) == sorted(straight)
    diffs = [(u, straight[u]["loss"], resumed[u]["loss"]) for u in sorted(straight)
             if straight[u]["loss"] != resumed[u]["loss"]]
    assert not diffs, f"losses differ from update {diffs[0][0]} on: {diffs[:5]}"
    a, b = _weights(straight_dir), _weights(resumed_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_resume_with_dropout_mid_epoch_and_at_an_epoch_boundary(data_bin, tmp_path):
    # 9 batches an epoch: 11 is in epoch 2, 9 is the end of epoch 1
    straight = _train(data_bin, tmp_path / "straight", 14, 0.1, 1)
    epochs = _epochs(straight)
    assert (epochs[9], epochs[10], epochs[11]) == (1, 2, 2), epochs
    for stop in (11, 9):
        d = tmp_path / f"resumed_{stop}"
        first = _train(data_bin, d, stop, 0.1, 1)
        second = _train(data_bin, d, 14, 0.1, 1)
        assert min(second) == stop + 1
        _assert_same_run(straight, tmp_path / "straight", [first, second], d)


@pytest.mark.slow
def test_resume_with_update_freq_2(data_bin, tmp_path):
    # 9 batches an epoch make 5 updates (the last of one batch): 6 is in epoch 2
    straight = _train(data_bin, tmp_path / "straight", 8, 0.0, 2)
    epochs = _epochs(straight)
    assert (epochs[5], epochs[6]) == (1, 2), epochs
    d = tmp_path / "resumed"
    first = _train(data_bin, d, 6, 0.0, 2)
    second = _train(data_bin, d, 8, 0.0, 2)
    assert min(second) == 7
    _assert_same_run(straight, tmp_path / "straight", [first, second], d)


@pytest.mark.slow
def test_resume_in_bf16_keeps_the_split_master(data_bin, tmp_path):
    """bf16: ls_adam's master is split between the weights and an int16 buffer; the checkpoint holds it joined in
    fp32, and the resumed run splits it again: the same losses and weights as the straight run."""
    straight = _train(data_bin, tmp_path / "straight", 6, 0.1, 1, "--bf16")
    d = tmp_path / "resumed"
    first = _train(data_bin, d, 4, 0.1, 1, "--bf16")
    second = _train(data_bin, d, 6, 0.1, 1, "--bf16")
    assert min(second) == 5
    _assert_same_run(straight, tmp_path / "straight", [first, second], d)
    opt = torch.load(os.path.join(d, "checkpoint_last.pt"), map_location="cpu", weights_only=False)
    masters = [e["master"] for e in opt["last_optimizer_state"]["state"].values() if "master" in e]
    assert masters and all(m.dtype == torch.float32 for m in masters)
