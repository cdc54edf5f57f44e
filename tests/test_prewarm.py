"""The first update's kernels warmed up before the first epoch (ls_fairseq/fairseq_ext/graph/prewarm.py), on the
CPU: it runs the first batch through a one-layer copy of the model and leaves the model itself as it was. Its
effect on the first epoch is measured on the GPU (benchmarks/first_epoch.py, benchmarks/RESULTS.md)."""

import sys

import torch

from ls_fairseq.fairseq_ext.graph import prewarm
from tests._models import make_dict
from tests.test_graph_step import _model_and_criterion, _sample


def _model():
    d = make_dict()
    m, crit = _model_and_criterion(d)
    return d, m, crit


def test_the_copy_has_one_layer_a_side_and_its_own_weights():
    d, m, _ = _model()
    n_enc, n_dec = len(m.encoder.layers), len(m.decoder.layers)
    assert n_enc > 1 and n_dec > 1
    r = prewarm._cut_copy(m)
    assert len(r.encoder.layers) == 1 and len(r.decoder.layers) == 1
    assert len(m.encoder.layers) == n_enc and len(m.decoder.layers) == n_dec  # the live model is put back
    assert r.decoder.encoder_attn_kv.weight.shape == m.decoder.encoder_attn_kv.weight.shape
    assert not {p.data_ptr() for p in m.parameters()} & {p.data_ptr() for p in r.parameters()}


def test_the_warm_up_runs_the_first_batch_and_leaves_the_model_and_the_batch_alone():
    d, m, crit = _model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    sample = _sample(d, [4, 6, 2], [5, 3, 6])
    keys, net_keys = set(sample), set(sample["net_input"])
    switch = sys.getswitchinterval()
    ran = []
    forward = type(m).forward

    def counted(self, *a, **k):
        ran.append(self)
        return forward(self, *a, **k)

    type(m).forward = counted
    try:
        w = prewarm.Prewarm(m, crit, sample, "cpu")
        assert sys.getswitchinterval() <= prewarm.SWITCH_INTERVAL
        w.join()
    finally:
        type(m).forward = forward
    assert w.error is None
    assert len(ran) == 1 and ran[0] is not m and len(ran[0].encoder.layers) == 1
    assert sys.getswitchinterval() == switch
    assert all(p.grad is None for p in m.parameters())
    assert all(torch.equal(p, before[n]) for n, p in m.named_parameters())
    assert set(sample) == keys and set(sample["net_input"]) == net_keys  # the trainer's batch is not changed


def test_an_error_in_the_warm_up_is_reported_not_raised(caplog):
    d, m, crit = _model()
    bad = _sample(d, [4], [5])
    del bad["target"]
    w = prewarm.Prewarm(m, crit, bad, "cpu")
    with caplog.at_level("INFO", logger="fairseq.trainer"):
        w.join()
    assert w.error is not None and "target" in w.error
    assert "training is not affected" in caplog.text


def test_the_batch_is_marked_on_a_copy_as_the_eager_step_marks_it():
    import types

    from ls_fairseq.fairseq_ext.criterion import COUNTED_ROWS_KEY
    from ls_fairseq.fairseq_ext.step.sample_prep import SRC_PADDING_KEY, SamplePrep

    d, m, crit = _model()
    t = SamplePrep(m, crit, d.pad())
    sample = _sample(d, [4, 6, 2], [5, 3, 6])
    keys, net_keys = set(sample), set(sample["net_input"])
    marked = t.marked_copy(sample)
    assert set(sample) == keys and set(sample["net_input"]) == net_keys
    assert torch.equal(marked[COUNTED_ROWS_KEY], crit.counted_rows(sample["target"]))
    assert marked["net_input"][SRC_PADDING_KEY] is True  # sentences of 4 and 2 tokens beside one of 6
