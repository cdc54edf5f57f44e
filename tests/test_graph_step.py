"""The CUDA-graph step's CPU-side parts: the shape-bucket plan, padding a batch to a bucket, and the
split step (body, head, two backwards) that the graphs replay, against fairseq's criterion on the
unpadded batch. The graphs themselves are tested in tests/gpu/test_graph_step_gpu.py."""

import types

import numpy as np
import pytest
import torch

from ls_fairseq.fairseq_ext.graph.packed_buckets import PackedBucket
from ls_fairseq.fairseq_ext.graph.shape_buckets import Bucket, batch_shapes, choose, pad_batch, plan_buckets, plan_report
from tests._models import build_model, make_dict


# ----------------------------------------------------------------------------- the plan
def _wmt_like_shapes(n=3000, max_tokens=4096, seed=0):
    from fairseq.data import data_utils

    rng = np.random.default_rng(seed)
    src = np.clip(np.round(rng.lognormal(3.2, 0.55, n)), 1, 250).astype(np.int64) + 1
    tgt = np.clip(np.round((src - 1) * rng.normal(1.05, 0.15, n)), 1, 250).astype(np.int64) + 1
    order = np.lexsort((tgt, src))
    num = np.maximum(src, tgt)
    batches = data_utils.batch_by_size(order, lambda i: num[i], max_tokens=max_tokens, required_batch_size_multiple=8)
    return batches, src, tgt


def test_plan_holds_every_batch_within_the_bucket_budget():
    batches, src, tgt = _wmt_like_shapes()
    shapes = batch_shapes(batches, src, tgt)
    assert len(shapes) == len(batches)
    for k in (1, 4, 16):
        plan = plan_buckets(shapes, k)
        assert 1 <= len(plan) <= k
        for s in shapes:
            b = choose(plan, *s)
            assert b is not None and b.holds(*s)
    one = plan_buckets(shapes, 1)[0]
    assert one == Bucket(int(shapes[:, 0].max()), int(shapes[:, 1].max()), int(shapes[:, 2].max()))


def test_plan_padding_shrinks_with_more_buckets_and_vanishes_at_one_per_shape():
    batches, src, tgt = _wmt_like_shapes()
    shapes = batch_shapes(batches, src, tgt)
    distinct = len(np.unique(shapes, axis=0))
    assert distinct > 12
    extras = [plan_report(plan_buckets(shapes, k), shapes)[1] for k in (2, 5, 12)]
    assert extras[0] > extras[1] > extras[2] > 0
    n, extra, extra_tgt = plan_report(plan_buckets(shapes, distinct), shapes)
    assert n == distinct and extra == 0 and extra_tgt == 0


def test_choose_takes_the_cheapest_bucket_that_holds_the_batch():
    plan = sorted([Bucket(8, 10, 10), Bucket(16, 8, 8), Bucket(8, 30, 30)], key=lambda b: b.tokens)
    assert choose(plan, 8, 9, 10) == Bucket(8, 10, 10)
    assert choose(plan, 16, 8, 7) == Bucket(16, 8, 8)
    assert choose(plan, 8, 11, 3) == Bucket(8, 30, 30)
    assert choose(plan, 17, 1, 1) is None
    with pytest.raises(ValueError, match=">= 1"):
        plan_buckets(np.array([[8, 3, 3]]), 0)


# ----------------------------------------------------------------------------- padding
def _sample(d, lens_src, lens_tgt, seed=0):
    """A fairseq translation batch: left-padded source, right-padded target, prev_output_tokens."""
    g = torch.Generator().manual_seed(seed)
    B, S, T = len(lens_src), max(lens_src), max(lens_tgt)
    src = torch.full((B, S), d.pad())
    tgt = torch.full((B, T), d.pad())
    prev = torch.full((B, T), d.pad())
    for i, (ls, lt) in enumerate(zip(lens_src, lens_tgt)):
        src[i, S - ls:S - 1] = torch.randint(d.nspecial, len(d), (ls - 1,), generator=g)
        src[i, S - 1] = d.eos()
        tgt[i, :lt - 1] = torch.randint(d.nspecial, len(d), (lt - 1,), generator=g)
        tgt[i, lt - 1] = d.eos()
        prev[i, 0] = d.eos()
        prev[i, 1:lt] = tgt[i, :lt - 1]
    ntokens = int(tgt.ne(d.pad()).sum())
    return {"id": torch.arange(B), "nsentences": B, "ntokens": ntokens, "target": tgt,
            "net_input": {"src_tokens": src, "src_lengths": src.ne(d.pad()).sum(1), "prev_output_tokens": prev}}


def test_pad_batch_keeps_rows_and_pads_on_the_right_sides():
    d = make_dict()
    s = _sample(d, [4, 6, 2], [5, 3, 6])
    net = s["net_input"]
    src, lengths, prev, tgt = pad_batch(net["src_tokens"], net["prev_output_tokens"], s["target"], Bucket(5, 9, 8),
                                        d.pad(), d.eos())
    assert src.shape == (5, 9) and prev.shape == (5, 8) and tgt.shape == (5, 8)
    assert torch.equal(src[:3, 3:], net["src_tokens"]) and src[:3, :3].eq(d.pad()).all()
    assert torch.equal(prev[:3, :6], net["prev_output_tokens"]) and prev[:3, 6:].eq(d.pad()).all()
    assert torch.equal(tgt[:3, :6], s["target"]) and tgt[3:].eq(d.pad()).all()
    assert src[3:, -1].eq(d.eos()).all() and src[3:, :-1].eq(d.pad()).all()
    assert torch.equal(lengths, torch.tensor([4, 6, 2, 1, 1]))
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch(net["src_tokens"], net["prev_output_tokens"], s["target"], Bucket(2, 9, 8), d.pad(), d.eos())


# ----------------------------------------------------------------------------- the split step
def _model_and_criterion(d, eps=0.1, normalize_before=False):
    from ls_fairseq.fairseq_ext.criterion import LSLabelSmoothedCrossEntropyCriterion

    torch.manual_seed(0)
    m = build_model("ls_transformer_tiny", d, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                    encoder_normalize_before=normalize_before, decoder_normalize_before=normalize_before,
                    share_all_embeddings=True).double()
    m.decoder.right_padded_targets = True
    task = types.SimpleNamespace(target_dictionary=d, source_dictionary=d)
    return m, LSLabelSmoothedCrossEntropyCriterion(task, False, eps)


def _grads(m):
    return {n: p.grad.detach().clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("normalize_before", [False, True])
@pytest.mark.parametrize("bucket", [Bucket(3, 6, 6), Bucket(5, 9, 8), Bucket(8, 16, 11)])
def test_split_step_on_a_padded_batch_equals_the_criterion_on_the_batch(bucket, normalize_before):
    check_split_step_equals_the_criterion(bucket, normalize_before)


class _ScaledBackward:
    """The deferred step's view of the optimizer as the head sees it: the head computes its backward itself
    (``backward_by``) with this loss scale."""

    def __init__(self, scale):
        self.scale, self.calls = scale, 0

    def backward_by(self, run):
        self.calls += 1
        return run(self.scale)

    def backward(self, loss):
        raise AssertionError("the head must not take autograd's backward here")


def check_split_step_equals_the_criterion(bucket, normalize_before, scale="autograd"):
    """split_step over ``bucket`` (padded or packed) gives the criterion's loss, statistics and gradients on the
    batch as it came (fp64). ``scale``: "autograd" (the head through autograd), or the loss scale (None or a
    number) of the head's own backward (the trainer's deferred step, gradients attached beforehand)."""
    from ls_fairseq.fairseq_ext.graph.graph_step import split_step

    d = make_dict()
    m, crit = _model_and_criterion(d, normalize_before=normalize_before)
    sample = _sample(d, [4, 6, 2], [5, 3, 6])
    m.train()
    loss, size, log = crit(m, sample)
    loss.backward()
    ref = _grads(m)
    m.zero_grad()
    opt = None
    if scale != "autograd":
        for p in m.parameters():
            p.grad = torch.full_like(p, 0.0)
        opt = _ScaledBackward(None if scale is None else torch.tensor(float(scale), dtype=torch.float64))
    loss2, size2, log2 = split_step(m, crit, sample, bucket, d.pad(), d.eos(), optimizer=opt)
    got = _grads(m)
    if opt is not None:
        assert opt.calls == 1
        got = {k: v / (1.0 if scale is None else scale) for k, v in got.items()}
    assert size2 == size == sample["ntokens"]
    assert log2["nsentences"] == 3 and log2["ntokens"] == sample["ntokens"] and log2["sample_size"] == size
    torch.testing.assert_close(log2["loss"], log["loss"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(log2["nll_loss"], log["nll_loss"], rtol=1e-12, atol=1e-12)
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("scale", [None, 64.0])
@pytest.mark.parametrize("bucket", [Bucket(5, 9, 8), PackedBucket(4, 20, 20, 16)])
def test_split_step_with_the_heads_own_backward_equals_the_criterion(bucket, scale):
    """The head's backward without autograd (one cross-entropy pass writing the scaled loss's gradient over the
    logits, the projection's GEMMs adding into its gradient) gives the criterion's loss and gradients."""
    check_split_step_equals_the_criterion(bucket, False, scale)


@pytest.mark.parametrize("own_backward", [False, True])
def test_head_step_writes_the_features_gradient_into_grad_out(own_backward):
    """The graph step hands the head its fixed gradient buffer: the same loss and gradients as without it, written
    there (stale values overwritten), with the head's own backward and through autograd."""
    from ls_fairseq.fairseq_ext.graph.split_step import head_step

    d = make_dict()
    m, crit = _model_and_criterion(d)
    gen = torch.Generator().manual_seed(5)
    feats = torch.randn(1, 12, m.decoder.embed_tokens.embedding_dim, generator=gen, dtype=torch.float64)
    rows = torch.tensor([0, 1, 2, 5, 6, 7, 9, 0])
    target_rows = torch.randint(4, len(d), (8,), generator=gen)
    target_rows[-1] = d.pad()
    w = m.decoder.output_projection.weight
    outs = []
    for buf in (None, torch.full_like(feats, 3.0)):
        w.grad = torch.zeros_like(w) if own_backward else None
        opt = _ScaledBackward(torch.tensor(2.0, dtype=torch.float64)) if own_backward else \
            types.SimpleNamespace(backward=lambda loss: (2.0 * loss).backward())
        leaf = feats.clone().requires_grad_(True)
        loss, nll, grad = head_step(m, crit, leaf, rows, target_rows, opt, grad_out=buf)
        if buf is not None:
            assert grad is buf
        outs.append((loss.detach(), nll.detach(), grad.clone(), w.grad.clone()))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert outs[1][2][0, 3].abs().max() == 0 and outs[1][2][0, 0].abs().max() > 0  # uncounted rows zeroed


def test_split_step_fails_when_padding_leaks_into_the_loss():
    """The exactness test can fail: padding the bucket with a real token changes the loss."""
    from ls_fairseq.fairseq_ext.graph.graph_step import split_step

    d = make_dict()
    m, crit = _model_and_criterion(d)
    sample = _sample(d, [4, 6, 2], [5, 3, 6])
    loss, _, _ = crit(m, sample)
    leaky = d.index("w7")  # pads the source with a word: the encoder attends to it
    loss2, _, _ = split_step(m, crit, sample, Bucket(5, 9, 8), leaky, d.eos())
    assert not torch.allclose(loss2, loss, rtol=1e-6)


def test_split_step_with_right_padded_sources():
    from ls_fairseq.fairseq_ext.graph.graph_step import split_step

    d = make_dict()
    m, crit = _model_and_criterion(d)
    sample = _sample(d, [4, 6, 2], [5, 3, 6])
    net = sample["net_input"]
    right = torch.full_like(net["src_tokens"], d.pad())
    for i, n in enumerate(net["src_lengths"].tolist()):
        right[i, :n] = net["src_tokens"][i, -n:]
    net["src_tokens"] = right
    loss, _, _ = crit(m, sample)
    loss2, _, _ = split_step(m, crit, sample, Bucket(4, 8, 7), d.pad(), d.eos(), left_pad_source=False)
    torch.testing.assert_close(loss2, loss, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- the switch
def test_graph_flags_parse_and_reach_the_settings(tmp_path):
    """--ls-graph-step / --ls-graph-buckets are ls_adam's options; the step reads them from the config."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from ls_fairseq.cli import train
    from ls_fairseq.fairseq_ext.step.settings import StepSettings

    def settings(args):
        s = StepSettings.from_cfg(convert_namespace_to_omegaconf(args))
        return s.graph_step, s.graph_buckets

    base = [str(tmp_path), "--arch", "ls_transformer_tiny", "--optimizer", "ls_adam", "--lr", "1e-3",
            "--criterion", "ls_label_smoothed_cross_entropy", "--max-tokens", "64", "--cpu"]
    assert settings(train.parse(base)) == ("auto", 64)
    assert settings(train.parse(base + ["--ls-graph-step", "on"])) == ("on", 64)
    assert settings(train.parse(base + ["--ls-graph-step", "off", "--ls-graph-buckets", "7"])) == ("off", 7)
    with pytest.raises(SystemExit):
        train.parse(base + ["--ls-graph-buckets", "0"])
    args = train.parse(base)
    args.ls_graph_buckets = 0  # as fairseq-train parses it: refused when the trainer reads it
    with pytest.raises(ValueError, match="--ls-graph-buckets must be >= 1"):
        settings(args)


def test_a_cpu_run_says_why_it_takes_the_eager_step():
    from ls_fairseq.fairseq_ext.graph.graph_step import unsupported_reason

    trainer = types.SimpleNamespace(cuda=False)
    assert unsupported_reason(trainer) == "not on a CUDA device"


def test_the_graphs_follow_a_rebuilt_optimizer():
    """The graphs are fixed to ls_adam's flat buffers: a new optimizer (fairseq rebuilds it when it loads a
    checkpoint) has other buffers, and the key that makes the graph step capture again changes with them."""
    from fairseq.optim.fp16_optimizer import MemoryEfficientFP16Optimizer  # noqa: F401  (the wrapper's path)

    from ls_fairseq.fairseq_ext.graph.graph_step import GraphStep
    from ls_fairseq.fairseq_ext.optimizer import LSAdamConfig, LSFairseqAdam
    from ls_fairseq.fairseq_ext.step.deferred_step import ScaledLossOptimizer

    net = torch.nn.Linear(4, 3)
    a = LSFairseqAdam(LSAdamConfig(lr=[0.1]), list(net.parameters()))
    key = GraphStep._buffers_key(ScaledLossOptimizer(a, None))
    assert key and GraphStep._buffers_key(a) == key
    assert GraphStep._buffers_key(ScaledLossOptimizer(a, None)) == key  # stable while the optimizer lives
    b = LSFairseqAdam(LSAdamConfig(lr=[0.1]), list(net.parameters()))
    assert GraphStep._buffers_key(ScaledLossOptimizer(b, None)) != key
    wrapped = types.SimpleNamespace(wrapped_optimizer=b)
    assert GraphStep._buffers_key(ScaledLossOptimizer(wrapped, None)) == GraphStep._buffers_key(b)
    assert GraphStep._buffers_key(torch.optim.SGD(net.parameters(), lr=0.1)) is None


def test_graph_grads_zero_only_the_head_and_zero_all_before_an_eager_micro_batch():
    """begin_update attaches every p.grad to its flat view and zeroes only the output projection's slice
    (the first graphed micro-batch overwrites the rest); make_zero zeroes all of it once, before an eager
    micro-batch adds into it; an unset head gradient (an OOM's zero_grad) is noticed."""
    from ls_fairseq.fairseq_ext.graph.graph_grads import GraphGrads
    from ls_fairseq.fairseq_ext.optimizer import LSAdamConfig, LSFairseqAdam

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 4)
            self.output_projection = torch.nn.Linear(4, 6, bias=False)

    model = torch.nn.Module()
    model.decoder = Decoder()
    opt = LSFairseqAdam(LSAdamConfig(lr=[0.1]), list(model.parameters()))
    grads = GraphGrads(model)
    assert not grads.attached()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    opt._optimizer.zero_grad(in_place=True)  # views attached, then stale values in the buffer
    flat = opt._optimizer.workspaces[0].buffers[0]
    flat.grad.fill_(7.0)
    grads.begin_update(opt)
    head_w = model.decoder.output_projection.weight
    assert grads.attached() and grads.fresh
    head, body = grads.views()
    assert [(p, v.data_ptr()) for p, v in head] == [(head_w, head_w.grad.data_ptr())]
    assert {id(p) for p, _ in body} == {id(model.decoder.layer.weight), id(model.decoder.layer.bias)}
    assert torch.all(head_w.grad == 0)
    assert torch.all(model.decoder.layer.weight.grad == 7)  # left for the graphs' copy to overwrite
    grads.make_zero()
    assert not grads.fresh and torch.all(flat.grad == 0)
    flat.grad.fill_(3.0)
    grads.make_zero()  # once per update: what a micro-batch wrote since stays
    assert torch.all(flat.grad == 3)
    grads.detach_body()
    assert model.decoder.layer.weight.grad is None and head_w.grad is not None
    grads.reattach_body()
    assert all(p.grad.data_ptr() == v.data_ptr() for p, v in body)
    head_w.grad = None
    assert not grads.attached()
    # one micro-batch: graphs captured for "write" overwrite, and only as the update's first writer
    grads.begin_update(opt, 1)
    assert grads.mode == "write" and grads.can_replay("write") and not grads.can_replay("add")
    grads.fresh = False  # (an eager micro-batch wrote the buffers)
    assert not grads.can_replay("write")
    # several micro-batches: the whole buffers are zeroed once, and the graphs add
    flat.grad.fill_(7.0)
    grads.begin_update(opt, 2)
    assert grads.mode == "add" and torch.all(flat.grad == 0) and not grads.fresh
    assert grads.can_replay("add") and not grads.can_replay("write")
    flat.grad.fill_(3.0)
    grads.make_zero()  # nothing to zero: what the micro-batches add stays
    assert torch.all(flat.grad == 3)
    assert grads.take_sinks() == set()  # no compiled extension here: no sinks were set


def test_several_gpus_take_the_graphs_only_when_asked(monkeypatch):
    """--ls-graph-step auto (the default) leaves multi-GPU runs to the eager step and says how to turn the
    graphs on; --ls-graph-step on passes that check (the other backends are still refused)."""
    from ls_fairseq.fairseq_ext.graph import graph_step

    def trainer(backend):
        cfg = types.SimpleNamespace(distributed_training=types.SimpleNamespace(ddp_backend=backend))
        return types.SimpleNamespace(cuda=True, cfg=cfg, data_parallel_world_size=2, _model=None, _criterion=None,
                                     task=None)

    assert "--ls-graph-step on" in graph_step.unsupported_reason(trainer("legacy_ddp"))
    assert "the graphs need legacy_ddp" in graph_step.unsupported_reason(trainer("c10d"), several_gpus=True)
    assert "model" in graph_step.unsupported_reason(trainer("legacy_ddp"), several_gpus=True)  # on to the model  # past the GPU checks, on to the model


def test_captures_are_paced_and_a_waiting_bucket_runs_in_a_captured_one_that_holds_it(monkeypatch):
    """Until the batches since the last capture have computed CAPTURE_SPACING_ROWS rows, a batch whose own bucket has
    no graphs runs in the cheapest captured bucket that holds it (if that computes at most STAND_IN_COST times as
    much); otherwise it captures. An update that waited for the GPU to finish starts the count again."""
    from ls_fairseq.fairseq_ext.graph import graph_step
    from ls_fairseq.fairseq_ext.graph.shape_buckets import Bucket

    small, mid, big = Bucket(8, 16, 16), Bucket(8, 24, 24), Bucket(32, 64, 64)
    assert small.cost < mid.cost <= graph_step.STAND_IN_COST * small.cost < big.cost
    monkeypatch.setattr(graph_step, "CAPTURE_SPACING_ROWS", 3 * mid.tokens)

    def engine():
        eng = graph_step.GraphStep.__new__(graph_step.GraphStep)
        eng.replay, eng.buckets, eng._run_in = False, [small, mid, big], set()
        eng.counts = {"stand_in": 0}
        eng._rows_since_capture = graph_step.CAPTURE_SPACING_ROWS
        return eng

    def run(eng, home, shape):
        b = eng._paced(home, shape)
        eng._run_in.add(b)
        return b

    eng = engine()
    assert run(eng, big, (20, 40, 40)) is big  # nothing captured: capture
    assert run(eng, mid, (8, 20, 20)) is mid  # right after, but only big holds it, at 10x the cost: capture
    # right after mid's capture, batches of small's run in mid until they have computed 3 x mid's rows
    assert [run(eng, small, (8, 10, 10)) for _ in range(3)] == [mid] * 3
    assert eng.counts["stand_in"] == 3
    assert run(eng, small, (8, 10, 10)) is small  # captured now
    assert run(eng, small, (8, 16, 12)) is small and run(eng, mid, (4, 24, 1)) is mid  # ready: always their own
    assert eng.counts["stand_in"] == 3 and eng._rows_since_capture == small.tokens + mid.tokens
    # after an update that waited for the GPU to finish (a log line), the count starts again: no capture yet
    eng._run_in.discard(small)
    eng._rows_since_capture = graph_step.CAPTURE_SPACING_ROWS
    eng.queue_drained()
    assert run(eng, small, (8, 10, 10)) is mid and eng.counts["stand_in"] == 4
    # a stand-in must hold the batch: fewer sentences than it has, at a cost within the limit
    tiny, few = Bucket(8, 8, 8), Bucket(4, 20, 20)
    assert tiny.cost < few.cost <= graph_step.STAND_IN_COST * tiny.cost
    eng = engine()
    eng.buckets = [tiny, few]
    assert run(eng, few, (4, 20, 20)) is few
    assert run(eng, tiny, (8, 5, 5)) is tiny
    assert eng.counts["stand_in"] == 0
