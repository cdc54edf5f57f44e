"""Exact resume: N updates straight and the same run stopped and resumed give the same losses and weights,
also when the resume lands in a later epoch (where fairseq alone re-makes the batches with another random
tie-breaking and trains on other batches), mid-epoch and at an epoch boundary, with dropout and with
--update-freq 2."""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_data")
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_toy_corpus.py"), "--out", str(root / "raw"),
                    "--train", "600", "--valid", "50", "--test", "50"], check=True, capture_output=True)
    subprocess.run(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--trainpref",
                    str(root / "raw/train"), "--validpref", str(root / "raw/valid"), "--destdir", str(root / "bin"),
                    "--joined-dictionary", "--workers", "1"], check=True, capture_output=True)
    return str(root / "bin")


def _train(data, save_dir, max_update, dropout, update_freq):
    cmd = [sys.executable, "-m", "ls_fairseq.cli.train", data, "--arch", "ls_transformer_tiny", "--optimizer",
           "ls_adam", "--lr", "1e-3", "--criterion", "ls_label_smoothed_cross_entropy", "--max-tokens", "600",
           "--cpu", "--num-workers", "0", "--seed", "3", "--log-format", "json", "--log-interval", "1",
           "--no-epoch-checkpoints", "--disable-validation", "--dropout", str(dropout), "--update-freq",
           str(update_freq), "--max-update", str(max_update), "--save-dir", str(save_dir)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    losses = {}
    for line in out.splitlines():
        if "| train_inner | " in line:
            rec = json.loads(line.split("| train_inner | ", 1)[1])
            losses[int(rec["num_updates"])] = rec["loss"]
    return losses


def _weights(save_dir):
    state = torch.load(os.path.join(save_dir, "checkpoint_last.pt"), map_location="cpu", weights_only=False)
    return state["model"]


def _assert_same_run(straight, straight_dir, parts, resumed_dir):
    resumed = {}
    for p in parts:
        resumed.update(p)
    assert sorted(resumed) == sorted(straight)
    diffs = [(u, straight[u], resumed[u]) for u in sorted(straight) if straight[u] != resumed[u]]
    assert not diffs, f"losses differ from update {diffs[0][0]} on: {diffs[:5]}"
    a, b = _weights(straight_dir), _weights(resumed_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_resume_with_dropout_mid_epoch_and_at_an_epoch_boundary(data, tmp_path):
    # 600 pairs at 600 tokens make 11 batches an epoch: 20 is in epoch 2, 11 is the end of epoch 1
    straight = _train(data, tmp_path / "straight", 24, 0.1, 1)
    for stop in (20, 11):
        d = tmp_path / f"resumed_{stop}"
        first = _train(data, d, stop, 0.1, 1)
        second = _train(data, d, 24, 0.1, 1)
        assert min(second) == stop + 1
        _assert_same_run(straight, tmp_path / "straight", [first, second], d)


@pytest.mark.slow
def test_resume_with_update_freq_2(data, tmp_path):
    straight = _train(data, tmp_path / "straight", 10, 0.0, 2)
    d = tmp_path / "resumed"
    first = _train(data, d, 7, 0.0, 2)
    second = _train(data, d, 10, 0.0, 2)
    _assert_same_run(straight, tmp_path / "straight", [first, second], d)
