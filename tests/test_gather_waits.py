"""The sharded ls_adam's all-gathers overlap the next forward (ls_fairseq.optim.gather_waits): the forward
must wait for every bucket before it reads it. Checked with poisoned gathers: the weights of every bucket
are NaN until its (fake) all-gather is waited for."""

from types import SimpleNamespace

import pytest
import torch

from ls_fairseq.optim.adam import LSAdam
from ls_fairseq.optim.gather_waits import GatherWaits, layer_groups
from ls_fairseq.optim.buckets import bucket_order

from _models import build_model, make_dict, random_batch


def _model(pre_norm=False):
    torch.manual_seed(0)
    d = make_dict()
    extra = dict(encoder_normalize_before=True, decoder_normalize_before=True) if pre_norm else {}
    model = build_model("ls_transformer_tiny", d, share_all_embeddings=True, dropout=0.0, **extra)
    return d, model.eval()


def test_layer_groups_of_an_ls_transformer():
    _, model = _model()
    root, groups = layer_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [len(ps) > 0 for _, ps in groups] == [True] * 4  # 2 encoder + 2 decoder layers
    assert groups[0][0] is model.encoder.layers[0] and groups[3][0] is model.decoder.layers[1]
    root_names = {names[id(p)] for p in root}
    assert "encoder.embed_tokens.weight" in root_names and "decoder.encoder_attn_kv.weight" in root_names
    assert not any(".layers." in n for n in root_names)
    for g, (layer, ps) in enumerate(groups):
        assert {id(p) for p in ps} == {id(p) for p in layer.parameters()}
    every = [id(p) for p in root] + [id(p) for _, ps in groups for p in ps]
    assert sorted(every) == sorted(id(p) for p in model.parameters())  # each parameter exactly once


class _PoisonedGather:
    """Stands for an all-gather in flight: the bucket's weights are NaN until wait() puts them back."""

    def __init__(self, view, log, key):
        self.view, self.saved, self.log, self.key = view, view.detach().clone(), log, key
        with torch.no_grad():
            view.fill_(float("nan"))

    def wait(self):
        with torch.no_grad():
            self.view.copy_(self.saved)
        self.log.append(self.key)


def _poison(opt, log):
    for ws in opt.workspaces:
        for buf in ws.buffers:
            for start, end, _, _ in opt._shard.parts[id(buf)]:
                key = (id(buf), start)
                opt._gathers[key] = _PoisonedGather(buf.param[start:end], log, key)


@pytest.mark.parametrize("pre_norm", [False, True], ids=["post_norm", "pre_norm_t2t"])
def test_the_forward_waits_for_every_bucket_before_it_reads_it(pre_norm):
    d, model = _model(pre_norm)
    if pre_norm:
        assert model.encoder.layer_norm is not None and model.decoder.layer_norm is not None
    src, lengths, prev, _ = random_batch(d)
    want = model(src, lengths, prev)[0]
    opt = LSAdam(model.parameters(), lr=0.1)
    (ws,) = opt.workspaces
    buckets = bucket_order([ws], 4096)  # several buckets per layer, and layers sharing buckets
    assert len(buckets) > 8
    opt.shard_(buckets, 0, 2)
    waits = GatherWaits(opt, model)
    # the buckets the forward needs first are updated (and gathered) first
    first = opt._shard.parts[id(ws.buffers[0])][0]
    emb = model.encoder.embed_tokens.weight
    assert opt.bucket_key(emb) == (id(ws.buffers[0]), first[0])

    log = []
    _poison(opt, log)
    got = model(src, lengths, prev)[0]
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    assert sorted(log) == sorted({(id(ws.buffers[0]), s) for s, _, _, _ in opt._shard.parts[id(ws.buffers[0])]})
    assert not opt._gathers

    # the same poison without the waits reaches the output: the check above has teeth
    waits.remove()
    _poison(opt, log)
    pending = dict(opt._gathers)
    opt._gathers.clear()
    assert torch.isnan(model(src, lengths, prev)[0]).any()
    for w in pending.values():
        w.wait()
    assert torch.equal(model(src, lengths, prev)[0], want)


def test_trainer_waits_for_the_weights_outside_its_train_step():
    """LSTrainer's ``model`` (outside the train step) and ``get_model()`` wait for gathers in flight."""
    from ls_fairseq.fairseq_ext.optimizer import LSAdamConfig, LSFairseqAdam
    from ls_fairseq.fairseq_ext.step.trainer import LSTrainer

    net = torch.nn.Linear(4, 4)
    opt = LSFairseqAdam(LSAdamConfig(lr=[0.1]), list(net.parameters()))
    log = []
    wrapped = object()
    fake = SimpleNamespace(_optimizer=opt, _wrapped_model=wrapped, in_step=True)
    fake.wait_for_weights = lambda: LSTrainer.wait_for_weights(fake)
    opt._optimizer._gathers["k"] = SimpleNamespace(wait=lambda: log.append("waited"))
    assert LSTrainer.model.fget(fake) is wrapped and log == []  # the forward's hooks wait in the step
    fake.in_step = False
    assert LSTrainer.model.fget(fake) is wrapped and log == ["waited"]
    assert not opt._optimizer._gathers


def test_defer_gathers_needs_sharded_state():
    opt = LSAdam(torch.nn.Linear(3, 3).parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="sharded"):
        opt.defer_gathers({})
    opt.wait_gathers()  # nothing in flight: a no-op
