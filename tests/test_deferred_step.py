"""LSTrainer's deferred step (no host reads; each update settled during the next one) against
fairseq's own Trainer (--ls-trainer off), through lightseq-train on the CPU.

With dropout 0 the two must log the same numbers at every --log-interval and end with the same
weights, through fp16 overflows, loss-scale changes, gradient clipping and an epoch boundary."""

import copy
import logging
import os

import pytest
import torch

from _models import _Lines
from test_end_to_end import _params, inner_by_update, train

OVERFLOW = "gradient overflow detected"


def _run(data, save, sync, monkeypatch, *flags):
    if sync:
        flags = (*flags, "--ls-trainer", "off")
    lg = logging.getLogger("fairseq.trainer")
    handler, level = _Lines(), lg.level
    lg.addHandler(handler)
    lg.setLevel(logging.INFO)
    try:
        records = inner_by_update(train(data, save, *flags))
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
    return records, handler.lines


def _compare(data, tmp_path, monkeypatch, flags, keys):
    a, lines_a = _run(data, str(tmp_path / "sync"), True, monkeypatch, *flags)
    b, lines_b = _run(data, str(tmp_path / "deferred"), False, monkeypatch, *flags)
    assert not any("deferred step" in x for x in lines_a)  # fairseq's own Trainer
    assert any("deferred step" in x for x in lines_b)
    assert sorted(a) == sorted(b) and a, (sorted(a), sorted(b))
    for u in a:
        for k in keys:
            assert a[u][k] == b[u][k], (u, k, a[u][k], b[u][k])
    pa = _params(os.path.join(tmp_path, "sync", "checkpoint_last.pt"))
    pb = _params(os.path.join(tmp_path, "deferred", "checkpoint_last.pt"))
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], rtol=0, atol=0, msg=k)
    return a, [x for x in lines_a if OVERFLOW in x], [x for x in lines_b if OVERFLOW in x]


@pytest.mark.slow
def test_fp16_deferred_step_matches_fairseqs_step_through_overflows(data_bin, tmp_path, monkeypatch):
    # fairseq's own overflow branch calls .cuda() on a new tensor, which fails on a CPU-only build
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    flags = ["--max-update", "9", "--fp16", "--fp16-init-scale", str(2 ** 22), "--fp16-scale-window", "2",
             "--clip-norm", "0.5", "--dropout", "0", "--log-interval", "3", "--disable-validation"]
    records, over_a, over_b = _compare(data_bin, tmp_path, monkeypatch, flags,
                                       ("loss", "nll_loss", "gnorm", "clip", "loss_scale", "lr", "num_updates"))
    assert sorted(records) == [3, 6, 9]
    assert len(over_a) >= 10 and over_a == over_b  # the scale fell from 2**22 one overflow at a time


@pytest.mark.slow
def test_fp32_deferred_step_with_clipping_and_dropout_matches(data_bin, tmp_path, monkeypatch):
    """No overflow without a loss scaler: the dropout seeds agree too, dropout stays on."""
    flags = ["--max-update", "8", "--clip-norm", "0.1", "--log-interval", "4"]
    records, _, _ = _compare(data_bin, tmp_path, monkeypatch, flags,
                             ("loss", "nll_loss", "gnorm", "clip", "lr", "num_updates"))
    assert sorted(records) == [4, 8]
    assert all(float(r["clip"]) == 100 for r in records.values())  # the clip was active


def _count_steps(monkeypatch, nan_at=None):
    """Record each LSAdam.step's with_norm; ``nan_at``: before that step (1-based) one gradient becomes NaN."""
    from ls_fairseq.optim.adam import LSAdam

    calls, real = [], LSAdam.step

    def step(self, *a, with_norm=False, **k):
        calls.append(with_norm)
        if nan_at is not None and len(calls) == nan_at:
            self.workspaces[0].sync()
            self.workspaces[0].buffers[0].grad.view(-1)[3] = float("nan")
        return real(self, *a, with_norm=with_norm, **k)

    monkeypatch.setattr(LSAdam, "step", step)
    return calls


@pytest.mark.slow
def test_without_clipping_the_norm_is_summed_in_the_update_and_logs_the_same(data_bin, tmp_path, monkeypatch):
    """Without a loss scale and --clip-norm 0 ls_adam sums the gradient norm in its update's pass: the deferred
    step logs the same numbers (gnorm included) and ends with the same weights as fairseq's step body."""
    calls = _count_steps(monkeypatch)
    flags = ["--max-update", "8", "--clip-norm", "0", "--log-interval", "4"]
    records, _, _ = _compare(data_bin, tmp_path, monkeypatch, flags, ("loss", "nll_loss", "gnorm", "lr", "num_updates"))
    assert sorted(records) == [4, 8]
    assert calls == [False] * 8 + [True] * 8  # fairseq's step body first, then the deferred step


@pytest.mark.slow
def test_invertible_layer_norms_keep_the_norm_pass_before_the_update(data_bin, tmp_path, monkeypatch):
    """With --ls-invertible-layernorm the norm is taken before the update, which a non-finite norm then skips: a
    zero layer-norm weight, the cause the error names, stays there to be found."""
    calls = _count_steps(monkeypatch)
    _run(data_bin, str(tmp_path / "d"), False, monkeypatch, "--max-update", "3", "--clip-norm", "0",
         "--ls-invertible-layernorm", "--disable-validation", "--no-save")
    assert calls == [False] * 3


@pytest.mark.slow
def test_a_nonfinite_gradient_summed_in_the_update_stops_training_and_says_so(data_bin, tmp_path, monkeypatch):
    """The update is taken before its norm is known: a NaN gradient stops training with fairseq's error, which
    says that the weights in memory took it."""
    _count_steps(monkeypatch, nan_at=3)
    with pytest.raises(FloatingPointError, match="gradients are Nan/Inf \\(the weights in memory took this update"):
        _run(data_bin, str(tmp_path / "d"), False, monkeypatch, "--max-update", "9", "--clip-norm", "0",
             "--dropout", "0", "--disable-validation")


def test_scale_candidates_follow_fairseqs_loss_scaler():
    from fairseq.optim.dynamic_loss_scaler import DynamicLossScaler

    from ls_fairseq.fairseq_ext.step.deferred_step import scale_candidates

    scaler = DynamicLossScaler(init_scale=64.0, scale_window=3, min_loss_scale=1.0)
    for outcome in ["ok", "ok", "ok", "bad", "ok", "bad", "bad", "ok", "ok", "ok", "ok"]:
        ok, bad = scale_candidates(scaler)
        before = copy.copy(scaler.__dict__)
        if outcome == "ok":
            scaler.update()
            assert scaler.loss_scale == ok
        else:
            with pytest.raises(OverflowError):
                scaler.check_overflow(float("inf"))
            assert scaler.loss_scale == bad
        assert before != scaler.__dict__  # the candidates were computed on copies
    # at the minimum scale fairseq stops training: the candidate keeps the scale
    low = DynamicLossScaler(init_scale=1.0, min_loss_scale=1.0)
    assert scale_candidates(low)[1] == 1.0
    with pytest.raises(FloatingPointError):
        low.check_overflow(float("inf"))


@pytest.mark.slow
def test_checkpoints_between_log_lines_hold_the_settled_state(data_bin, tmp_path, monkeypatch):
    """With --log-interval above the run length nothing is settled for logging; the checkpoints that
    --save-interval-updates writes still carry fairseq's exact update count and weights, and the last
    checkpoint its loss scale too. (When the update after a save point overflows, fairseq's loop sees
    the same count again and writes that interval checkpoint a second time, with the lowered loss
    scale and one more batch consumed; the deferred step learns of the overflow one update later and
    keeps the first one. Both are consistent states to resume from.)"""
    from fairseq import checkpoint_utils

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    flags = ["--max-update", "7", "--fp16", "--fp16-init-scale", str(2 ** 20), "--fp16-scale-window", "2",
             "--dropout", "0", "--log-interval", "100", "--save-interval-updates", "3", "--disable-validation"]
    for sync in (True, False):
        _run(data_bin, str(tmp_path / ("sync" if sync else "deferred")), sync, monkeypatch, *flags)
    names = sorted(f for f in os.listdir(tmp_path / "sync") if f.endswith(".pt"))
    assert "checkpoint_last.pt" in names and any("_3.pt" in f for f in names), names
    assert names == sorted(f for f in os.listdir(tmp_path / "deferred") if f.endswith(".pt"))
    for name in names:
        a = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "sync" / name))
        b = checkpoint_utils.load_checkpoint_to_cpu(str(tmp_path / "deferred" / name))
        assert a["optimizer_history"][-1]["num_updates"] == b["optimizer_history"][-1]["num_updates"], name
        if name == "checkpoint_last.pt":
            assert a["last_optimizer_state"]["loss_scale"] == b["last_optimizer_state"]["loss_scale"]
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (name, k)


@pytest.mark.slow
def test_two_ranks_deferred_step_matches_fairseqs_step(data_bin, tmp_path):
    """Two gloo ranks: the deferred step (statistics summed on the device, read back with the
    update's outcome when it is settled) logs what fairseq's step body logs and ends with the
    same weights, with clipping active. (fp32: fairseq's own fp16 overflow branch needs a CUDA
    build, and the child processes cannot be patched like the in-process tests above.) With the
    whole optimizer state on every rank (the default on gloo, which has no peer writes) the weights are
    equal bit for bit; with it sharded (``--ls-shard-state on``) the gradient norm is summed in
    another order, so the clipped updates agree to rounding."""
    import sys

    from _models import lightseq_train_two_ranks
    from test_end_to_end import ROOT, TRAIN_FLAGS

    from ls_fairseq.fairseq_ext.compat import patch_checkpoint_loading

    patch_checkpoint_loading()  # fairseq's checkpoint reader under torch >= 2.6, as lightseq-train does
    flags = [*TRAIN_FLAGS, "--max-update", "9", "--clip-norm", "0.1", "--dropout", "0", "--log-interval", "3",
             "--disable-validation"]
    runs = {}
    # fairseq-train --user-dir (as python -m fairseq_cli.train) takes the same step as lightseq-train
    fairseq_train = [sys.executable, "-m", "fairseq_cli.train", "--user-dir", os.path.join(ROOT, "user_dir")]
    for name, extra, runner in (("sync", ["--ls-trainer", "off"], None), ("deferred", [], None),
                                ("sharded", ["--ls-shard-state", "on"], None),
                                ("fairseq_train", [], lambda rank: fairseq_train)):
        save = tmp_path / name
        save.mkdir()
        runs[name] = lightseq_train_two_ranks(data_bin, save, save, [*flags, *extra], runner=runner)
    with open(tmp_path / "sharded" / "rank0.log") as f:
        assert "optimizer state sharded over 2 ranks" in f.read()
    with open(tmp_path / "deferred" / "rank0.log") as f:
        assert "optimizer state sharded" not in f.read()
    with open(tmp_path / "fairseq_train" / "rank0.log") as f:
        text = f.read()
        assert "trains this run on its own trainer" in text and "deferred step" in text
    a = runs["sync"]
    pa = _params(os.path.join(tmp_path, "sync", "checkpoint_last.pt"))
    for name, tol in (("deferred", 0), ("sharded", 1e-5), ("fairseq_train", 0)):
        b = runs[name]
        assert sorted(a) == sorted(b) == [3, 6, 9], (name, sorted(a), sorted(b))
        assert all(float(r["clip"]) == 100 for r in b.values())  # the clip was active
        for u in a:
            for k in ("loss", "nll_loss", "gnorm", "clip", "lr", "wpb", "bsz", "num_updates"):
                assert a[u][k] == b[u][k], (name, u, k, a[u][k], b[u][k])
        pb = _params(os.path.join(tmp_path, name, "checkpoint_last.pt"))
        for k in pa:
            torch.testing.assert_close(pb[k], pa[k], rtol=tol, atol=tol, msg=f"{name}: {k}")


def test_summed_statistics_are_read_back_as_host_numbers():
    """The all-reduced logging outputs reach fairseq's meters as Python numbers: a device tensor
    as a meter's weight would make it wait for the GPU (``n > 0``) at every update."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from _models import free_port
    from ls_fairseq.fairseq_ext.step.step_stats import StepStats

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        stats = StepStats(SimpleNamespace(), None, torch.device("cpu"), lambda: None)
        logs = [{"loss": torch.tensor(2.5), "ntokens": 7, "sample_size": 7, "pair": torch.tensor([1.0, 2.0])},
                {"loss": torch.tensor(1.5), "ntokens": 5, "sample_size": 5, "pair": torch.tensor([3.0, 4.0])}]
        sums, buf, summed = stats.sum_on_device(logs, torch.tensor(12.0), 0, 3.5)
        assert [float(s) for s in sums] == [12.0, 0.0, 3.5]
        out = summed.read(buf.tolist())
        assert len(out) == 1
        assert out[0]["loss"] == 4.0 and out[0]["ntokens"] == 12 and out[0]["sample_size"] == 12
        assert all(type(out[0][k]) is float for k in ("loss", "ntokens", "sample_size"))
        assert out[0]["pair"].tolist() == [4.0, 6.0] and out[0]["pair"].device.type == "cpu"
        # a dummy batch contributes zeros of the same layout
        _, buf0, summed0 = stats.sum_on_device(logs[:1], 0.0, 0, 0.0, ignore=True)
        zero = summed0.read(buf0.tolist())[0]
        assert sorted(zero) == ["loss", "ntokens", "pair", "sample_size"]
        assert zero["loss"] == zero["ntokens"] == zero["sample_size"] == 0.0
        assert zero["pair"].tolist() == [0.0, 0.0]
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("precision", [[], ["--fp16"]], ids=["fp32", "fp16"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_train_step_reads_no_tensor_value_on_the_host(data_bin, tmp_path, ranks, precision):
    """Inside train_step, neither fairseq's trainer and meters nor LSTrainer read a tensor's value on
    the host (on a GPU each read waits for the device), apart from the settled update's pinned copy.
    Two ranks once read the summed statistics' weights in fairseq's meters 8 times per update."""
    import json
    import sys

    from _models import lightseq_train_two_ranks
    from test_end_to_end import ROOT, TRAIN_FLAGS

    flags = [*TRAIN_FLAGS, *precision, "--max-update", "12", "--clip-norm", "0.1", "--log-interval", "2",
             "--disable-validation", "--no-save"]
    if ranks == 1:  # in this process
        from _host_reads import counting_host_reads
        from _models import lightseq_train

        with counting_host_reads(on_cpu=True) as reads:
            lightseq_train([data_bin, "--save-dir", str(tmp_path), *flags])
        counted = reads()
    else:  # two processes, each counting its own (tests/_host_reads.py as a script)
        script = os.path.join(ROOT, "tests", "_host_reads.py")
        lightseq_train_two_ranks(data_bin, tmp_path, tmp_path, flags,
                                 runner=lambda r: [sys.executable, script, str(tmp_path / f"reads{r}.json")])
        counted = json.loads((tmp_path / "reads0.json").read_text())
    assert counted["steps"] >= 10
    assert counted["reads"] == {}


@pytest.mark.slow
def test_a_run_of_overflows_stops_training_with_the_reason(data_bin, tmp_path, monkeypatch):
    """From a loss scale of 2**22 the first updates all overflow: with the streak limit at 4 training stops
    on the fourth, with the reason, instead of going on."""
    from ls_fairseq.fairseq_ext.step import pending_update

    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # as above: fairseq's overflow branch
    monkeypatch.setattr(pending_update, "OVERFLOW_STREAK_LIMIT", 4)
    with pytest.raises(FloatingPointError, match="overflowed in fp16 on 4 consecutive updates"):
        _run(data_bin, str(tmp_path / "d"), False, monkeypatch, "--max-update", "9", "--fp16", "--fp16-init-scale",
             str(2 ** 22), "--dropout", "0", "--disable-validation")


@pytest.mark.parametrize("precision,limit", [([], 5), (["--fp16"], 1)], ids=["fp32", "fp16"])
def test_updates_are_settled_five_behind_without_a_loss_scale(data_bin, tmp_path, monkeypatch, precision, limit):
    """Without a loss scale (fp32 here, bf16 alike) update n is settled during update n + 5, so five may be
    pending; fp16's loss scale keeps it to one (an overflow changes what the next update uses). The logged
    numbers are the same either way (the comparisons above run fp32 with five pending)."""
    from ls_fairseq.fairseq_ext.step.pending_update import PENDING_WITHOUT_SCALE, PendingUpdates, pending_limit

    assert PENDING_WITHOUT_SCALE == 5 and pending_limit(None) == 5 and pending_limit(object()) == 1
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)  # as above: fairseq's overflow branch
    pending_at_settle, real = [], PendingUpdates._settle_one

    def settle(self, pending, in_step):
        if in_step:  # the updates pending when this one was taken out, itself included
            pending_at_settle.append(len(self) + 1)
        return real(self, pending, in_step)

    monkeypatch.setattr(PendingUpdates, "_settle_one", settle)
    _run(data_bin, str(tmp_path / "d"), False, monkeypatch, "--max-update", "30", "--log-interval", "100",
         "--dropout", "0", "--disable-validation", "--no-save", *precision)
    assert len(pending_at_settle) >= 4 and set(pending_at_settle) == {limit}, pending_at_settle
