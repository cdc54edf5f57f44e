"""The lightseq-* command lines: argv handling, user-dir resolution, the fairseq traps they
handle (--bf16 implying --tpu, the dropped last batch, checkpoint loading on torch >= 2.6)."""

import argparse
import os
import subprocess
import sys

import pytest

from ls_fairseq.cli import _common, generate, train, validate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- argv helpers
def test_has_flag_exact_names_only():
    assert _common.has_flag(["--user-dir", "x"], "--user-dir")
    assert _common.has_flag(["--user-dir=x"], "--user-dir")
    assert not _common.has_flag(["--user-dirs", "x"], "--user-dir")
    assert not _common.has_flag(["--user"], "--user-dir")
    # after a bare "--" everything is positional
    assert not _common.has_flag(["data", "--", "--user-dir"], "--user-dir")


def test_user_dir_is_the_repository_plugin_folder():
    path = _common.user_dir_path()
    assert path == os.path.join(ROOT, "user_dir")
    # fairseq imports the folder by its basename; it must not be inside the package
    assert os.path.basename(path) == "user_dir"
    assert not path.startswith(os.path.join(ROOT, "ls_fairseq"))
    with open(os.path.join(path, "__init__.py")) as f:
        assert "import ls_fairseq.fairseq_ext" in f.read()


def test_user_dir_outside_a_checkout_is_written_once(tmp_path, monkeypatch):
    monkeypatch.setattr(_common, "_PKG_ROOT", str(tmp_path / "site-packages"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = _common.user_dir_path()
    assert path == str(tmp_path / "cache" / "ls_fairseq" / "plugin" / "user_dir")
    with open(os.path.join(path, "__init__.py")) as f:
        assert f.read() == _common._PLUGIN_INIT
    assert _common.user_dir_path() == path


def test_with_user_dir_adds_once_and_respects_the_users():
    argv = _common.with_user_dir(["data-bin", "--arch", "ls_transformer_tiny"])
    assert argv[:3] == ["data-bin", "--arch", "ls_transformer_tiny"]
    assert argv[3:] == ["--user-dir", _common.user_dir_path()]
    assert _common.with_user_dir(argv) == argv
    mine = ["data-bin", "--user-dir=/my/plugin"]
    assert _common.with_user_dir(mine) == mine
    mine = ["data-bin", "--user-dir", "/my/plugin"]
    assert _common.with_user_dir(mine) == mine


@pytest.mark.parametrize("module", [generate, validate])
def test_generate_and_validate_score_every_sentence(module):
    argv = module.build_argv(["data-bin", "--path", "ckpt.pt"])
    i = argv.index("--required-batch-size-multiple")
    assert argv[i + 1] == "1"
    assert _common.has_flag(argv, "--user-dir")
    # the user's own value wins, and is not duplicated
    argv = module.build_argv(["data-bin", "--required-batch-size-multiple", "8"])
    assert argv.count("--required-batch-size-multiple") == 1
    assert argv[argv.index("--required-batch-size-multiple") + 1] == "8"
    argv = module.build_argv(["data-bin", "--required-batch-size-multiple=4"])
    assert not any(a == "--required-batch-size-multiple" for a in argv)


def test_build_argv_reads_sys_argv_when_none(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightseq-generate", "bin", "--beam", "4"])
    argv = generate.build_argv(None)
    assert argv[:3] == ["bin", "--beam", "4"]


# --------------------------------------------------------------------------- --bf16
def _parse(argv, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightseq-train"])
    return train.parse(argv)


_ARGS = ["data-bin", "--arch", "transformer_tiny", "--user-dir", os.path.join(ROOT, "user_dir")]


def test_bf16_does_not_imply_tpu(monkeypatch):
    args = _parse(_ARGS + ["--bf16"], monkeypatch)
    assert args.bf16 and not args.tpu
    args = _parse(_ARGS + ["--memory-efficient-bf16"], monkeypatch)
    assert args.bf16 and args.memory_efficient_bf16 and not args.tpu


@pytest.mark.parametrize("prec", ["fp16", "bf16"])
def test_ls_adam_keeps_the_master_weights_under_mixed_precision(monkeypatch, prec):
    args = _parse(_ARGS + [f"--{prec}", "--optimizer", "ls_adam"], monkeypatch)
    assert getattr(args, f"memory_efficient_{prec}")
    # other optimizers keep fairseq's FP16Optimizer
    args = _parse(_ARGS + [f"--{prec}", "--optimizer", "adam"], monkeypatch)
    assert not getattr(args, f"memory_efficient_{prec}")


def test_distributed_ls_adam_trains_under_legacy_ddp(monkeypatch, caplog):
    two = ["--optimizer", "ls_adam", "--distributed-world-size", "2"]
    with caplog.at_level("INFO", logger="ls_fairseq.cli.train"):
        args = _parse(_ARGS + two, monkeypatch)
    assert args.ddp_backend == "legacy_ddp"
    assert sum("--ddp-backend legacy_ddp" in r.getMessage() for r in caplog.records) == 1
    args = _parse(_ARGS + two + ["--fp16"], monkeypatch)  # ls_adam holds the fp16 model's gradients
    assert args.ddp_backend == "legacy_ddp" and args.memory_efficient_fp16


def test_ls_adam_buckets_default_to_100_mb_under_legacy_ddp(monkeypatch):
    two = ["--optimizer", "ls_adam", "--distributed-world-size", "2"]
    assert _parse(_ARGS + two, monkeypatch).bucket_cap_mb == 100
    assert _parse(_ARGS + two + ["--bucket-cap-mb", "25"], monkeypatch).bucket_cap_mb == 25  # the user's
    assert _parse(_ARGS + two + ["--bucket-cap-mb=50"], monkeypatch).bucket_cap_mb == 50
    # fairseq's default where ls_adam does not reduce the gradients itself
    assert _parse(_ARGS + two + ["--ddp-backend", "pytorch_ddp"], monkeypatch).bucket_cap_mb == 25
    assert _parse(_ARGS + ["--optimizer", "adam", "--distributed-world-size", "2"], monkeypatch).bucket_cap_mb == 25
    assert _parse(_ARGS + ["--optimizer", "ls_adam", "--distributed-world-size", "1"], monkeypatch).bucket_cap_mb == 25


@pytest.mark.parametrize("extra, expected", [
    (["--optimizer", "ls_adam", "--distributed-world-size", "2", "--ddp-backend", "pytorch_ddp"], "pytorch_ddp"),
    (["--optimizer", "ls_adam", "--distributed-world-size", "2", "--ddp-backend=c10d"], "c10d"),
    (["--optimizer", "adam", "--distributed-world-size", "2"], "pytorch_ddp"),  # another optimizer
    (["--optimizer", "ls_adam", "--distributed-world-size", "1"], "pytorch_ddp"),  # one worker
])
def test_ddp_backend_is_left_alone(monkeypatch, caplog, extra, expected):
    with caplog.at_level("INFO", logger="ls_fairseq.cli.train"):
        args = _parse(_ARGS + extra, monkeypatch)
    assert args.ddp_backend == expected
    assert not any("legacy_ddp" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("extra, grouped, rebuild", [
    (["--distributed-world-size", "2"], False, False),  # fairseq's shuffle unless asked for
    (["--distributed-world-size", "2", "--grouped-shuffling"], True, False),  # fairseq would rebuild
    (["--grouped-shuffling"], True, False),
    (["--grouped-shuffling", "--update-epoch-batch-itr", "True"], True, True),  # an explicit choice stays
])
def test_grouped_shuffling_keeps_the_epoch_iterator(monkeypatch, extra, grouped, rebuild):
    args = _parse(_ARGS + ["--optimizer", "adam"] + extra, monkeypatch)
    assert args.grouped_shuffling is grouped
    assert str(args.update_epoch_batch_itr) == str(rebuild)  # fairseq keeps an explicit value as text


def test_grouped_shuffling_is_fairseqs_under_the_plain_trainer(monkeypatch):
    args = _parse(_ARGS + ["--grouped-shuffling", "--optimizer", "ls_adam", "--ls-trainer", "off"], monkeypatch)
    assert args.grouped_shuffling and args.update_epoch_batch_itr  # fairseq's own default


def test_grouped_shuffling_help_names_the_update_grouping(entry_point_help):
    train_help = entry_point_help.split("OK ls_fairseq.cli.train")[0]
    assert "shuffle whole updates" in " ".join(train_help.split())


def test_explicit_tpu_is_kept(monkeypatch):
    args = _parse(_ARGS + ["--bf16", "--tpu"], monkeypatch)
    assert args.bf16 and args.tpu


def test_plain_arguments_are_fairseqs(monkeypatch):
    args = _parse(_ARGS + ["--lr", "0.01", "--max-tokens", "100"], monkeypatch)
    assert not args.bf16 and not args.tpu
    assert args.lr == [0.01] and args.max_tokens == 100
    assert args.user_dir == os.path.join(ROOT, "user_dir")
    assert sys.argv[1:] == _ARGS + ["--lr", "0.01", "--max-tokens", "100"]


def test_fix_bf16_only_touches_the_implied_tpu():
    from ls_fairseq.fairseq_ext.step import takeover

    ns = argparse.Namespace(bf16=True, tpu=True)
    assert takeover.fix_bf16(ns, ["--bf16"]) and not ns.tpu
    ns = argparse.Namespace(bf16=True, tpu=True)
    assert not takeover.fix_bf16(ns, ["--bf16", "--tpu"]) and ns.tpu
    ns = argparse.Namespace(bf16=False, tpu=False)
    assert not takeover.fix_bf16(ns, []) and not ns.tpu


@pytest.mark.parametrize("flags", [["--fp16", "--bf16"], ["--memory-efficient-fp16", "--bf16"],
                                   ["--amp", "--memory-efficient-bf16"]])
def test_conflicting_precisions_are_a_clear_error(flags):
    with pytest.raises(SystemExit, match="lightseq-train"):
        train.check_precision_flags(["data-bin"] + flags)


def test_help_explains_bf16(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        _parse(["--help"], monkeypatch)
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert train.BF16_HELP in out
    assert "lightseq-train is fairseq-train with the ls_fairseq plugin" in out


# --------------------------------------------------------------------------- checkpoints
def test_fairseq_checkpoint_loads_with_torch_weights_only_default(tmp_path):
    """torch >= 2.6 refuses a fairseq checkpoint by default; the compat fix loads it."""
    import torch

    path = str(tmp_path / "ckpt.pt")
    args = argparse.Namespace(arch="transformer_tiny", task="translation", lr=[0.1],
                              optimizer="adam", criterion="cross_entropy", data="bin")
    history = [{"criterion_name": "CrossEntropyCriterion", "optimizer_name": "FairseqAdam",
                "lr_scheduler_state": {"best": None}, "num_updates": 7}]
    state = {"args": args, "model": {"w": torch.arange(3.0)}, "optimizer_history": history,
             "extra_state": {"train_iterator": {"epoch": 1}}, "last_optimizer_state": None}
    torch.save(state, path)
    with pytest.raises(Exception, match="[Ww]eights only"):
        torch.load(path)  # the trap is real on this torch
    assert _common.ensure_checkpoint_compat() in ("plugin", "standalone")
    from fairseq import checkpoint_utils

    loaded = checkpoint_utils.load_checkpoint_to_cpu(path)
    assert torch.equal(loaded["model"]["w"], torch.arange(3.0))
    assert loaded["cfg"].model.arch == "transformer_tiny"  # fairseq upgraded the Namespace


@pytest.fixture(scope="module")
def entry_point_help(tmp_path_factory):
    """The three console scripts' mains started in a fresh process with --help, one after the other (one
    process for all: each would pay seconds for importing fairseq); its stdout."""
    code = (
        "import sys; from ls_fairseq.cli import train, generate, validate\n"
        "for m in (train, generate, validate):\n"
        "    try:\n"
        "        m.cli_main(['--help'])\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "    print('OK', m.__name__, flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path_factory.mktemp("help"), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_entry_points_run(entry_point_help):
    """The three console scripts start and show fairseq's help (subprocess: the real path)."""
    for name in ("train", "generate", "validate"):
        assert f"OK ls_fairseq.cli.{name}" in entry_point_help
    assert "--beam" in entry_point_help and "--required-batch-size-multiple" in entry_point_help


def test_lightseq_validate_refuses_bf16():
    """fairseq-validate casts the model under --fp16 only: --bf16 would validate in fp32 without a word."""
    from ls_fairseq.cli import validate

    for flag in ("--bf16", "--memory-efficient-bf16"):
        with pytest.raises(SystemExit, match="lightseq-validate: --bf16 is not supported"):
            validate.cli_main(["data-bin", "--path", "missing.pt", flag])
