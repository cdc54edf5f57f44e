"""lightseq-convert: native transformer <-> ls_transformer checkpoints, checked by generating.

Training, converting and generating run in this process (each would pay seconds for importing fairseq
in a process of its own); plain fairseq without the plugin runs as its own process, where ls_fairseq
cannot be imported."""

import os
import random
import re
from argparse import Namespace

import pytest
import torch

from ls_fairseq.cli import convert
from tests._models import fairseq_main, fairseq_run, lightseq_train, preprocess, run_checked

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = "the a house cat dog sees eats bread red car city old new book reads water child plays".split()
N_TEST = 12


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    root = tmp_path_factory.mktemp("convert_data")
    rng = random.Random(11)
    for split, n in (("train", 200), ("valid", 20), ("test", N_TEST)):
        src = [" ".join(rng.choices(WORDS, k=rng.randint(3, 8))) for _ in range(n)]
        (root / f"{split}.en").write_text("".join(s + "\n" for s in src))
        (root / f"{split}.de").write_text("".join(" ".join(reversed(s.split())) + "\n" for s in src))
    from ls_fairseq.fairseq_ext.compat import patch_checkpoint_loading

    patch_checkpoint_loading()  # fairseq's own mains read checkpoints here too, as lightseq-* do
    return preprocess(root, root / "bin", src="en", tgt="de")


def _train(native, data, save):
    flags = [data, "--arch", "transformer_tiny" if native else "ls_transformer_tiny", "--share-all-embeddings",
             "--optimizer", "adam" if native else "ls_adam", "--lr", "5e-3", "--criterion",
             "label_smoothed_cross_entropy" if native else "ls_label_smoothed_cross_entropy", "--label-smoothing",
             "0.1", "--max-tokens", "1024", "--max-update", "6", "--save-dir", save, "--no-progress-bar",
             "--no-epoch-checkpoints", "--num-workers", "0", "--seed", "5", "--cpu"]
    if native:
        fairseq_main("train", flags)  # plain fairseq-train: no --user-dir
    else:
        lightseq_train(flags)
    return os.path.join(save, "checkpoint_last.pt")


# no data-loading worker process: ending one costs seconds (torch waits for it), and a run is a few batches
_GENERATE = ["--beam", "3", "--max-tokens", "2000", "--required-batch-size-multiple", "1", "--num-workers", "0"]


def _read_hypotheses(text):
    hyps = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", text, flags=re.M))
    assert len(hyps) == N_TEST, text[-3000:]
    return hyps


def _hypotheses(native, data, path, out):
    """fairseq-generate (``native``) or lightseq-generate, in this process, of the test split."""
    from ls_fairseq.cli import generate

    flags = [data, "--path", path, *_GENERATE, "--cpu", "--results-path", str(out)]
    if native:
        fairseq_main("generate", flags)
    else:
        generate.cli_main(flags)
    with open(os.path.join(str(out), "generate-test.txt"), encoding="utf-8") as f:
        return _read_hypotheses(f.read())


def _convert(src, dst, to):
    """lightseq-convert in this process."""
    with fairseq_run():  # its logging setup is undone afterwards
        assert convert.cli_main([src, dst, "--to", to]) == 0


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
    native = _train(True, data_bin, str(tmp_path / "native"))
    ref = _hypotheses(True, data_bin, native, tmp_path / "gen_native")

    ls = str(tmp_path / "as_ls.pt")
    _convert(native, ls, "ls")
    state = torch.load(ls, weights_only=False)
    assert state["cfg"]["model"].arch == "ls_transformer_tiny"
    assert _hypotheses(False, data_bin, ls, tmp_path / "gen_ls") == ref

    back = str(tmp_path / "back.pt")
    _convert(ls, back, "native")
    a, b = torch.load(native, weights_only=False)["model"], torch.load(back, weights_only=False)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert _hypotheses(True, data_bin, back, tmp_path / "gen_back") == ref


def _plain_fairseq_generate(data, path, cwd, env):
    """fairseq-generate as its own process, where ls_fairseq cannot be imported."""
    out = run_checked(["fairseq-generate", data, "--path", path, *_GENERATE], cwd, env, timeout=300)
    return _read_hypotheses(out)


@pytest.mark.slow
def test_ls_checkpoint_loads_in_plain_fairseq(data_bin, tmp_path):
    ls = _train(False, data_bin, str(tmp_path / "ls"))
    ref = _hypotheses(False, data_bin, ls, tmp_path / "gen_ls")
    native = str(tmp_path / "native.pt")
    _convert(ls, native, "native")
    # no --user-dir, and ls_fairseq made unimportable: plain fairseq alone must load it
    blocker = tmp_path / "blocker" / "ls_fairseq"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('ls_fairseq must not be imported here')\n")
    # plain fairseq on torch >= 2.6 needs weights_only=False to read its own checkpoints
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1",
               PYTHONPATH=str(blocker.parent))
    out = _plain_fairseq_generate(data_bin, native, tmp_path, env)
    assert out == ref
    # the blocker works: the unconverted ls checkpoint does not load there
    with pytest.raises(AssertionError, match="build_model"):  # fairseq cannot build ls_transformer_tiny
        _plain_fairseq_generate(data_bin, ls, tmp_path, env)
