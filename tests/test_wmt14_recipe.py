"""The WMT14 en-de recipe (scripts/*_wmt14_en_de.sh) end to end on a tiny offline sample, plus its
python helpers (averaging, compound splitting, cleaning, scoring)."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"wmt14_{name}", os.path.join(SCRIPTS, "wmt14", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


avg = _load("average_checkpoints")
score = _load("score")
text = _load("text")
sample = _load("make_sample_raw")


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _fake_ckpt(path, scale, step):
    model = {
        "w": torch.full((3, 5), float(scale), dtype=torch.float32),
        "h": torch.full((2,), float(scale), dtype=torch.float16),
        "version": torch.tensor([3]),
    }
    torch.save({"model": model, "cfg": {"model": {"_name": "x"}}, "optimizer_history": [{"step": step}],
                "last_optimizer_state": {"big": 1}, "extra_state": {"epoch": step}}, path)


def test_average_checkpoints_is_the_mean(tmp_path):
    for i, s in enumerate([1.0, 2.0, 6.0], start=1):
        _fake_ckpt(tmp_path / f"checkpoint{i}.pt", s, i)
    _fake_ckpt(tmp_path / "checkpoint_best.pt", 100.0, 9)  # not an epoch checkpoint: must be ignored
    paths = avg.last_checkpoints(str(tmp_path), 2)
    assert [os.path.basename(p) for p in paths] == ["checkpoint3.pt", "checkpoint2.pt"]
    out = avg.average_checkpoints(paths)
    assert torch.allclose(out["model"]["w"], torch.full((3, 5), 4.0))
    assert out["model"]["h"].dtype == torch.float16 and float(out["model"]["h"][0]) == 4.0
    assert torch.equal(out["model"]["version"], torch.tensor([3]))
    assert out["last_optimizer_state"] is None and out["extra_state"] == {"epoch": 3}
    out3 = avg.average_checkpoints(avg.last_checkpoints(str(tmp_path), 3))
    assert torch.allclose(out3["model"]["w"], torch.full((3, 5), 3.0))
    with pytest.raises(ValueError, match="only 3"):
        avg.last_checkpoints(str(tmp_path), 4)


def test_average_checkpoints_rejects_mismatch(tmp_path):
    _fake_ckpt(tmp_path / "a.pt", 1.0, 1)
    torch.save({"model": {"w": torch.zeros(3, 4), "h": torch.zeros(2, dtype=torch.float16),
                          "version": torch.tensor([3])}}, tmp_path / "b.pt")
    with pytest.raises(ValueError, match="shape"):
        avg.average_checkpoints([str(tmp_path / "a.pt"), str(tmp_path / "b.pt")])


def test_compound_split():
    assert score.compound_split("Welt @-@ Klasse") == "Welt ##AT##-##AT## Klasse"
    assert score.compound_split("E-Mail-Adresse") == "E ##AT##-##AT## Mail ##AT##-##AT## Adresse"
    assert score.compound_split("a - b") == "a - b"


def test_clean_corpus(tmp_path):
    src = ["a b c", "", "a " * 300, "a", "a b c d e f g"]
    tgt = ["x y", "x", "x", "x y z", "x y z w v u t"]
    (tmp_path / "c.en").write_text("\n".join(src) + "\n")
    (tmp_path / "c.de").write_text("\n".join(tgt) + "\n")
    kept, total = text.clean_corpus(str(tmp_path / "c"), "en", "de", str(tmp_path / "o"), 1, 250, 1.5)
    assert (kept, total) == (2, 5)
    assert (tmp_path / "o.en").read_text().splitlines() == ["a b c", "a b c d e f g"]


def test_score_reads_generate_output(tmp_path):
    gen = tmp_path / "gen.out"
    gen.write_text("S-1\tb\nT-1\tdas ist gut .\nH-1\t-0.1\tdas ist gut .\n"
                   "S-0\ta\nT-0\tWelt @-@ Klasse !\nH-0\t-0.2\tWelt @-@ Klasse !\n")
    pairs = score.read_generate_output(str(gen))
    assert list(pairs) == [0, 1]
    assert score.tokenized_bleu(pairs).score == pytest.approx(100.0)
    raw = tmp_path / "raw.de"
    raw.write_text("Welt-Klasse!\ndas ist gut.\n")
    assert score.detok_bleu(pairs, str(raw), "de").score == pytest.approx(100.0)
    raw.write_text("nur eine Zeile\n")
    with pytest.raises(ValueError, match="generated sentences"):
        score.detok_bleu(pairs, str(raw), "de")


def test_prepare_reports_incomplete_raw_dir(tmp_path):
    (tmp_path / "raw").mkdir()
    res = subprocess.run(["bash", os.path.join(SCRIPTS, "prepare_wmt14_en_de.sh"), "--raw-dir", "raw",
                          "--work-dir", "work"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "neither the extracted files nor training-parallel-europarl-v7.tgz" in res.stderr
    assert not list((tmp_path / "raw").iterdir())  # the raw folder is never written to


# ---------------------------------------------------------------------------------------------
# the whole recipe, offline
# ---------------------------------------------------------------------------------------------


def _stack():
    """The plugin's names when the plugin is importable and installed; fairseq's native ones otherwise."""
    try:
        import ls_fairseq.fairseq_ext  # noqa: F401
        ls_ok = shutil.which("lightseq-train") is not None and shutil.which("lightseq-generate") is not None
    except Exception:  # noqa: BLE001
        ls_ok = False
    if ls_ok:
        return dict(TRAIN_CMD="lightseq-train", GENERATE_CMD="lightseq-generate", ARCH="ls_transformer_tiny",
                    OPTIMIZER="ls_adam", CRITERION="ls_label_smoothed_cross_entropy")
    return dict(TRAIN_CMD="fairseq-train", GENERATE_CMD="fairseq-generate", ARCH="transformer_tiny",
                OPTIMIZER="adam", CRITERION="label_smoothed_cross_entropy", TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")


def _run(cmd, env, cwd):
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}")
    return res.stdout + res.stderr


@pytest.mark.slow
def test_recipe_offline_end_to_end(tmp_path):
    for tool in ("fairseq-preprocess", "subword-nmt"):
        assert shutil.which(tool), f"{tool} must be installed for the recipe"
    stack = _stack()
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", **stack)
    sample.make_sample(str(tmp_path / "raw"), pairs=450, seed=3)

    out = _run(["bash", os.path.join(SCRIPTS, "prepare_wmt14_en_de.sh"), "--raw-dir", "raw", "--work-dir", "work",
                "--dest-dir", "bin", "--bpe-size", "150", "--workers", "2"], env, tmp_path)
    for f in ("dict.en.txt", "dict.de.txt", "train.en-de.en.bin", "valid.en-de.de.idx", "test.en-de.en.bin",
              "code", "test.raw.de"):
        assert (tmp_path / "bin" / f).is_file(), f
    assert (tmp_path / "bin" / "dict.en.txt").read_text() == (tmp_path / "bin" / "dict.de.txt").read_text()
    assert "@@" in (tmp_path / "work" / "train.en").read_text()  # BPE was applied
    assert "Welt @-@ Klasse" in (tmp_path / "work" / "train.de").read_text()  # Moses -a tokenisation

    # the recipe's command line, as the user runs it, is printed by --dry-run
    dry = _run(["bash", os.path.join(SCRIPTS, "train_wmt14_en_de.sh"), "--data", "bin", "--bf16", "--gpus", "2",
                "--dry-run"], env, tmp_path)
    for flag in ("--share-all-embeddings", "--bf16", "--distributed-world-size 2", "--lr-scheduler inverse_sqrt",
                 "--warmup-updates 4000", "--label-smoothing 0.1", "--max-tokens 8192"):
        assert flag in dry, flag

    out = _run(["bash", os.path.join(SCRIPTS, "train_wmt14_en_de.sh"), "--data", "bin", "--save-dir", "ckpt",
                "--fp32", "--arch", stack["ARCH"], "--max-update", "24", "--max-tokens", "1024", "--",
                "--warmup-updates", "8", "--lr", "3e-3", "--no-progress-bar", "--log-interval", "4",
                "--max-epoch", "100", "--num-workers", "0", "--no-epoch-checkpoints", "--save-interval-updates", "8",
                "--validate-interval-updates", "8"], env, tmp_path)
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines() if "| valid on" in line]
    assert len(losses) >= 3 and all(x == x for x in losses) and losses[-1] < losses[0], losses
    ckpts = sorted(p.name for p in (tmp_path / "ckpt").glob("checkpoint_*_*.pt"))
    assert len(ckpts) >= 3, ckpts

    out = _run(["bash", os.path.join(SCRIPTS, "eval_wmt14_en_de.sh"), "--data", "bin", "--save-dir", "ckpt",
                "--average-updates", "3", "--max-tokens", "2000", "--", "--cpu", "--num-workers", "0"], env, tmp_path)
    assert "averaging 3 checkpoints" in out
    assert "tokenized BLEU (compound split) =" in out and "detokenized sacreBLEU =" in out
    result = json.loads((tmp_path / "ckpt" / "eval" / "bleu.test.json").read_text())
    n_test = len((tmp_path / "bin" / "test.raw.de").read_text().splitlines())
    assert result["sentences"] == n_test
    assert 0.0 <= result["tokenized_bleu"] <= 100.0 and 0.0 <= result["sacrebleu"] <= 100.0
    print(f"\nWMT14 recipe on the sample ({stack['ARCH']}): {result}")
