"""benchmarks/quality.py's run names turned into training flags (the runs themselves need a GPU)."""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import quality  # noqa: E402


def _flags(run):
    args = argparse.Namespace(arch="transformer_wmt_en_de_big_t2t", lr=3e-4, warmup=1000, schedule="linear_decay",
                              max_update=2000, max_tokens=4096, clip_norm=1.0, validate_every=250, cpu_smoke=False)
    kind, prec = run.split("_")
    return quality.train_flags(kind, prec, args, "bin", "save")


def _after(flags, name):
    return flags[flags.index(name) + 1] if name in flags else None


def test_run_names_give_their_flags():
    native, ls = _flags("native_fp16"), _flags("ls_bf16")
    assert _after(native, "--arch") == "transformer_wmt_en_de_big_t2t" and "--fp16" in native
    assert _after(native, "--optimizer") == "adam" and "--fp8" not in native
    assert _after(ls, "--arch") == "ls_transformer_wmt_en_de_big_t2t" and "--bf16" in ls
    assert _after(ls, "--optimizer") == "ls_adam" and "--fp8" not in ls
    fp8 = _flags("ls-fp8_bf16")
    assert "--fp8" in fp8 and "--fp8-projections" not in fp8 and "--fp8-grad-format" not in fp8
    every = _flags("ls-fp8-e4m3-all_bf16")
    assert "--fp8" in every and _after(every, "--fp8-grad-format") == "e4m3"
    assert _after(every, "--fp8-projections") == "all"
    # the schedule decays linearly to 0 at --max-update
    assert _after(ls, "--lr-scheduler") == "polynomial_decay" and _after(ls, "--total-num-update") == "2000"


def test_unknown_fp8_option_is_refused():
    with pytest.raises(SystemExit, match="unknown ls-fp8 option 'e3m4'"):
        _flags("ls-fp8-e3m4_bf16")
