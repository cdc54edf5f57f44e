"""The build's own choices (ls_fairseq/_build_flags.py, read by setup.py and the JIT build)."""

import os
import shutil
import stat

import pytest

from ls_fairseq import _build_flags


def test_a_compiler_that_links_libstdcxx_statically_is_replaced(tmp_path, monkeypatch):
    """$CXX that puts a private libstdc++ into shared objects is swapped for one on PATH that does not; a good
    $CXX is kept."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("needs g++")
    static = tmp_path / "static-g++"
    static.write_text(f'#!/bin/sh\nexec {gxx} -static-libstdc++ "$@"\n')
    static.chmod(static.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CXX", str(static))
    env = _build_flags.host_compiler_env()
    assert env.get("CXX") and os.path.realpath(env["CXX"]) != os.path.realpath(str(static))
    assert _build_flags._probe(env["CXX"]) is True
    monkeypatch.setenv("CXX", gxx)
    assert _build_flags.host_compiler_env() == {}


def test_jit_builds_on_first_use_when_asked_and_verbose_shows_the_compiler(tmp_path, monkeypatch):
    """LS_FAIRSEQ_JIT: unset / 0 no JIT build (the reason says how to ask), 1 a quiet one, verbose a verbose
    one, in LS_FAIRSEQ_BUILD_DIR; anything else is refused by name. The build itself is stood in for."""
    import importlib

    import torch
    from torch.utils import cpp_extension

    from ls_fairseq import _ext

    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "the module")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # as a CUDA build of torch
    monkeypatch.setattr(_build_flags, "host_compiler_env", lambda: {})
    real_import = importlib.import_module

    def no_prebuilt(name, *a):
        if name == "ls_fairseq._C":
            raise ImportError("no prebuilt module here")
        return real_import(name, *a)

    monkeypatch.setattr(_ext.importlib, "import_module", no_prebuilt)
    monkeypatch.setenv("LS_FAIRSEQ_BUILD_DIR", str(tmp_path / "jit"))
    for value, verbose in ((None, None), ("0", None), ("1", False), ("verbose", True), ("Verbose", True)):
        if value is None:
            monkeypatch.delenv("LS_FAIRSEQ_JIT", raising=False)
        else:
            monkeypatch.setenv("LS_FAIRSEQ_JIT", value)
        calls.clear()
        module, why, source = _ext._load()
        if verbose is None:
            assert module is None and calls == [] and "set LS_FAIRSEQ_JIT=1 to build it just in time" in why
        else:
            assert (module, why, source) == ("the module", None, "jit")
            assert calls[0]["verbose"] is verbose and calls[0]["build_directory"] == str(tmp_path / "jit")
    monkeypatch.setenv("LS_FAIRSEQ_JIT", "yes")
    with pytest.raises(ValueError, match="LS_FAIRSEQ_JIT='yes': expected 0, 1 or verbose"):
        _ext._load()


def _setup_py(setting):
    """``python setup.py --name`` (setup.py decides on the extension when it is read) with LS_FAIRSEQ_CUDA set
    to ``setting``: (exit status, output)."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, LS_FAIRSEQ_CUDA=setting)
    out = subprocess.run([sys.executable, "setup.py", "--name"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    return out.returncode, out.stdout + out.stderr


def test_cuda_setting_is_checked(monkeypatch):
    monkeypatch.delenv("LS_FAIRSEQ_CUDA", raising=False)
    assert _build_flags.cuda_setting() == "auto"
    for value, want in (("", "auto"), ("AUTO", "auto"), ("0", "0"), (" 1 ", "1")):
        monkeypatch.setenv("LS_FAIRSEQ_CUDA", value)
        assert _build_flags.cuda_setting() == want
    monkeypatch.setenv("LS_FAIRSEQ_CUDA", "yes")
    with pytest.raises(ValueError, match="LS_FAIRSEQ_CUDA='yes': expected auto, 0 or 1"):
        _build_flags.cuda_setting()


def test_setup_py_builds_no_extension_with_0_and_stops_with_1_where_it_cannot():
    """0 installs the pure-Python package; 1 stops with the reason where the extension cannot be built (here: a
    CPU-only torch), and a bad value stops with one line naming the variable."""
    import torch

    code, out = _setup_py("0")
    assert code == 0 and "LS_FAIRSEQ_CUDA=0, installing without the CUDA extension" in out
    code, out = _setup_py("maybe")
    assert code != 0 and "ls_fairseq: LS_FAIRSEQ_CUDA='maybe': expected auto, 0 or 1" in out
    assert "Traceback" not in out
    if torch.version.cuda is None:
        code, out = _setup_py("1")
        assert code != 0 and "LS_FAIRSEQ_CUDA=1, but the CUDA extension cannot be built: torch" in out
        assert "is a CPU-only build" in out and "Traceback" not in out
