"""GEMM tuning's Python side (ls_fairseq/fairseq_ext/gemm_tuning.py) on the CPU: the grid, when it stays off, the
fallbacks, and the choices kept in the cache file and taken from checkpoints (the extension faked; the products
themselves are tested on the GPU in tests/gpu/test_gemm_tuning_gpu.py)."""

import json
import logging
import types

import pytest
import torch

from ls_fairseq.fairseq_ext import gemm_tuning


class FakeExt:
    def __init__(self, version=131000):
        self.version = version
        self.rows = []
        self.enabled = None
        self.measured = 0

    def gemm_tuning_available(self):
        return True

    def gemm_tuning_version(self):
        return self.version

    def gemm_tuning_enable(self, grid, candidates):
        self.enabled = (list(grid), candidates)

    def gemm_tuning_state(self):
        return [list(r) for r in self.rows]

    def gemm_tuning_load(self, rows):
        for r in rows:
            if len(r) != 22:
                raise RuntimeError("gemm_tuning_load: a decision has %d values, expected 22" % len(r))
        self.rows = [list(r) for r in rows]

    def gemm_tuning_report(self):
        return [1.0, float(len(self.rows)), 1.0, 0.5, float(self.measured), 2.0, 1.5]


ROW = [0, 1024, 4096, 0, 1, 15, 15, 15, 0, 0, 0, 0, 4096, 1] + list(range(8))


@pytest.fixture
def fake(monkeypatch, tmp_path):
    ext = FakeExt()
    monkeypatch.setattr(gemm_tuning, "_ext", lambda: ext)
    monkeypatch.setattr(gemm_tuning, "_device_name", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setitem(gemm_tuning.OPTIONS, "on", True)
    monkeypatch.setattr(gemm_tuning, "_active", {"on": False, "from_checkpoint": False, "cache": None})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return ext


def _trainer(cuda=True, max_tokens=4096):
    return types.SimpleNamespace(cuda=cuda, cfg=types.SimpleNamespace(dataset=types.SimpleNamespace(
        max_tokens=max_tokens)))


def test_grid_spans_the_token_counts_up_to_max_tokens():
    assert gemm_tuning.grid(4096) == [832, 1664, 2432, 3264, 4096]
    assert gemm_tuning.grid(8192)[-1] == 8192 and all(g % 64 == 0 for g in gemm_tuning.grid(8192))
    assert gemm_tuning.grid(100) == [64, 128]
    assert gemm_tuning.grid(None)[-1] == 4096


def test_cache_file_is_named_by_gpu_library_and_max_tokens(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    p = gemm_tuning.cache_path([64, 4096], 131000, "NVIDIA H100 80GB HBM3")
    assert p == str(tmp_path / "ls_fairseq" / "gemm-NVIDIA-H100-80GB-HBM3-cublaslt131000-t4096.json")
    assert gemm_tuning.cache_path([8192], 131000, "NVIDIA H200") != gemm_tuning.cache_path([8192], 120000,
                                                                                          "NVIDIA H200")


def test_inactive_products_are_torch_bit_for_bit(monkeypatch):
    monkeypatch.setattr(gemm_tuning, "_active", {"on": False, "from_checkpoint": False, "cache": None})
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert torch.equal(gemm_tuning.mm(a, b), torch.mm(a, b))
    out = torch.ones(8, 4)
    gemm_tuning.mm_into(out, a, b, add=True)
    assert torch.equal(out, torch.ones(8, 4).addmm_(a, b))
    gemm_tuning.mm_into(out, a, b, add=False)
    assert torch.equal(out, torch.mm(a, b))


def test_stays_off_and_says_why(fake, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="fairseq.trainer")
    assert not gemm_tuning.start(_trainer(cuda=False))
    assert "GEMM tuning off (not on a CUDA device)" in caplog.text
    monkeypatch.setitem(gemm_tuning.OPTIONS, "on", False)
    caplog.clear()
    assert not gemm_tuning.start(_trainer())
    assert caplog.text == ""  # off by the flag: nothing to say
    assert fake.enabled is None


def test_choices_go_to_the_cache_file_and_come_back(fake, caplog):
    caplog.set_level(logging.INFO, logger="fairseq.trainer")
    assert gemm_tuning.start(_trainer())
    assert fake.enabled == ([832, 1664, 2432, 3264, 4096], gemm_tuning.CANDIDATES)
    path = gemm_tuning._active["cache"]
    assert "kept in" in caplog.text
    fake.rows, fake.measured = [ROW], 5
    last = gemm_tuning.report(None)
    assert json.load(open(path)) == {"cublaslt": 131000, "device": "NVIDIA H100 80GB HBM3", "rows": [ROW]}
    assert "1 classes of product measured at 5 points" in caplog.text
    caplog.clear()
    gemm_tuning.report(last)  # nothing new: nothing logged
    assert caplog.text == ""
    # the next run loads them before it measures anything
    fake2 = FakeExt()
    gemm_tuning._ext = lambda: fake2  # (undone by monkeypatch's fixture teardown of the attribute)
    gemm_tuning._active.update(on=False, from_checkpoint=False, cache=None)
    assert gemm_tuning.start(_trainer())
    assert fake2.rows == [ROW] and "1 choices loaded from" in caplog.text


def test_other_gpu_or_library_or_bad_file_is_measured_afresh(fake, caplog, tmp_path):
    caplog.set_level(logging.INFO, logger="fairseq.trainer")
    saved = {"cublaslt": 120000, "device": "NVIDIA H100 80GB HBM3", "rows": [ROW]}
    assert not gemm_tuning.load(saved)
    assert "measured afresh" in caplog.text and fake.rows == []
    assert not gemm_tuning.load({"cublaslt": 131000, "device": "NVIDIA H100 80GB HBM3", "rows": [[1, 2]]})
    assert "not usable" in caplog.text
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert gemm_tuning._read(str(bad)) is None
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    gemm_tuning._write(str(blocker / "sub" / "x.json"), {"rows": [ROW]})  # a file where a folder should be
    assert "could not keep the choices" in caplog.text


def test_checkpoint_choices_win_over_the_cache_file(fake, caplog):
    caplog.set_level(logging.INFO, logger="fairseq.trainer")
    other = list(ROW)
    other[13] = 0
    path = gemm_tuning.cache_path(gemm_tuning.grid(4096), 131000, "NVIDIA H100 80GB HBM3")
    gemm_tuning._write(path, {"cublaslt": 131000, "device": "NVIDIA H100 80GB HBM3", "rows": [other]})
    assert gemm_tuning.load({"cublaslt": 131000, "device": "NVIDIA H100 80GB HBM3", "rows": [ROW]})
    assert gemm_tuning.start(_trainer())
    assert fake.rows == [ROW]
    assert "1 choices taken from the checkpoint" in caplog.text and "the checkpoint's choices" in caplog.text
