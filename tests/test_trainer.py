"""LSTrainer (lightseq-train's Trainer) and lightseq-train's process-group teardown, on the CPU."""

import os
from types import SimpleNamespace

import pytest
import torch
from fairseq import metrics

from ls_fairseq.cli import train as ls_train
from ls_fairseq.fairseq_ext.step.sample_prep import SamplePrep
from ls_fairseq.fairseq_ext.step.step_stats import DeferredLoggingOutput
from ls_fairseq.fairseq_ext.step.trainer import LSTrainer


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


def test_the_training_loop_builds_ls_trainer_for_the_ls_components_only(monkeypatch):
    """takeover.install points a training loop's Trainer at the choice: LSTrainer with the ls model, ls_adam and
    the ls criterion (lightseq-train: always), fairseq's Trainer without them or with --ls-trainer off."""
    from fairseq import trainer as fairseq_trainer
    from omegaconf import OmegaConf

    from _models import build_model, make_dict
    from ls_fairseq.fairseq_ext.criterion import LSLabelSmoothedCrossEntropyCriterion
    from ls_fairseq.fairseq_ext.step import run_checks, takeover
    from ls_fairseq.fairseq_ext.step import trainer as ls_trainer

    built = []
    monkeypatch.setattr(fairseq_trainer, "Trainer", lambda *a: built.append("fairseq") or "F")
    monkeypatch.setattr(ls_trainer, "LSTrainer", lambda *a: built.append("ls") or "L")
    monkeypatch.setattr(run_checks, "prepare_checkpoints", lambda *a, **k: built.append("checkpoints"))
    monkeypatch.setattr(run_checks, "check_data", lambda *a, **k: built.append("data"))

    class Loop:
        Trainer = object

    assert takeover.install(Loop, prepare=lambda: built.append("patches")) and Loop.Trainer is not object
    d = make_dict(20)
    model = build_model("ls_transformer_tiny", d)
    crit = LSLabelSmoothedCrossEntropyCriterion(SimpleNamespace(target_dictionary=d, source_dictionary=d), False, 0.1)

    def cfg(optimizer="ls_adam", ls_trainer="auto"):
        return OmegaConf.create({
            "common": {"fp16": False, "bf16": True, "tpu": True, "memory_efficient_fp16": False,
                       "memory_efficient_bf16": False},
            "optimizer": {"_name": optimizer, "ls_trainer": ls_trainer},
            "dataset": {"grouped_shuffling": False, "update_epoch_batch_itr": False},
            "distributed_training": {"distributed_world_size": 1, "distributed_rank": 0, "ddp_backend": "pytorch_ddp",
                                     "bucket_cap_mb": 25},
        })

    c = cfg()
    assert Loop.Trainer(c, "task", model, crit) == "L"
    assert built == ["patches", "checkpoints", "data", "ls"]
    assert c.common.tpu is False and c.common.memory_efficient_bf16 is True  # bf16 on the GPU, ls_adam's masters
    built.clear()
    c = cfg(optimizer="adam")
    assert Loop.Trainer(c, "task", model, crit) == "F" and built == ["fairseq"]
    assert c.common.tpu is True  # a run without the ls components: fairseq's, unchanged
    built.clear()
    assert Loop.Trainer(cfg(), "task", torch.nn.Linear(2, 2), crit) == "F" and built == ["fairseq"]
    built.clear()
    assert Loop.Trainer(cfg(ls_trainer="off"), "task", model, crit) == "F" and built == ["fairseq"]
    built.clear()
    assert takeover.install(Loop, always=True)
    assert Loop.Trainer(cfg(optimizer="adam"), "task", model, crit) == "L"
    assert takeover.install(Loop) and Loop.Trainer.ls_fairseq_always  # lightseq-train's choice stays


def test_process_group_is_destroyed_after_training(tmp_path):
    import torch.distributed as dist

    from fairseq.distributed import utils as distributed_utils

    assert not ls_train.destroy_process_group()  # nothing to do
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp_path, 'store')}", rank=0, world_size=1)
    assert dist.is_initialized()
    distributed_utils.get_global_group()  # fairseq's training makes this group and keeps it on the function
    assert hasattr(distributed_utils.get_global_group, "_global_group")
    assert ls_train.destroy_process_group()
    assert not dist.is_initialized()
    # not kept alive until the interpreter shuts down (and a stale group for the next init)
    assert not hasattr(distributed_utils.get_global_group, "_global_group")


def test_training_mode_walk_is_skipped_only_while_the_roots_stay_in_training(monkeypatch):
    """fairseq's train_step calls model.train() / criterion.train() every step; LSTrainer lets that
    walk happen once, skips it while both roots report training mode, and walks again after
    anything (validation) put the model into evaluation mode through its root."""
    import torch.nn as nn
    from fairseq.trainer import Trainer

    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Sequential(nn.Dropout(0.1), nn.Linear(3, 2)))
    criterion = nn.Module()
    walks = []
    real_train = nn.Module.train

    def counting_train(self, mode=True):
        walks.append(type(self).__name__)
        return real_train(self, mode)

    def fake_train_step(self, samples, raise_oom=False):  # what fairseq does first in its train_step
        self.model.train()
        self.criterion.train()
        return all(m.training for m in self.model.modules()) and self.criterion.training

    monkeypatch.setattr(nn.Module, "train", counting_train)
    monkeypatch.setattr(Trainer, "train_step", fake_train_step)
    monkeypatch.setattr(LSTrainer, "_step_for", lambda self, optimizer: None)  # fairseq's step body
    trainer = LSTrainer.__new__(LSTrainer)
    trainer._wrapped_model, trainer._wrapped_criterion, trainer._optimizer = model, criterion, "optimizer"
    trainer.in_step, trainer.train_mode_set = False, False
    trainer.graph_setup = SimpleNamespace(join_prewarm=lambda: None)
    trainer.pending = SimpleNamespace(settle=lambda: None)
    model.eval()

    assert trainer.train_step([]) and walks  # first step: the full walk
    walks.clear()
    assert trainer.train_step([]) and trainer.train_step([])
    assert walks == []  # skipped while the roots stay in training mode
    assert "train" not in model.__dict__ and "train" not in criterion.__dict__
    model.eval()  # e.g. validation
    assert not any(m.training for m in model.modules())
    assert trainer.train_step([]) and walks  # walked again: every module back in training mode


def test_counted_rows_found_on_the_host_for_ls_models_only():
    from types import SimpleNamespace

    import torch.nn as nn
    from _models import build_model, make_dict, random_batch

    from ls_fairseq.fairseq_ext.criterion import LSLabelSmoothedCrossEntropyCriterion

    d = make_dict(20)
    _, _, _, tgt = random_batch(d)
    task = SimpleNamespace(target_dictionary=d, source_dictionary=d)
    crit = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    prep = SamplePrep(build_model("ls_transformer_tiny", d), crit, d.pad())
    rows = prep.counted_rows({"target": tgt})
    assert torch.equal(rows, tgt.reshape(-1).ne(d.pad()).nonzero().squeeze(1))
    assert prep.counted_rows({"net_input": {}}) is None  # no target
    prep = SamplePrep(nn.Linear(2, 2), crit, d.pad())  # not an ls_transformer: its forward takes no logit_rows
    assert prep.counted_rows({"target": tgt}) is None


def test_per_update_seed_leaves_fairseqs_generator_state(monkeypatch):
    """LSTrainer._set_seed seeds the generators directly; the CPU generator ends in the state that
    fairseq's utils.set_torch_seed leaves (same draws), and a backend this shortcut does not know
    sends the call to fairseq's own seeding."""
    from fairseq import utils

    from ls_fairseq.fairseq_ext.step import trainer as tr

    for seed in (1, 12345, 2**40 + 7):
        utils.set_torch_seed(seed)
        want, want_draw = torch.get_rng_state(), torch.rand(7)
        torch.manual_seed(999)
        tr.seed_generators(seed)
        assert torch.equal(torch.get_rng_state(), want)
        assert torch.equal(torch.rand(7), want_draw)
    with pytest.raises(TypeError, match="seed must be an int, not float"):
        tr.seed_generators(1.0)

    class _Trainer:  # the two attributes _set_seed reads
        settings = SimpleNamespace(seed=3)

        def get_num_updates(self):
            return 40

    LSTrainer._set_seed(_Trainer())
    got = torch.rand(3)
    torch.manual_seed(43)
    assert torch.equal(got, torch.rand(3))

    calls = []
    monkeypatch.setattr(utils, "set_torch_seed", lambda s: calls.append(s))
    monkeypatch.setattr(tr, "_other_seeded_backends", lambda: True)
    tr.seed_generators(5)
    assert calls == [5]
    monkeypatch.setattr(tr, "_other_seeded_backends", lambda: False)
    tr.seed_generators(6)
    assert calls == [5]


def test_step_labels_reach_a_running_profiler_only():
    from torch.profiler import ProfilerActivity, profile

    from ls_fairseq.fairseq_ext.step.deferred_step import _label

    assert not torch.autograd._profiler_enabled()
    with _label("optimizer") as got:
        assert got is None  # nothing recorded, nothing to record into
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        with _label("optimizer"):
            torch.ones(3).sum()
    assert [e.name for e in prof.events()].count("optimizer") == 1


def test_step_timing_summary_takes_medians_after_the_warm_up():
    from ls_fairseq.fairseq_ext.step.step_timing import step_timing_summary

    assert step_timing_summary([], [], [], []) is None
    # 8 updates of two micro-batches; the first two (a quarter) are slow warm-up updates
    micro = [[90.0, 80.0], [70.0, 60.0]] + [[10.0, 12.0]] * 5 + [[11.0, 30.0]]
    updates = [200.0, 150.0] + [25.0] * 5 + [45.0]
    tails = [20.0, 20.0] + [3.0] * 6
    gaps = [None, 50.0] + [0.5] * 5 + [4.5]
    line = step_timing_summary(micro, updates, tails, gaps)
    assert line.startswith("step timing: 8 updates, medians over the last 6: update 25.00 ms (mean 28.33)")
    assert "micro-batch fwd+bwd 11.50 ms" in line  # median of 10, 12 (five times each), 11 and 30
    assert "after the last backward 3.00 ms" in line
    assert "between updates 0.50 ms (mean 1.17, max 4.50)" in line
    assert "pairs of micro-batches: mean 11.00 ms, slower of the two 12.00 ms, first 10.00 ms, second 12.00 ms" in line
    # one micro-batch per update: no pair figures; a single update is kept whole
    assert "host waits" not in line  # no waits given
    # host waits at the settle: the warm-up quarter dropped, updates settled elsewhere (None) left out
    waits = [30.0, 30.0, None, 0.2, 0.5, 8.0, 9.0, 10.0]
    line = step_timing_summary(micro, updates, tails, gaps, waits=waits)
    assert "host waits at the settle 8.00 ms (tenth percentile 0.20, under 1 ms in 2 of 5)" in line
    line = step_timing_summary([[9.0]], [10.0], [1.0], [None])
    assert "medians over the last 1: update 10.00 ms" in line and "pairs" not in line and "between" not in line


def test_host_sections_summary_gives_medians_after_the_warm_up():
    from ls_fairseq.fairseq_ext.step.step_timing import host_sections_summary

    assert host_sections_summary({}) is None
    sections = {"forward and backward": [50.0, 40.0, 10.0, 12.0, 11.0, 30.0, 10.5, 11.5],
                "optimizer step": [9.0, 9.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0],
                "outside the step": [3.0]}
    line = host_sections_summary(sections)
    assert line == ("host ms per update (medians; forward and backward per micro-batch): forward and backward 11.25, optimizer step 1.00, "
                    "outside the step 3.00")
