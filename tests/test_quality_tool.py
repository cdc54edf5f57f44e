"""benchmarks/quality.py: run names turned into training flags (the runs themselves need a GPU); the decode mode's
parsing, comparisons and bad-flag errors, and its CPU smoke run end to end."""

import argparse
import json
import os
import subprocess
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


# ----- quality.py decode: native fairseq-generate vs lightseq-generate vs fairseq-generate --user-dir -----

_A, _B = "sona vabotua nu fubafe gi tasaak", "medozu gi sona dogipia nu monaek"
_LOG = f"""INFO:fairseq_cli.generate:loading
S-1\tthe cat
T-1\t{_A}
H-1\t-0.5\t{_A}
D-1\t-0.5\t{_A}
H-1\t-0.9\t{_A}x
S-0\ta dog
T-0\t{_B}
H-0\t-0.3\t{_B}
INFO:fairseq_cli.generate:Translated 1,200 sentences (31,415 tokens) in 2.0s (600.00 sentences/s, 15707.50 tokens/s)
"""


def test_decode_parses_fairseq_generate_output():
    res = quality.parse_generation(_LOG, "gen.log")
    assert res["hyps"] == {1: _A, 0: _B}  # the best hypothesis of each sentence
    assert res["refs"] == {1: _A, 0: _B}
    assert (res["sentences"], res["tokens"], res["sentences_per_s"]) == (1200, 31415, 600.0)
    assert res["seconds"] == pytest.approx(2.0)
    with pytest.raises(SystemExit, match="no 'Translated N sentences' line"):
        quality.parse_generation("H-0\t-1\tx\n", "gen.log")


def test_decode_compares_against_native():
    base = quality.parse_generation(_LOG, "a")
    other = dict(base, hyps={0: _B, 1: "gi gi"}, seconds=1.0)
    cmp = quality.compare(other, base)
    assert cmp["identical_share"] == 0.5 and cmp["speed_vs_native"] == pytest.approx(2.0)
    assert cmp["bleu_vs_native"] < 100 and quality.compare(base, base)["bleu_vs_native"] == pytest.approx(100)
    missing = quality.compare(dict(base, hyps={0: _B}), base)
    assert missing["identical_share"] == 0.5 and missing["hypotheses"] == 1


@pytest.mark.parametrize("argv, message", [
    (["--data", "bin"], "give --data and --checkpoint together"),
    (["--cpu", "--precision", "fp16"], "--precision fp16: fairseq-generate decodes in fp32 on the CPU"),
    (["--precision", "fp8"], "unknown precision 'fp8'"),
    (["--beam", "0"], "numbers >= 1"),
])
def test_decode_refuses_bad_flags(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit):
        quality.decode_main(["--out", str(tmp_path)] + argv)
    assert message in capsys.readouterr().err


def test_decode_refuses_a_checkpoint_that_is_not_one(tmp_path):
    bad = tmp_path / "ckpt.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match=f"--checkpoint {bad}: cannot be read as a checkpoint"):
        quality.decode_main(["--out", str(tmp_path), "--data", str(tmp_path), "--checkpoint", str(bad)])


def test_decode_cpu_smoke(tmp_path):
    """The whole pipeline on the CPU: train, convert, three runs at beam 4 and 1. In fp32 on the CPU the ls
    kernels' reference path computes what fairseq computes, so the hypotheses agree sentence by sentence."""
    out = tmp_path / "d"
    proc = subprocess.run([sys.executable, os.path.join(quality.HERE, "quality.py"), "decode", "--out", str(out),
                           "--cpu-smoke"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| identical to native |" in proc.stdout
    result = json.load(open(out / "decode.json"))
    rows = result["rows"]
    configs = sorted({(r["precision"], r["beam"], r["batching"]) for r in rows})
    assert configs == [("fp32", 1, "--batch-size 16"), ("fp32", 4, "--batch-size 16")]
    for config in configs:
        runs = {r["run"]: r for r in rows if (r["precision"], r["beam"], r["batching"]) == config}
        assert sorted(runs) == sorted(quality.GEN_RUNS)
        assert {r["hypotheses"] for r in runs.values()} == {48} and {r["sentences"] for r in runs.values()} == {48}
        assert runs["native"]["identical_share"] == 1.0
        for run in ("ls", "user_dir"):
            assert runs[run]["identical_share"] >= 0.97, (config, run, runs[run])
            assert runs[run]["seconds"] > 0 and runs[run]["speed_vs_native"] > 0
            assert runs[run]["bleu_vs_reference"] is not None
    # the agreement means something only if the model says different things for different sentences
    with open(out / "decode_logs" / "fp32_beam4_batch-size16_native_0.log") as f:
        hyps = quality.parse_generation(f.read(), "log")["hyps"]
    assert len(set(hyps.values())) >= 10, hyps
    # the ls weights are a lightseq-convert twin of the trained native checkpoint
    assert result["weights"]["native"].endswith("checkpoint_last.pt") and result["weights"]["ls"].endswith(".pt")
