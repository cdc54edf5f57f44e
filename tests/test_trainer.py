"""LSTrainer (lightseq-train's Trainer) and lightseq-train's process-group teardown, on the CPU."""

import os

import pytest
import torch
from fairseq import metrics

from ls_fairseq.cli import train as ls_train
from ls_fairseq.fairseq_ext.trainer import DeferredLoggingOutput, LSTrainer


def test_deferred_logging_output_equals_fairseqs_dictionary():
    with metrics.aggregate() as agg:
        metrics.log_scalar("loss", torch.tensor(2.5), 4, round=3)
        metrics.log_scalar("nll_loss", torch.tensor(1.25), 4, round=3)
        metrics.log_derived("ppl", lambda m: 2 ** m["nll_loss"].avg)
    out = DeferredLoggingOutput(agg, 17)
    assert out._values is None  # nothing read back yet
    want = agg.get_smoothed_values()
    want["sample_size"] = 17
    del want["ppl"]  # fairseq drops it from the step's dictionary
    assert dict(out) == want
    assert out["loss"] == 2.5 and "ppl" not in out and len(out) == len(want)
    assert out is not None


def test_lightseq_train_uses_ls_trainer_unless_asked_not_to(monkeypatch):
    class FakeModule:
        Trainer = object

    mod = FakeModule()
    monkeypatch.delenv("LS_FAIRSEQ_PLAIN_TRAINER", raising=False)
    assert ls_train.use_ls_trainer(mod) and mod.Trainer is LSTrainer
    mod.Trainer = object
    monkeypatch.setenv("LS_FAIRSEQ_PLAIN_TRAINER", "1")
    assert not ls_train.use_ls_trainer(mod) and mod.Trainer is object


def test_process_group_is_destroyed_after_training(tmp_path):
    import torch.distributed as dist

    assert not ls_train.destroy_process_group()  # nothing to do
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp_path, 'store')}", rank=0, world_size=1)
    assert dist.is_initialized()
    assert ls_train.destroy_process_group()
    assert not dist.is_initialized()
