"""End to end through the command lines, like fairseq's tests/test_binaries.py: toy data ->
fairseq-preprocess -> lightseq-train (ls_transformer_tiny, ls_adam, ls criterion) -> resume ->
lightseq-validate -> lightseq-generate --beam 4, plus plain fairseq-generate --user-dir.

The lightseq mains run in-process (fairseq's import costs seconds per subprocess); only the
plain fairseq-generate check runs the installed console script. Every run reads its data without a
worker process (--num-workers 0): torch waits seconds for one to end.
"""

import importlib.util
import math
import os
import shutil
import subprocess

import pytest
import torch

from _models import TOY_CORPUS, fairseq_run, inner_by_update, lightseq_train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_TEST = TOY_CORPUS["n_test"]  # not a multiple of fairseq's default --required-batch-size-multiple (8)

TRAIN_FLAGS = [
    "--arch", "ls_transformer_tiny", "--share-all-embeddings",
    "--optimizer", "ls_adam", "--adam-betas", "(0.9, 0.98)", "--lr", "1e-3",
    "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--dropout", "0.1", "--max-tokens", "400", "--seed", "3", "--cpu", "--num-workers", "0",
    "--log-format", "json", "--log-interval", "1", "--no-epoch-checkpoints",
]


def _load_corpus_module():
    spec = importlib.util.spec_from_file_location("make_toy_corpus",
                                                  os.path.join(ROOT, "scripts", "make_toy_corpus.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def train(data, save_dir, *extra):
    """Run lightseq-train in-process; its json progress records (_models.inner_by_update: by update)."""
    return lightseq_train([data, "--save-dir", save_dir] + TRAIN_FLAGS + list(extra))


# data_bin: the session's toy data-bin (tests/conftest.py)
@pytest.fixture(scope="module")
def straight_run(data_bin, tmp_path_factory):
    """8 updates without interruption (crosses an epoch boundary at ~6 updates)."""
    save = str(tmp_path_factory.mktemp("straight"))
    records = train(data_bin, save, "--max-update", "8")
    return save, records


def _params(path):
    from fairseq import checkpoint_utils

    return checkpoint_utils.load_checkpoint_to_cpu(path)["model"]


@pytest.mark.slow
def test_train_loss_is_finite_and_falls(straight_run):
    _, records = straight_run
    inner = inner_by_update(records)
    assert sorted(inner) == list(range(1, 9))
    losses = [float(inner[u]["loss"]) for u in range(1, 9)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(float(inner[u]["gnorm"]) > 0 for u in inner)


@pytest.mark.slow
def test_resume_matches_uninterrupted_training(data_bin, straight_run, tmp_path):
    """Train 4, stop, resume to 8: the same losses and the same weights as 8 straight."""
    save_a, records_a = straight_run
    save_b = str(tmp_path / "resumed")
    first = inner_by_update(train(data_bin, save_b, "--max-update", "4"))
    assert sorted(first) == [1, 2, 3, 4]
    second = inner_by_update(train(data_bin, save_b, "--max-update", "8"))
    assert sorted(second) == [5, 6, 7, 8], "resume did not continue from update 4"
    straight = inner_by_update(records_a)
    for u in range(1, 9):
        got = (first if u <= 4 else second)[u]
        for key in ("loss", "nll_loss", "gnorm", "lr"):
            assert float(got[key]) == float(straight[u][key]), (u, key, got[key], straight[u][key])
    a = _params(os.path.join(save_a, "checkpoint_last.pt"))
    b = _params(os.path.join(save_b, "checkpoint_last.pt"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.slow
def test_ls_trainer_trains_exactly_like_fairseqs_trainer(data_bin, straight_run, tmp_path, monkeypatch):
    """lightseq-train's LSTrainer changes when the host waits, never what is computed."""
    save_a, records_a = straight_run
    save_b = str(tmp_path / "plain")
    records_b = train(data_bin, save_b, "--max-update", "8", "--ls-trainer", "off")
    _assert_same_updates(save_a, records_a, save_b, records_b)


def _assert_same_updates(save_a, records_a, save_b, records_b):
    """Two runs of 8 updates logged the same loss, gradient norm and learning rate at every update, and ended
    with equal weights."""
    a_log, b_log = inner_by_update(records_a), inner_by_update(records_b)
    assert sorted(a_log) == sorted(b_log) == list(range(1, 9))
    for u in a_log:
        for key in ("loss", "nll_loss", "gnorm", "lr"):
            assert float(a_log[u][key]) == float(b_log[u][key]), (u, key)
    a = _params(os.path.join(save_a, "checkpoint_last.pt"))
    b = _params(os.path.join(save_b, "checkpoint_last.pt"))
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_validate_reproduces_the_training_validation_loss(data_bin, straight_run):
    from ls_fairseq.cli import validate

    save, records = straight_run
    valid = [r for name, r in records if name == "valid"]
    assert valid, "training logged no validation"
    with fairseq_run() as out:
        validate.cli_main([data_bin, "--path", os.path.join(save, "checkpoint_last.pt"),
                           "--valid-subset", "valid", "--max-tokens", "400", "--cpu", "--num-workers", "0",
                           "--log-format", "json"])
    scored = [r for name, r in out if name == "valid"]
    assert len(scored) == 1
    assert float(scored[0]["valid_loss"]) == pytest.approx(float(valid[-1]["valid_loss"]), abs=2e-3)


def _hypotheses(path):
    with open(path, encoding="utf-8") as f:
        return {int(line.split("\t")[0][2:]): line.rstrip("\n").split("\t")[2]
                for line in f if line.startswith("H-")}


@pytest.mark.slow
def test_generate_beam4_translates_every_sentence(data_bin, straight_run, tmp_path):
    from ls_fairseq.cli import generate

    save, _ = straight_run
    flags = [data_bin, "--path", os.path.join(save, "checkpoint_last.pt"), "--beam", "4",
             "--batch-size", "10", "--cpu", "--gen-subset", "test", "--num-workers", "0"]
    with fairseq_run():
        generate.cli_main(flags + ["--results-path", str(tmp_path / "all")])
    hyps = _hypotheses(tmp_path / "all" / "generate-test.txt")
    assert sorted(hyps) == list(range(N_TEST))
    # fairseq's own default (multiples of 8) leaves sentences out: the trap this guards against
    with fairseq_run():
        generate.cli_main(flags + ["--results-path", str(tmp_path / "x8"),
                                   "--required-batch-size-multiple", "8"])
    assert len(_hypotheses(tmp_path / "x8" / "generate-test.txt")) < N_TEST


def test_generate_bf16_decodes_in_bf16(data_bin, straight_run, tmp_path, monkeypatch):
    """lightseq-generate --bf16 runs the model in bfloat16 (fairseq's generate casts only under --fp16) and still
    translates every sentence."""
    from fairseq import sequence_generator

    from ls_fairseq.cli import generate

    save, _ = straight_run
    dtypes, real = [], sequence_generator.SequenceGenerator.generate

    def recording(self, models, *a, **k):
        dtypes.extend(next(m.parameters()).dtype for m in models)
        return real(self, models, *a, **k)

    monkeypatch.setattr(sequence_generator.SequenceGenerator, "generate", recording)
    with fairseq_run():
        generate.cli_main([data_bin, "--path", os.path.join(save, "checkpoint_last.pt"), "--beam", "4", "--bf16",
                           "--batch-size", "10", "--cpu", "--gen-subset", "test", "--num-workers", "0",
                           "--results-path", str(tmp_path)])
    assert dtypes and set(dtypes) == {torch.bfloat16}
    assert sorted(_hypotheses(tmp_path / "generate-test.txt")) == list(range(N_TEST))


@pytest.mark.slow
def test_plain_fairseq_generate_loads_an_ls_checkpoint(data_bin, straight_run, tmp_path):
    """A checkpoint of ls_transformer loads in plain fairseq-generate with --user-dir."""
    exe = shutil.which("fairseq-generate")
    assert exe, "fairseq-generate not on PATH"
    save, _ = straight_run
    out = subprocess.run(
        [exe, data_bin, "--path", os.path.join(save, "checkpoint_last.pt"),
         "--user-dir", os.path.join(ROOT, "user_dir"), "--beam", "4", "--batch-size", "16",
         "--required-batch-size-multiple", "1", "--cpu", "--gen-subset", "test", "--num-workers", "0"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    hyps = [line for line in out.stdout.splitlines() if line.startswith("H-")]
    assert len(hyps) == N_TEST


@pytest.mark.slow
def test_bf16_trains_on_cpu_without_tpu(data_bin, tmp_path, monkeypatch):
    """--bf16 without --tpu: starts, the model runs in bf16, the loss is finite, and the
    gradients reach the optimizer at every update (not only the first)."""
    from ls_fairseq.fairseq_ext.step.trainer import LSTrainer as Trainer

    seen = []
    original = Trainer.train_step

    def train_step(self, samples, *args, **kwargs):
        seen.append((self.device.type, {p.dtype for p in self.model.parameters()}))
        return original(self, samples, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    save = str(tmp_path / "bf16")
    records = train(data_bin, save, "--max-update", "4", "--bf16", "--disable-validation")
    assert seen and all(s == ("cpu", {torch.bfloat16}) for s in seen), seen
    inner = inner_by_update(records)
    assert sorted(inner) == [1, 2, 3, 4]
    for u, r in inner.items():
        assert math.isfinite(float(r["loss"])), (u, r)
        assert float(r["gnorm"]) > 0.1, f"no gradient reached the optimizer at update {u}: {r}"
    losses = [float(inner[u]["loss"]) for u in sorted(inner)]
    assert losses[-1] < losses[0], losses


def test_toy_corpus_is_deterministic_disjoint_and_not_a_copy(tmp_path):
    mod = _load_corpus_module()
    counts = mod.make_corpus(str(tmp_path / "a"), n_train=300, n_valid=20, n_test=21, seed=9)
    assert counts == {"train": 300, "valid": 20, "test": 21}
    mod.make_corpus(str(tmp_path / "b"), n_train=300, n_valid=20, n_test=21, seed=9)
    mod.make_corpus(str(tmp_path / "c"), n_train=300, n_valid=20, n_test=21, seed=10)

    def read(folder, name):
        with open(tmp_path / folder / name, encoding="utf-8") as f:
            return f.read().splitlines()

    for name in ("train.src", "train.tgt", "test.src", "test.tgt"):
        assert read("a", name) == read("b", name)
    assert read("a", "train.src") != read("c", "train.src")
    src = {split: read("a", f"{split}.src") for split in ("train", "valid", "test")}
    assert not set(src["test"]) & set(src["train"]) and not set(src["valid"]) & set(src["train"])
    # a different vocabulary on each side: copying the source gets no target word right
    src_vocab = {w for line in src["train"] for w in line.split()}
    tgt_vocab = {w for line in read("a", "train.tgt") for w in line.split()}
    assert not src_vocab & tgt_vocab
    # agreement: one source verb shows up with several target suffixes (subject gender/number)
    grammar = mod.ToyGrammar()
    stem = grammar.verb["see"]
    forms = {w for line in read("a", "train.tgt") for w in line.split() if w.startswith(stem)}
    assert len(forms) >= 3, forms
    with pytest.raises(ValueError, match="--test"):
        mod.make_corpus(str(tmp_path / "d"), n_test=0)


@pytest.mark.slow
def test_fairseq_train_with_the_ls_components_trains_as_lightseq_train(data_bin, straight_run, tmp_path):
    """fairseq-train --user-dir with the ls model, ls_adam and the ls criterion trains on LSTrainer (one log line
    says so) and takes exactly lightseq-train's updates."""
    from _models import fairseq_main, log_lines

    save_a, records_a = straight_run
    save_b = str(tmp_path / "fairseq_train")
    with log_lines() as lines:
        records_b = fairseq_main("train", [data_bin, "--save-dir", save_b, "--user-dir", os.path.join(ROOT, "user_dir"),
                                           *TRAIN_FLAGS, "--max-update", "8"])
    assert sum("trains this run on its own trainer" in x for x in lines) == 1, lines
    assert any("deferred step" in x for x in lines)
    _assert_same_updates(save_a, records_a, save_b, records_b)


def test_fairseq_train_without_the_ls_components_keeps_fairseqs_trainer(data_bin, tmp_path):
    """A native model and optimizer under fairseq-train --user-dir train on fairseq's Trainer, as without the
    plugin."""
    from _models import fairseq_main, log_lines

    flags = ["--arch", "transformer_tiny", "--optimizer", "adam", "--lr", "1e-3", "--criterion",
             "label_smoothed_cross_entropy", "--label-smoothing", "0.1", "--max-tokens", "400", "--cpu",
             "--num-workers", "0", "--max-update", "2", "--no-save", "--disable-validation"]
    with log_lines() as lines:
        fairseq_main("train", [data_bin, "--save-dir", str(tmp_path), "--user-dir", os.path.join(ROOT, "user_dir"),
                               *flags])
    assert any("done training" in x for x in lines)  # it trained
    assert not any("own trainer" in x or "deferred step" in x or "LSTrainer" in x for x in lines), lines
