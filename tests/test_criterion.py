"""ls_label_smoothed_cross_entropy against fairseq's label_smoothed_cross_entropy."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

import ls_fairseq.fairseq_ext  # noqa: F401  (registers the criterion)
from fairseq import criterions, metrics
from fairseq.criterions.label_smoothed_cross_entropy import LabelSmoothedCrossEntropyCriterion
from fairseq.data import Dictionary
from fairseq.models import BaseFairseqModel, FairseqDecoder

from ls_fairseq.fairseq_ext.criterion import LSLabelSmoothedCrossEntropyCriterion

B, T, V = 3, 7, 29  # prime vocabulary, padding in the targets


class ToyModel(BaseFairseqModel):
    """A 'model' whose decoder output is a learnable logit tensor (so logit gradients are checked)."""

    def __init__(self, dictionary, logits):
        super().__init__()
        self.decoder = FairseqDecoder(dictionary)
        self.logits = torch.nn.Parameter(logits)

    def forward(self, src_tokens, src_lengths, prev_output_tokens):
        return self.logits * 1.0, {"attn": [None]}


def make_setup(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    d = Dictionary()
    for i in range(V - len(d)):
        d.add_symbol(f"w{i}")
    assert len(d) == V
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    target = torch.randint(4, V, (B, T), generator=g)
    target[0, 5:] = d.pad()
    target[2, 2:] = d.pad()
    target[1, 0] = d.pad()  # a pad inside the prefix too
    sample = {
        "net_input": {"src_tokens": None, "src_lengths": None, "prev_output_tokens": None},
        "target": target,
        "ntokens": int(target.ne(d.pad()).sum()),
    }
    task = SimpleNamespace(target_dictionary=d, source_dictionary=d)
    return task, d, logits, sample


def run(crit_cls, task, d, logits, sample, eps, prefix, sentence_avg=False, reduce=True):
    model = ToyModel(d, logits.clone())
    crit = crit_cls(task, sentence_avg, eps, ignore_prefix_size=prefix, report_accuracy=True)
    loss, sample_size, log = crit(model, sample, reduce=reduce)
    loss.sum().backward()
    return loss, sample_size, log, model.logits.grad


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("sentence_avg", [False, True])
def test_matches_fairseq(eps, prefix, sentence_avg):
    task, d, logits, sample = make_setup(seed=int(eps * 10) + prefix)
    ours = run(LSLabelSmoothedCrossEntropyCriterion, task, d, logits, sample, eps, prefix, sentence_avg)
    ref = run(LabelSmoothedCrossEntropyCriterion, task, d, logits, sample, eps, prefix, sentence_avg)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-6, atol=1e-5)
    assert ours[1] == ref[1]
    for key in ("loss", "nll_loss"):
        torch.testing.assert_close(ours[2][key], ref[2][key], rtol=1e-6, atol=1e-5)
    for key in ("n_correct", "total", "ntokens", "nsentences", "sample_size"):
        assert ours[2][key] == ref[2][key], key
    assert ours[2]["total"] == int(sample["target"][:, prefix:].ne(d.pad()).sum())
    torch.testing.assert_close(ours[3], ref[3], rtol=1e-5, atol=1e-7)
    # the prefix and the padding receive no gradient
    if prefix:
        assert ours[3][:, :prefix].abs().sum() == 0
    assert ours[3][2, 2:].abs().sum() == 0
    # with smoothing the loss differs from the nll; without, it is the nll
    assert torch.equal(ours[2]["loss"], ours[2]["nll_loss"]) == (eps == 0.0)


def test_accuracy_counts_hits():
    task, d, logits, sample = make_setup()
    tgt = sample["target"]
    logits = torch.full((B, T, V), -5.0)
    logits.scatter_(-1, tgt.unsqueeze(-1), 5.0)  # every token predicted right...
    logits[0, 0, (tgt[0, 0] + 1) % V] = 10.0  # ...except one
    _, _, log, _ = run(LSLabelSmoothedCrossEntropyCriterion, task, d, logits, sample, 0.1, 0)
    assert log["total"] == sample["ntokens"] and log["n_correct"] == log["total"] - 1


def test_low_precision_logits_match_fairseq():
    task, d, logits, sample = make_setup(seed=3, dtype=torch.bfloat16)
    ours = run(LSLabelSmoothedCrossEntropyCriterion, task, d, logits, sample, 0.1, 0)
    ref = run(LabelSmoothedCrossEntropyCriterion, task, d, logits, sample, 0.1, 0)
    assert ours[0].dtype == torch.float32
    torch.testing.assert_close(ours[0], ref[0].float(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ours[3].float(), ref[3].float(), rtol=2e-2, atol=1e-3)


def test_reduce_false_and_metrics():
    task, d, logits, sample = make_setup()
    ours = run(LSLabelSmoothedCrossEntropyCriterion, task, d, logits, sample, 0.1, 0, reduce=False)
    ref = run(LabelSmoothedCrossEntropyCriterion, task, d, logits, sample, 0.1, 0, reduce=False)
    assert ours[0].shape == ref[0].shape and ours[0].numel() == B * T
    torch.testing.assert_close(ours[0], ref[0])
    _, _, log, _ = run(LSLabelSmoothedCrossEntropyCriterion, task, d, logits, sample, 0.1, 0)
    with metrics.aggregate() as agg:
        LSLabelSmoothedCrossEntropyCriterion.reduce_metrics([log, log])
    vals = agg.get_smoothed_values()
    assert vals["accuracy"] == round(100.0 * log["n_correct"] / log["total"], 3)
    assert vals["ppl"] > 1


def test_built_through_fairseq_registry():
    task, d, logits, sample = make_setup()
    cfg = OmegaConf.create({
        "_name": "ls_label_smoothed_cross_entropy", "label_smoothing": 0.1, "report_accuracy": True,
        "ignore_prefix_size": 0, "sentence_avg": False,
    })
    crit = criterions.build_criterion(cfg, task)
    assert isinstance(crit, LSLabelSmoothedCrossEntropyCriterion)
    assert crit.eps == 0.1 and crit.report_accuracy and crit.padding_idx == d.pad()


def test_rejects_adaptive_softmax_and_bad_flags():
    task, d, logits, sample = make_setup()
    model = ToyModel(d, logits)
    model.decoder.adaptive_softmax = torch.nn.Identity()
    crit = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1)
    with pytest.raises(ValueError, match="adaptive softmax"):
        crit(model, sample)
    with pytest.raises(ValueError, match="label-smoothing must be in"):
        LSLabelSmoothedCrossEntropyCriterion(task, False, 1.0)
    with pytest.raises(ValueError, match="ignore-prefix-size must be >= 0"):
        LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1, ignore_prefix_size=-1)
    bad = dict(sample, target=sample["target"][:, :-1])
    with pytest.raises(ValueError, match="does not match target"):
        LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1)(ToyModel(d, logits), bad)


# ---------------------------------------------------------------- ls_transformer: logits of counted rows only
@pytest.mark.parametrize("prefix", [0, 1])
@pytest.mark.parametrize("sentence_avg", [False, True])
def test_ls_model_projects_only_counted_positions(prefix, sentence_avg):
    """With an ls_transformer the criterion asks the decoder for the logits of the non-padding,
    non-prefix target positions only; loss, metrics and every parameter gradient equal fairseq's
    criterion on the full [B, T, V] logits of the same model."""
    from _models import build_model, make_dict, random_batch

    d = make_dict(37)
    src, lengths, prev, tgt = random_batch(d, B=4, S=9, T=6, seed=prefix)
    tgt[3, -1] = d.pad()
    prev[3, -1:] = d.pad()
    sample = {
        "net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
        "target": tgt,
        "ntokens": int(tgt.ne(d.pad()).sum()),
    }
    task = SimpleNamespace(target_dictionary=d, source_dictionary=d)
    torch.manual_seed(0)
    model = build_model("ls_transformer_tiny", d, dropout=0.0, share_all_embeddings=True)
    model.train()

    def run_crit(cls):
        model.zero_grad()
        crit = cls(task, sentence_avg, 0.1, ignore_prefix_size=prefix, report_accuracy=True)
        loss, size, log = crit(model, sample)
        loss.backward()
        return loss.detach(), size, log, {n: p.grad.clone() for n, p in model.named_parameters()}

    calls = []  # the rows each call projects onto the vocabulary
    orig = model.decoder.output_layer
    model.decoder.output_layer = lambda x: (calls.append(tuple(x.shape)), orig(x))[1]
    ours = run_crit(LSLabelSmoothedCrossEntropyCriterion)
    ref = run_crit(LabelSmoothedCrossEntropyCriterion)
    counted = int(tgt[:, prefix:].ne(d.pad()).sum())
    pads = int(tgt.eq(d.pad()).sum())
    short = -counted % 8
    rows = counted + short if short <= pads else counted  # padded to a multiple of 8 with ignored pad positions
    assert rows % 8 == 0 or short > pads
    assert calls[0] == (rows, model.decoder.embed_dim) and calls[1] == tuple(tgt.shape) + (model.decoder.embed_dim,)
    torch.testing.assert_close(ours[0], ref[0], rtol=1e-5, atol=1e-5)
    assert ours[1] == ref[1]
    for key in ("n_correct", "total", "ntokens", "nsentences", "sample_size"):
        assert ours[2][key] == ref[2][key], key
    torch.testing.assert_close(ours[2]["nll_loss"], ref[2]["nll_loss"], rtol=1e-5, atol=1e-5)
    assert ours[3].keys() == ref[3].keys()
    for name in ours[3]:
        torch.testing.assert_close(ours[3][name], ref[3][name], rtol=1e-4, atol=1e-6, msg=name)


def test_logit_rows_rejected_while_decoding():
    from _models import build_model, make_dict, random_batch

    d = make_dict(20)
    src, lengths, prev, _ = random_batch(d)
    model = build_model("ls_transformer_tiny", d, dropout=0.0).eval()
    enc = model.encoder(src, src_lengths=lengths)
    with pytest.raises(ValueError, match="incremental decoding"):
        model.decoder(prev[:, :1], encoder_out=enc, incremental_state={}, logit_rows=torch.tensor([0]))


def test_precomputed_counted_rows_are_used(monkeypatch):
    """A sample carrying counted_rows(target) (LSTrainer computes it on the host) gives the same loss
    without the criterion computing the rows again."""
    from _models import build_model, make_dict, random_batch

    from ls_fairseq.fairseq_ext.criterion import COUNTED_ROWS_KEY

    d = make_dict(23)
    src, lengths, prev, tgt = random_batch(d, seed=5)
    sample = {"net_input": {"src_tokens": src, "src_lengths": lengths, "prev_output_tokens": prev},
              "target": tgt, "ntokens": int(tgt.ne(d.pad()).sum())}
    task = SimpleNamespace(target_dictionary=d, source_dictionary=d)
    model = build_model("ls_transformer_tiny", d, dropout=0.0).eval()
    crit = LSLabelSmoothedCrossEntropyCriterion(task, False, 0.1, ignore_prefix_size=1)
    want = crit(model, sample)[0]
    rows = crit.counted_rows(tgt)
    assert rows.tolist() == [i for i, t in enumerate(tgt.reshape(-1).tolist()) if t != d.pad() and i % tgt.shape[1] >= 1]

    def fail(target):
        raise AssertionError("rows recomputed")

    monkeypatch.setattr(crit, "counted_rows", fail)
    got = crit(model, dict(sample, **{COUNTED_ROWS_KEY: rows}))[0]
    torch.testing.assert_close(got, want)
