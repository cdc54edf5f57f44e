"""Checkpoint files that survive interrupted saves (ls_fairseq/fairseq_ext/checkpoint_files.py), down to a
lightseq-train run killed inside a save and resumed."""

import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from ls_fairseq.fairseq_ext import checkpoint_files as cf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save(path, value):
    torch.save({"w": torch.full((2000,), float(value)), "updates": value}, path)


def _value(path):
    return torch.load(path, weights_only=False)["updates"]


def test_readable_tells_complete_from_truncated_checkpoints(tmp_path):
    p = tmp_path / "c.pt"
    _save(p, 1)
    assert cf.readable(str(p))
    data = p.read_bytes()
    for cut in (0, 1, 100, len(data) // 2, len(data) - 1):
        (tmp_path / "t.pt").write_bytes(data[:cut])
        assert not cf.readable(str(tmp_path / "t.pt")), cut
    assert not cf.readable(str(tmp_path / "missing.pt"))


def test_atomic_copy_is_a_separate_complete_file(tmp_path):
    src, dst = tmp_path / "checkpoint_1_10.pt", tmp_path / "checkpoint_last.pt"
    _save(src, 10)
    _save(dst, 5)
    cf.atomic_copy(str(src), str(dst))
    assert _value(dst) == 10 and not os.path.samefile(src, dst)
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_1_10.pt", "checkpoint_last.pt"]  # no temporaries left
    _save(src, 11)  # written in place: the copy keeps its own content
    assert _value(dst) == 10


def test_a_copy_killed_halfway_leaves_the_old_checkpoint_whole(tmp_path):
    """A process killed inside the copy (deterministically, after half the bytes): checkpoint_last.pt is still
    the previous complete checkpoint, and the next start removes the half-written temporary."""
    src, dst = tmp_path / "checkpoint_2_20.pt", tmp_path / "checkpoint_last.pt"
    _save(src, 20)
    _save(dst, 10)
    code = textwrap.dedent(f"""
        import os, shutil
        from ls_fairseq.fairseq_ext import checkpoint_files as cf
        def half(fin, fout, n=0):
            fout.write(fin.read(os.path.getsize({str(src)!r}) // 2)); fout.flush(); os._exit(9)
        shutil.copyfileobj = half
        cf.atomic_copy({str(src)!r}, {str(dst)!r})
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 9, res.stderr
    leftovers = [n for n in os.listdir(tmp_path) if n.endswith(cf.TMP_SUFFIX)]
    assert len(leftovers) == 1
    assert cf.readable(str(dst)) and _value(dst) == 10
    assert cf.recover_last_checkpoint(str(tmp_path)) is None  # checkpoint_last is fine: nothing to replace
    assert not [n for n in os.listdir(tmp_path) if n.endswith(cf.TMP_SUFFIX)]


def test_recover_puts_the_newest_readable_checkpoint_in_place(tmp_path):
    for i, v in enumerate((10, 20, 30)):
        p = tmp_path / f"checkpoint_1_{v}.pt"
        _save(p, v)
        os.utime(p, (1000 + i, 1000 + i))
    newest = tmp_path / "checkpoint_1_30.pt"
    newest.write_bytes(newest.read_bytes()[:500])  # the newest numbered checkpoint is damaged too
    (tmp_path / "checkpoint_last.pt").write_bytes(b"")  # what fairseq's plain copy leaves when killed
    (tmp_path / "checkpoint_1_40.pt.tmp").write_bytes(b"PK")
    got = cf.recover_last_checkpoint(str(tmp_path))
    assert got == str(tmp_path / "checkpoint_1_20.pt")
    assert _value(tmp_path / "checkpoint_last.pt") == 20
    assert (tmp_path / "checkpoint_last.pt.unreadable").exists()
    assert not (tmp_path / "checkpoint_1_40.pt.tmp").exists()


def test_recover_with_nothing_readable_starts_afresh(tmp_path, caplog):
    (tmp_path / "checkpoint_last.pt").write_bytes(b"PK\x03\x04junk")
    with caplog.at_level("WARNING", logger="ls_fairseq.checkpoints"):
        assert cf.recover_last_checkpoint(str(tmp_path)) is None
    assert "starts from the beginning" in caplog.text
    assert not (tmp_path / "checkpoint_last.pt").exists()


# ----------------------------------------------------------------------------- lightseq-train, killed in a save
@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    from tests._models import preprocess

    raw = tmp_path_factory.mktemp("kill_data")
    words = [f"w{i}" for i in range(30)]
    g = torch.Generator().manual_seed(0)
    for split, n in (("train", 200), ("valid", 20), ("test", 20)):
        for lang in ("en", "de"):
            lines = [" ".join(words[j] for j in torch.randint(0, 30, (int(torch.randint(3, 9, (1,), generator=g)),),
                                                                generator=g).tolist()) for _ in range(n)]
            (raw / f"{split}.{lang}").write_text("\n".join(lines) + "\n")
    return preprocess(raw, raw / "bin", src="en", tgt="de")


def _flags(data, save_dir, max_update):
    return [data, "--arch", "ls_transformer_tiny", "--optimizer", "ls_adam", "--lr", "1e-3", "--criterion",
            "ls_label_smoothed_cross_entropy", "--max-tokens", "500", "--cpu", "--num-workers", "0",
            "--max-update", str(max_update), "--save-interval-updates", "4", "--no-epoch-checkpoints",
            "--save-dir", str(save_dir), "--seed", "1", "--log-format", "simple", "--log-interval", "1"]


def _train_killed(data, save_dir, max_update, kill):
    """lightseq-train as a process of its own that dies (os._exit(9)) inside a save: ("copy", n) halfway through
    the n-th checkpoint copy, ("write", n) halfway through writing the n-th checkpoint file itself."""
    what, n = kill
    patch = textwrap.dedent(f"""
        import io, os, shutil, torch
        n = {{"copy": 0, "write": 0}}
        real_copy, real_save = shutil.copyfileobj, torch.save
        def copy(fin, fout, length=0):
            n["copy"] += 1
            if n["copy"] == {n} and {what!r} == "copy":
                fout.write(fin.read(1000)); fout.flush(); os._exit(9)
            return real_copy(fin, fout, length)
        def save(obj, f, *a, **k):
            n["write"] += 1
            if n["write"] == {n} and {what!r} == "write" and not isinstance(f, (str, os.PathLike)):
                buf = io.BytesIO(); real_save(obj, buf, *a, **k)
                f.write(buf.getvalue()[:len(buf.getvalue()) // 2]); f.flush(); os._exit(9)
            return real_save(obj, f, *a, **k)
        shutil.copyfileobj, torch.save = copy, save
    """)
    code = patch + f"from ls_fairseq.cli.train import cli_main\ncli_main({_flags(data, save_dir, max_update)!r})\n"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def _train_again(data, save_dir, max_update):
    """lightseq-train started again on the same --save-dir, in this process (what a restarted process runs
    from its first line); what it logged, as lines."""
    from tests._models import lightseq_train, log_lines

    with log_lines() as lines:
        lightseq_train(_flags(data, save_dir, max_update))
    return "\n".join(lines)


@pytest.mark.slow
@pytest.mark.parametrize("kill", [("copy", 1), ("copy", 3), ("write", 2), ("write", 3)])
def test_lightseq_train_killed_inside_a_save_resumes_from_a_whole_checkpoint(toy_data, tmp_path, kill):
    """Killed at several points of the saves (inside the copy to checkpoint_last/best, inside the write of the
    numbered checkpoint), deterministically: the next run resumes from the last save that completed (or from
    the start when none had), and only the updates after it are lost."""
    save = tmp_path / "ckpt"
    res = _train_killed(toy_data, save, 20, kill)
    first = res.stdout + res.stderr
    assert res.returncode == 9, first[-3000:]
    saved = re.findall(r"Saved checkpoint .*? @ (\d+) updates", first)
    last = save / "checkpoint_last.pt"
    assert not last.exists() or cf.readable(str(last))
    out = _train_again(toy_data, save, 20)
    assert "removed 1 temporary file" in out
    if saved:
        assert re.search(rf"Loaded checkpoint .*? @ {saved[-1]} updates", out), out[-3000:]
    else:
        assert "Loaded checkpoint" not in out
    assert re.search(r"num_updates[ =]20\b", out), out[-3000:]
