"""lightseq-deepspeed on CPU (gloo, one process): config rules, the same gradients as lightseq-train,
and the real `deepspeed` launcher training, resuming and writing checkpoints that generate."""

import importlib.util
import os
import re
import shutil
import sys

import pytest

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

from omegaconf import OmegaConf  # noqa: E402

from ls_fairseq.cli import deepspeed_train  # noqa: E402
from tests._models import (fairseq_run, free_port, inner_by_update, lightseq_train, preprocess,  # noqa: E402
                           run_checked)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_CONFIG = os.path.join(ROOT, "configs", "deepspeed", "ds_cpu_fp32.json")


def _sample_module():
    path = os.path.join(ROOT, "scripts", "wmt14", "make_sample_raw.py")
    spec = importlib.util.spec_from_file_location("make_sample_raw", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def data_bin(tmp_path_factory):
    """A tiny word-level en-de corpus, binarised with a joined dictionary."""
    import random

    sample = _sample_module()
    root = tmp_path_factory.mktemp("ds_data")
    rng = random.Random(7)
    for split, n in (("train", 400), ("valid", 40), ("test", 20)):
        pairs = [sample.sentence_pair(rng) for _ in range(n)]
        (root / f"{split}.en").write_text("".join(e + "\n" for e, _ in pairs))
        (root / f"{split}.de").write_text("".join(d + "\n" for _, d in pairs))
    return preprocess(root, root / "bin", src="en", tgt="de")


def _env():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return env


def _run(cmd, cwd, env=None):
    return run_checked(cmd, cwd, env or _env(), timeout=400)


def _train_args(data, save_dir, max_update, extra=()):
    return [data, "--arch", "ls_transformer_tiny", "--share-all-embeddings",
            "--criterion", "ls_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
            "--lr", "3e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4", "--max-tokens", "1024",
            "--max-update", str(max_update), "--save-dir", save_dir, "--no-progress-bar", "--log-interval", "1",
            "--num-workers", "0", "--seed", "3", *extra]


def _inner(out, key):
    return [float(x) for x in re.findall(rf"train_inner \|.*?\b{key}=([0-9.e+-]+)", out)]


def _valid_losses(out):
    return [float(x) for x in re.findall(r"valid on 'valid' subset \| loss ([0-9.e+-]+)", out)]


# ---------------------------------------------------------------------------------------------


def _cfg(**opt):
    base = {"optimization": {"update_freq": [3], "clip_norm": 0.0, "lr": [5e-4]},
            "optimizer": {"_name": "adam", "adam_betas": "(0.9, 0.98)", "adam_eps": 1e-9, "weight_decay": 0.01}}
    base["optimization"].update(opt)
    return OmegaConf.create(base)


def test_config_filled_from_fairseq_flags(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 64, "zero_optimization": {"stage": 1}}')
    ds = deepspeed_train.load_ds_config(str(path), _cfg(clip_norm=0.5))
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_micro_batch_size_per_gpu"] == 1
    assert "train_batch_size" not in ds and ds["gradient_clipping"] == 0.5
    params = ds["optimizer"]["params"]
    assert ds["optimizer"]["type"] == "Adam" and params["betas"] == [0.9, 0.98]
    assert params["eps"] == 1e-9 and params["weight_decay"] == 0.01 and params["lr"] == 5e-4
    # a JSON optimizer and clipping win over the flags
    path.write_text('{"optimizer": {"type": "Adam", "params": {"lr": 1.0}}, "gradient_clipping": 2.0}')
    ds = deepspeed_train.load_ds_config(str(path), _cfg(clip_norm=0.5))
    assert ds["optimizer"]["params"] == {"lr": 1.0} and ds["gradient_clipping"] == 2.0


@pytest.mark.parametrize("body,msg", [
    ('{"scheduler": {"type": "WarmupLR"}}', "scheduler"),
    ('{"zero_optimization": {"stage": 3}}', "stage 3"),
    ('{"fp16": {"enabled": true}, "bf16": {"enabled": true}}', "both fp16 and bf16"),
    ("{not json", "not valid JSON"),
])
def test_config_errors(tmp_path, body, msg):
    path = tmp_path / "ds.json"
    path.write_text(body)
    with pytest.raises(SystemExit, match=msg):
        deepspeed_train.load_ds_config(str(path), _cfg())
    with pytest.raises(SystemExit, match="not found"):
        deepspeed_train.load_ds_config(str(tmp_path / "missing.json"), _cfg())


def test_shipped_configs_are_valid():
    for name in ("ds_fp16_zero0.json", "ds_bf16_zero1.json", "ds_fp16_zero2.json", "ds_cpu_fp32.json"):
        ds = deepspeed_train.load_ds_config(os.path.join(ROOT, "configs", "deepspeed", name), _cfg())
        assert ds["optimizer"]["type"] == "Adam" and ds["zero_optimization"]["stage"] <= 2, name


def test_precision_flags_rejected():
    with pytest.raises(SystemExit, match="--fp16 is not used here"):
        deepspeed_train.parse(["data", "--arch", "ls_transformer_tiny", "--fp16", "--deepspeed_config", CPU_CONFIG])


@pytest.mark.slow
def test_same_updates_as_lightseq_train(data_bin, tmp_path):
    """Without dropout, the first updates' loss and gradient norm equal lightseq-train's: the loss is
    normalised over the whole update (--update-freq 2) exactly as fairseq does. --no-save writes nothing."""
    extra = ["--dropout", "0", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--update-freq", "2"]
    ds = _run([sys.executable, "-m", "ls_fairseq.cli.deepspeed_train",
               *_train_args(data_bin, str(tmp_path / "ds"), 3, extra), "--deepspeed_config", CPU_CONFIG,
               "--no-save"], tmp_path)
    assert not (tmp_path / "ds").exists() or not any((tmp_path / "ds").iterdir())
    # lightseq-train in this process (on the CPU, as the DeepSpeed run), its records as the log prints them
    records = inner_by_update(lightseq_train([*_train_args(data_bin, str(tmp_path / "fs"), 3, extra), "--cpu",
                                              "--log-format", "json"]))
    fs = {key: [float(records[u][key]) for u in sorted(records)] for key in ("loss", "gnorm", "lr")}
    assert len(_inner(ds, "loss")) == 3 and len(fs["loss"]) == 3
    for key in ("loss", "gnorm"):
        a, b = _inner(ds, key)[:2], fs[key][:2]
        assert a == pytest.approx(b, rel=2e-3), (key, a, b)
    assert _inner(ds, "lr") == pytest.approx(fs["lr"])


@pytest.mark.slow
def test_launcher_trains_resumes_and_generates(data_bin, tmp_path):
    assert shutil.which("deepspeed"), "the deepspeed launcher must be on PATH"
    save = str(tmp_path / "ckpt")
    launch = ["deepspeed", "--num_gpus", "1", "--master_port", str(free_port()), "--module",
              "ls_fairseq.cli.deepspeed_train"]
    out = _run([*launch, *_train_args(data_bin, save, 8), "--deepspeed_config", CPU_CONFIG], tmp_path)
    assert "DeepSpeed engine on cpu" in out and "ZeRO stage 0" in out
    losses = _inner(out, "loss")
    assert len(losses) == 8 and all(x == x and x < 1e4 for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses
    first_valid = _valid_losses(out)
    for name in ("checkpoint_last.pt", "checkpoint_best.pt", "checkpoint1.pt", "deepspeed/latest"):
        assert os.path.isfile(os.path.join(save, name)), name

    out = _run([*launch, *_train_args(data_bin, save, 14), "--deepspeed_config", CPU_CONFIG], tmp_path)
    assert re.search(r"resumed from .*: epoch \d+, 8 updates", out), out[-3000:]
    updates = [int(x) for x in re.findall(r"train_inner \|.*?num_updates=(\d+)", out)]
    assert updates == list(range(9, 15)), updates
    valid = _valid_losses(out)
    assert valid and valid[-1] < first_valid[0], (first_valid, valid)

    import torch

    state = torch.load(os.path.join(save, "checkpoint_best.pt"), map_location="cpu", weights_only=False)
    assert state["cfg"]["model"].arch == "ls_transformer_tiny"  # fairseq keeps the model cfg as a Namespace
    assert state["optimizer_history"][-1]["num_updates"] == 14

    # lightseq-generate in this process; no data-loading worker (torch waits seconds for one to end)
    from ls_fairseq.cli import generate

    with fairseq_run():
        generate.cli_main([data_bin, "--path", os.path.join(save, "checkpoint_best.pt"), "--beam", "4",
                           "--max-tokens", "2000", "--num-workers", "0", "--cpu", "--results-path",
                           str(tmp_path / "gen")])
    gen = (tmp_path / "gen" / "generate-test.txt").read_text()
    assert sum(line.startswith("H-") for line in gen.splitlines()) == 20 and "BLEU4" in gen
    env = dict(_env(), TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")  # plain fairseq on torch >= 2.6
    gen = _run(["fairseq-generate", data_bin, "--user-dir", os.path.join(ROOT, "user_dir"), "--path",
                os.path.join(save, "checkpoint_last.pt"), "--beam", "4", "--max-tokens", "2000",
                "--required-batch-size-multiple", "1", "--num-workers", "0"], tmp_path, env=env)
    assert "Translated 20 sentences" in gen


@pytest.mark.slow
def test_bf16_zero1_wrapper_optimizer(data_bin, tmp_path):
    """bf16 + ZeRO-1: DeepSpeed wraps the optimizer (not a torch.optim.Optimizer any more); fairseq's
    lr scheduler must still drive its learning rate, and training must still learn."""
    config = tmp_path / "ds_bf16_zero1_cpu.json"
    config.write_text('{"optimizer": {"type": "Adam", "params": {"lr": 1e-9, "betas": [0.9, 0.98], '
                      '"torch_adam": true, "adam_w_mode": false}}, "bf16": {"enabled": true}, '
                      '"zero_optimization": {"stage": 1}}')
    out = _run([sys.executable, "-m", "ls_fairseq.cli.deepspeed_train",
                *_train_args(data_bin, str(tmp_path / "ck"), 8), "--deepspeed_config", str(config)], tmp_path)
    assert "bf16=True, ZeRO stage 1" in out
    losses = _inner(out, "loss")
    assert len(losses) == 8 and all(x == x for x in losses)
    # the JSON's lr (1e-9) would not move the loss: the decrease comes from --lr via the scheduler
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
