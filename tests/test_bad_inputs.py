"""Bad inputs that fairseq accepts and then fails on deep inside, or silently mishandles: each gives a clear
error naming the flag (or is handled), so none can slip back in unnoticed."""

import math
import types

import pytest
import torch

TRAIN = ["data-bin", "--arch", "ls_transformer_tiny", "--optimizer", "ls_adam", "--lr", "1e-3",
         "--criterion", "ls_label_smoothed_cross_entropy", "--max-tokens", "64", "--cpu"]


@pytest.mark.parametrize("extra, env, message", [
    (["--update-freq", "0"], {}, "--update-freq must be >= 1"),
    (["--update-freq", "2,0"], {}, "--update-freq must be >= 1"),
    (["--quant-noise-scalar", "0.1"], {}, "--quant-noise-scalar"),
    (["--ls-graph-buckets", "0"], {}, "--ls-graph-buckets must be >= 1"),
])
def test_lightseq_train_refuses(extra, env, message, monkeypatch, capsys):
    from ls_fairseq.cli import train

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as e:
        train.parse(TRAIN + extra)
    assert message in str(e.value) + capsys.readouterr().err


def test_a_missing_restore_file_is_an_error(tmp_path):
    from ls_fairseq.fairseq_ext.step.run_checks import prepare_checkpoints

    cfg = types.SimpleNamespace(checkpoint=types.SimpleNamespace(
        restore_file=str(tmp_path / "nope.pt"), save_dir=str(tmp_path), no_save=False))
    with pytest.raises(SystemExit, match="--restore-file .*nope.pt does not exist"):
        prepare_checkpoints(cfg)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(bytes(range(256)) * 40)
    cfg.checkpoint.restore_file = str(junk)
    with pytest.raises(SystemExit, match="junk.pt is not a readable checkpoint"):
        prepare_checkpoints(cfg)
    cfg.checkpoint.restore_file = "checkpoint_last.pt"  # the default: a first run has none, which is fine
    prepare_checkpoints(cfg)


@pytest.mark.parametrize("flags, message", [
    (["--beam", "0"], "--beam must be >= 1"),
    (["--nbest", "5", "--beam", "2"], "--nbest 5 is larger than --beam 2"),
    (["--nbest=0"], "--nbest must be >= 1"),
    (["--beam", "x"], "takes a whole number"),
])
def test_lightseq_generate_refuses(flags, message):
    from ls_fairseq.cli.generate import check_search_flags

    with pytest.raises(SystemExit, match=message):
        check_search_flags(["data-bin", "--path", "c.pt"] + flags)
    check_search_flags(["data-bin", "--beam", "4", "--nbest", "4"])  # a valid pair passes


def test_an_ignored_prefix_covering_the_target_is_an_error():
    from ls_fairseq.fairseq_ext.criterion import LSLabelSmoothedCrossEntropyCriterion
    from tests._models import build_model, make_dict

    d = make_dict()
    model = build_model("ls_transformer_tiny", d)
    task = types.SimpleNamespace(target_dictionary=d, source_dictionary=d)
    crit = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1, ignore_prefix_size=4)
    tgt = torch.randint(d.nspecial, len(d), (2, 4))
    prev = torch.cat([torch.full((2, 1), d.eos()), tgt[:, :-1]], 1)
    src = torch.randint(d.nspecial, len(d), (2, 5))
    sample = {"net_input": {"src_tokens": src, "src_lengths": torch.tensor([5, 5]), "prev_output_tokens": prev},
              "target": tgt, "ntokens": 8}
    with pytest.raises(ValueError, match="--ignore-prefix-size 4 covers every target position"):
        crit(model, sample)
    crit.ignore_prefix_size = 3
    loss, _, _ = crit(model, sample)
    assert loss.item() > 0


@pytest.mark.parametrize("lr, bad", [(-0.01, True), (0.0, False), (1e-4, False), ({"default": -1e-5}, True)])
def test_a_negative_scheduled_learning_rate_stops_training(lr, bad):
    from ls_fairseq.fairseq_ext.step.trainer import LSTrainer, check_lr as _check_lr

    assert "lr_step_update" in LSTrainer.__dict__  # every update's learning rate goes through the check
    if bad:
        with pytest.raises(ValueError, match="negative learning rate"):
            _check_lr(lr)
    else:
        _check_lr(lr)


def test_a_nan_validation_loss_never_makes_a_best_checkpoint(monkeypatch):
    from fairseq import checkpoint_utils

    from ls_fairseq.fairseq_ext.patches import keep_nan_from_best

    seen = []
    monkeypatch.setattr(checkpoint_utils, "save_checkpoint", lambda cfg, tr, itr, val_loss: seen.append(val_loss))
    keep_nan_from_best()
    keep_nan_from_best()  # idempotent
    for v in (2.5, float("nan"), math.inf, None):
        checkpoint_utils.save_checkpoint(None, None, None, v)
    assert seen == [2.5, None, None, None]


# ----------------------------------------------------------------------------- the data-bin
# data_bin: the session's toy data-bin (tests/conftest.py); a test that damages it works on a copy


def _copy(src, dst):
    import shutil

    shutil.copytree(str(src), dst)
    return dst


def test_sound_data_passes(data_bin):
    from ls_fairseq.fairseq_ext.data_checks import check_translation_data

    assert check_translation_data(str(data_bin)) == []


def test_an_empty_train_split_is_named(data_bin, tmp_path):
    from ls_fairseq.fairseq_ext.data_checks import check_translation_data

    d = _copy(data_bin, tmp_path / "d")
    (d / "train.src-tgt.src.bin").write_bytes(b"")
    problems = check_translation_data(str(d))
    assert len(problems) == 1 and "train.src-tgt.src.bin is empty" in problems[0]


def test_a_smaller_dictionary_or_random_bytes_are_named(data_bin, tmp_path):
    import numpy as np

    from ls_fairseq.fairseq_ext.data_checks import check_translation_data

    d = _copy(data_bin, tmp_path / "small")
    lines = (d / "dict.tgt.txt").read_text().splitlines()
    (d / "dict.tgt.txt").write_text("\n".join(lines[:10]) + "\n")  # a dictionary of another, smaller corpus
    problems = check_translation_data(str(d))
    assert len(problems) == 1 and "train.src-tgt.tgt.bin holds token id" in problems[0] and "14 entries" in problems[0]

    d = _copy(data_bin, tmp_path / "noise")
    path = d / "train.src-tgt.src.bin"
    noise = np.random.default_rng(0).integers(0, 65535, path.stat().st_size // 2, dtype=np.uint16)
    noise[0] = 65000
    path.write_bytes(noise.tobytes())
    problems = check_translation_data(str(d))
    assert len(problems) == 1 and "train.src-tgt.src.bin holds token id" in problems[0]


def test_lightseq_train_stops_on_bad_data(data_bin, tmp_path):
    from ls_fairseq.cli import train
    from ls_fairseq.fairseq_ext.step import run_checks

    d = _copy(data_bin, tmp_path / "e")
    (d / "train.src-tgt.tgt.bin").write_bytes(b"")
    args = train.parse([str(d)] + TRAIN[1:])
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    with pytest.raises(SystemExit, match="train.src-tgt.tgt.bin is empty"):
        run_checks.check_data(convert_namespace_to_omegaconf(args))
