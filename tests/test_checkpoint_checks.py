"""Every command that loads a checkpoint: a missing, empty, truncated or random-bytes file is one line naming
the file and what is wrong, with exit status 1 (lightseq-generate / -validate / -convert, and fairseq's own
commands through install_checkpoint_checks)."""

import os
import subprocess
import sys

import pytest
import torch

from ls_fairseq.fairseq_ext import checkpoint_files
from ls_fairseq.fairseq_ext.checkpoint_files import CheckpointFileError, checkpoint_problem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# kind -> the phrase the error gives
KINDS = {
    "missing": "was not found",
    "empty": r"is empty \(0 bytes\)",
    "truncated": "is truncated or damaged",
    "random": "is not a PyTorch checkpoint",
    "folder": "is a folder",
}


def _good(path):
    torch.save({"model": {"w": torch.zeros(300)}, "cfg": None, "args": None}, str(path))
    return str(path)


def _bad(folder, kind):
    path = os.path.join(str(folder), f"{kind}.pt")
    if kind == "empty":
        open(path, "wb").close()
    elif kind == "truncated":
        data = open(_good(os.path.join(str(folder), "whole.pt")), "rb").read()
        open(path, "wb").write(data[:len(data) // 2])
    elif kind == "random":
        open(path, "wb").write(b"\x00" + os.urandom(4000))
    elif kind == "folder":
        os.makedirs(path)
    return path


def _damaged_pickle(folder):
    """A complete zip archive whose pickle is damaged: only reading it tells."""
    data = bytearray(open(_good(os.path.join(str(folder), "whole.pt")), "rb").read())
    data[70:140] = b"\x07" * 70
    path = os.path.join(str(folder), "damaged.pt")
    open(path, "wb").write(bytes(data))
    return path


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_checkpoint_problem_names_what_is_wrong(tmp_path, kind):
    import re

    assert re.search(KINDS[kind], checkpoint_problem(_bad(tmp_path, kind)))
    assert checkpoint_problem(_good(tmp_path / "ok.pt")) is None


def test_install_checkpoint_checks_is_idempotent():
    from fairseq import checkpoint_utils

    checkpoint_files.install_checkpoint_checks()
    first = checkpoint_utils.load_checkpoint_to_cpu, checkpoint_utils.load_model_ensemble_and_task
    checkpoint_files.install_checkpoint_checks()
    assert (checkpoint_utils.load_checkpoint_to_cpu, checkpoint_utils.load_model_ensemble_and_task) == first
    assert first[0].ls_checked and first[1].ls_checked and sys.excepthook.ls_one_line


@pytest.mark.parametrize("kind", sorted(KINDS) + ["damaged", "not-fairseq"])
def test_fairseq_loaders_name_the_file(tmp_path, kind):
    """What fairseq-generate / -validate / -interactive (load_model_ensemble) and a resumed fairseq-train
    (load_checkpoint_to_cpu) read, once the checks are installed."""
    from fairseq import checkpoint_utils

    checkpoint_files.install_checkpoint_checks()
    if kind == "damaged":
        path, match = _damaged_pickle(tmp_path), r"cannot be read, it is damaged .*UnpicklingError"
    elif kind == "not-fairseq":
        path, match = str(tmp_path / "plain.pt"), "is not a fairseq checkpoint"
        torch.save({"weights": 1}, path)
    else:
        path, match = _bad(tmp_path, kind), KINDS[kind]
    with pytest.raises(CheckpointFileError, match=f"checkpoint {path} {match}"):
        checkpoint_utils.load_model_ensemble([path])
    if kind != "missing":
        with pytest.raises(CheckpointFileError, match=f"checkpoint {path} {match}"):
            checkpoint_utils.load_checkpoint_to_cpu(path)


@pytest.mark.parametrize("command", ["generate", "validate"])
@pytest.mark.parametrize("kind", ["missing", "empty", "truncated", "random"])
def test_lightseq_generate_and_validate(tmp_path, capsys, command, kind):
    import importlib

    path = _bad(tmp_path, kind)
    module = importlib.import_module(f"ls_fairseq.cli.{command}")
    with pytest.raises(SystemExit) as e:
        module.cli_main([str(tmp_path), "--path", f"{_good(tmp_path / 'ok.pt')}:{path}", "--cpu"])
    import re

    assert re.fullmatch(f"lightseq-{command}: error: checkpoint {path} {KINDS[kind]}.*", str(e.value.code))


def _dicts_only(folder):
    for lang in ("en", "de"):
        (folder / f"dict.{lang}.txt").write_text("a 1\nb 1\n")
    return str(folder)


def test_lightseq_generate_damaged_checkpoint_after_the_precheck(tmp_path):
    """A file that looks whole but does not unpickle: named when fairseq reads it."""
    from ls_fairseq.cli import generate
    from tests._models import fairseq_run

    path = _damaged_pickle(tmp_path)
    with fairseq_run(), pytest.raises(SystemExit) as e:
        generate.cli_main([_dicts_only(tmp_path), "--path", path, "--cpu", "-s", "en", "-t", "de"])
    assert str(e.value.code).startswith(f"lightseq-generate: error: checkpoint {path} cannot be read")


@pytest.mark.parametrize("kind", ["missing", "empty", "truncated", "random"])
def test_lightseq_convert(tmp_path, capsys, kind):
    from ls_fairseq.cli import convert
    from tests._models import fairseq_run

    path = _bad(tmp_path, kind)
    with fairseq_run(), pytest.raises(SystemExit) as e:
        convert.cli_main([path, str(tmp_path / "out.pt"), "--to", "ls"])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    import re

    assert len(err) == 1 and re.fullmatch(f"lightseq-convert: error: checkpoint {path} {KINDS[kind]}.*", err[0])


def test_fairseq_generate_with_the_checks_prints_one_line(tmp_path):
    """fairseq's own fairseq-generate, its plugin folder installing the checks: one line on stderr, status 1."""
    plugin = tmp_path / "ls_plugin_checks"
    plugin.mkdir()
    (plugin / "__init__.py").write_text(
        "import ls_fairseq.fairseq_ext  # noqa: F401\n"
        "from ls_fairseq.fairseq_ext.checkpoint_files import install_checkpoint_checks\n"
        "install_checkpoint_checks()\n")
    path = _bad(tmp_path, "empty")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run(["fairseq-generate", _dicts_only(tmp_path), "--user-dir", str(plugin), "--path", path,
                          "--cpu", "-s", "en", "-t", "de"], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1] == (
        f"fairseq-generate: error: checkpoint {path} is empty (0 bytes): a save or copy that was interrupted "
        "before it wrote anything")
