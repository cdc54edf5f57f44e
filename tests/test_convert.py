"""lightseq-convert: native transformer <-> ls_transformer checkpoints, checked by generating."""

import os
import random
import re
from argparse import Namespace

import pytest
import torch

from ls_fairseq.cli import convert
from tests._models import binarize, run_checked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the a house cat dog sees eats bread red car city old new book reads water child plays".split()


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_data")
    rng = random.Random(11)
    for split, n in (("train", 200), ("valid", 20), ("test", 12)):
        src = [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(n)]
        (root / f"{split}.en").write_text("".join(s + "\n" for s in src))
        (root / f"{split}.de").write_text("".join(" ".join(reversed(s.split())) + "\n" for s in src))
    return binarize(root)


def _env():
    # plain fairseq on torch >= 2.6 needs weights_only=False to read its own checkpoints
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")


def _run(cmd, cwd, env=None):
    return run_checked(cmd, cwd, env or _env(), timeout=300)


def _train(cmd, arch, criterion, optimizer, data, save, cwd):
    _run([cmd, data, "--arch", arch, "--share-all-embeddings", "--optimizer", optimizer, "--lr", "5e-3",
          "--criterion", criterion, "--label-smoothing", "0.1", "--max-tokens", "1024", "--max-update", "6",
          "--save-dir", save, "--no-progress-bar", "--no-epoch-checkpoints", "--num-workers", "0", "--seed", "5"],
         cwd)
    return os.path.join(save, "checkpoint_last.pt")


def _hypotheses(cmd, data, path, cwd, env=None):
    out = _run([cmd, data, "--path", path, "--beam", "3", "--max-tokens", "2000",
                "--required-batch-size-multiple", "1"], cwd, env)
    hyps = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", out, flags=re.M))
    assert len(hyps) == 12, out[-3000:]
    return hyps


def test_convert_state_rewrites_names():
    state = {
        "model": {"w": torch.zeros(1)},
        "args": None,
        "cfg": {"model": Namespace(arch="ls_transformer_wmt_en_de_big_t2t", _name="ls_transformer_wmt_en_de_big_t2t",
                                   criterion="ls_label_smoothed_cross_entropy", optimizer="ls_adam", user_dir="/x"),
                "criterion": {"_name": "ls_label_smoothed_cross_entropy"}, "optimizer": {"_name": "ls_adam"},
                "common": {"user_dir": "/x"}},
        "optimizer_history": [{"criterion_name": "LSLabelSmoothedCrossEntropyCriterion", "optimizer_name": "X"}],
        "last_optimizer_state": {"state": 1},
    }
    convert.convert_state(state, "native")
    m = state["cfg"]["model"]
    assert (m.arch, m._name, m.criterion, m.optimizer, m.user_dir) == (
        "transformer_wmt_en_de_big_t2t", "transformer_wmt_en_de_big_t2t", "label_smoothed_cross_entropy", "adam", None)
    assert state["cfg"]["criterion"]["_name"] == "label_smoothed_cross_entropy"
    assert state["cfg"]["optimizer"]["_name"] == "adam" and state["cfg"]["common"]["user_dir"] is None
    assert state["optimizer_history"][0]["criterion_name"] == "LabelSmoothedCrossEntropyCriterion"
    assert state["last_optimizer_state"] is None
    convert.convert_state(state, "ls")
    assert state["cfg"]["model"].arch == "ls_transformer_wmt_en_de_big_t2t"
    assert state["cfg"]["optimizer"]["_name"] == "ls_adam"
    with pytest.raises(ValueError, match="not a native transformer"):
        convert.convert_state(state, "ls")
    with pytest.raises(ValueError, match="no 'model'"):
        convert.convert_state({"cfg": {}}, "ls")
    with pytest.raises(ValueError, match="no model architecture"):
        convert.convert_state({"model": {}, "cfg": {"model": None}}, "ls")


def test_cli_errors(tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert.cli_main([str(tmp_path / "missing.pt"), str(tmp_path / "o.pt"), "--to", "ls"])
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert.cli_main([str(tmp_path / "a.pt"), str(tmp_path / "a.pt"), "--to", "ls"])


@pytest.mark.slow
def test_native_to_ls_and_back(data_bin, tmp_path):
    native = _train("fairseq-train", "transformer_tiny", "label_smoothed_cross_entropy", "adam", data_bin,
                    str(tmp_path / "native"), tmp_path)
    ref = _hypotheses("fairseq-generate", data_bin, native, tmp_path)

    ls = str(tmp_path / "as_ls.pt")
    _run(["lightseq-convert", native, ls, "--to", "ls"], tmp_path)
    state = torch.load(ls, weights_only=False)
    assert state["cfg"]["model"].arch == "ls_transformer_tiny"
    assert _hypotheses("lightseq-generate", data_bin, ls, tmp_path) == ref

    back = str(tmp_path / "back.pt")
    _run(["lightseq-convert", ls, back, "--to", "native"], tmp_path)
    a, b = torch.load(native, weights_only=False)["model"], torch.load(back, weights_only=False)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _hypotheses("fairseq-generate", data_bin, back, tmp_path) == ref


@pytest.mark.slow
def test_ls_checkpoint_loads_in_plain_fairseq(data_bin, tmp_path):
    ls = _train("lightseq-train", "ls_transformer_tiny", "ls_label_smoothed_cross_entropy", "ls_adam", data_bin,
                str(tmp_path / "ls"), tmp_path)
    ref = _hypotheses("lightseq-generate", data_bin, ls, tmp_path)
    native = str(tmp_path / "native.pt")
    _run(["lightseq-convert", ls, native, "--to", "native"], tmp_path)
    # no --user-dir, and ls_fairseq made unimportable: plain fairseq alone must load it
    blocker = tmp_path / "blocker" / "ls_fairseq"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('ls_fairseq must not be imported here')\n")
    env = dict(_env(), PYTHONPATH=str(blocker.parent))
    out = _hypotheses("fairseq-generate", data_bin, native, tmp_path, env=env)
    assert out == ref
    # the blocker works: the unconverted ls checkpoint does not load there
    with pytest.raises(AssertionError, match="build_model"):  # fairseq cannot build ls_transformer_tiny
        _hypotheses("fairseq-generate", data_bin, ls, tmp_path, env=env)
