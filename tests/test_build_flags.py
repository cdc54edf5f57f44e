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
