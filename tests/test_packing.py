"""Packed batches (ls_fairseq/fairseq_ext/packing.py): the forward over real tokens only equals the padded
forward, at the op, the model and the trainer level."""

import pytest
import torch
import torch.nn.functional as F

from _models import build_model, make_dict


def _cu(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    torch.cumsum(torch.tensor(lengths), 0, out=cu[1:])
    return cu


@pytest.mark.parametrize("causal", [False, True])
def test_packed_attention_is_attention_within_each_sentence(causal):
    from ls_fairseq.ops import attention
    from ls_fairseq.ops.attention import Varlen

    torch.manual_seed(0)
    lq, lk = [3, 1, 5], ([3, 1, 5] if causal else [4, 2, 6])
    q = torch.randn(1, 2, sum(lq), 8, dtype=torch.float64)
    k = torch.randn(1, 2, sum(lk), 8, dtype=torch.float64)
    v = torch.randn(1, 2, sum(lk), 8, dtype=torch.float64)
    out = attention(q, k, v, causal=causal, varlen=Varlen(_cu(lq), _cu(lk), max(lq), max(lk)))
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for i in range(len(lq)):
        sl, kl = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        ref = F.scaled_dot_product_attention(q[:, :, sl], k[:, :, kl], v[:, :, kl], is_causal=causal)
        torch.testing.assert_close(out[:, :, sl], ref)


def test_packed_attention_refuses_bad_packings():
    from ls_fairseq.ops import attention
    from ls_fairseq.ops.attention import Varlen

    q = torch.randn(1, 2, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="batch 1"):
        attention(q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1), q.expand(2, -1, -1, -1),
                  varlen=Varlen(cu, cu, 4, 4))
    with pytest.raises(ValueError, match="int32"):
        attention(q, q, q, varlen=Varlen(cu.long(), cu, 4, 4))
    with pytest.raises(ValueError, match="no key_padding_mask"):
        attention(q, q, q, key_padding_mask=torch.zeros(1, 4, dtype=torch.bool), varlen=Varlen(cu, cu, 4, 4))
    with pytest.raises(ValueError, match="same n \\+ 1"):
        attention(q, q, q, varlen=Varlen(cu, torch.tensor([0, 2, 4], dtype=torch.int32), 4, 4))


def _batch(d):
    """A fairseq-shaped batch: left-padded source, right-padded target, prev_output_tokens shifted."""
    g = torch.Generator().manual_seed(0)
    B, S, T = 4, 7, 6
    src = torch.randint(d.nspecial, len(d), (B, S), generator=g)
    tgt = torch.randint(d.nspecial, len(d), (B, T), generator=g)
    for i, (ls, lt) in enumerate([(7, 6), (5, 3), (2, 4), (6, 1)]):
        src[i, :S - ls] = d.pad()
        src[i, -1] = d.eos()
        tgt[i, lt:] = d.pad()
        tgt[i, lt - 1] = d.eos()
    prev = torch.full_like(tgt, d.pad())
    prev[:, 0] = d.eos()
    prev[:, 1:] = tgt[:, :-1]
    prev[tgt.eq(d.pad())] = d.pad()
    return src, src.ne(d.pad()).sum(1), prev, tgt


def test_pack_batch_numbers_tokens_as_the_padded_batch():
    from ls_fairseq.fairseq_ext.packing import pack_batch
    from ls_fairseq.modules.positional import make_positions

    d = make_dict()
    src, _, prev, tgt = _batch(d)
    rows = tgt.ne(d.pad()).reshape(-1).nonzero().squeeze(1)
    p = pack_batch(src, prev, tgt, rows, d.pad())
    assert p["cu_src"].tolist() == [0, 7, 12, 14, 20] and p["max_src"] == 7
    assert p["cu_tgt"].tolist() == [0, 6, 9, 13, 14] and p["max_tgt"] == 6
    assert torch.equal(p["src_tokens"][0], src[src.ne(d.pad())])
    assert torch.equal(p["src_positions"][0], make_positions(src, d.pad())[src.ne(d.pad())])
    assert p["src_positions"][0, :7].tolist() == list(range(d.pad() + 1, d.pad() + 8))
    # the counted target rows are the packed decoder-input rows, in order
    assert torch.equal(p["tgt_tokens"][0].index_select(0, p["rows"]), prev.reshape(-1).index_select(0, rows))
    assert p["rows"].tolist() == list(range(14))
    # rows the loss ignores (padding targets, which ls_label_smoothed_cross_entropy adds to round the count
    # up) map to row 0; a counted target token whose decoder input is padding, or a sentence with no
    # tokens: not packable
    fill = tgt.eq(d.pad()).reshape(-1).nonzero().squeeze(1)[:2]
    assert pack_batch(src, prev, tgt, torch.cat([rows, fill]), d.pad())["rows"].tolist() == list(range(14)) + [0, 0]
    odd = tgt.clone()
    odd[1, 4] = 9
    assert pack_batch(src, prev, odd, torch.cat([rows, torch.tensor([10])]), d.pad()) is None
    empty = src.clone()
    empty[1] = d.pad()
    assert pack_batch(empty, prev, tgt, rows, d.pad()) is None
    # built on the host: device tensors are refused by name
    with pytest.raises(ValueError, match="prev_output_tokens is on meta"):
        pack_batch(src, prev.to("meta"), tgt, rows, d.pad())
    # the dtypes the model and the kernels read
    assert p["src_tokens"].dtype == p["tgt_positions"].dtype == p["rows"].dtype == torch.int64
    assert p["cu_src"].dtype == p["cu_tgt"].dtype == torch.int32
    assert isinstance(p["max_src"], int)


@pytest.mark.parametrize("arch", ["ls_transformer_iwslt_de_en", "ls_transformer_wmt_en_de_big_t2t"])
def test_packed_model_forward_gives_the_padded_loss_and_gradients(arch):
    """The whole model (sinusoidal positions, post-LN and pre-LN): the logits of the counted rows, and every
    weight's gradient, equal the padded forward's (float64, dropout off)."""
    from ls_fairseq.fairseq_ext.packing import pack_batch

    d = make_dict()
    torch.manual_seed(0)
    model = build_model(arch, d, encoder_layers=2, decoder_layers=2, encoder_embed_dim=16, decoder_embed_dim=16,
                        encoder_ffn_embed_dim=32, decoder_ffn_embed_dim=32, encoder_attention_heads=4,
                        decoder_attention_heads=4, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        share_all_embeddings=True).double()
    model.train()
    src, lengths, prev, tgt = _batch(d)
    rows = tgt.ne(d.pad()).reshape(-1).nonzero().squeeze(1)
    rows = torch.cat([rows, tgt.eq(d.pad()).reshape(-1).nonzero().squeeze(1)[:2]])  # as counted_rows rounds up
    packed = pack_batch(src, prev, tgt, rows, d.pad())
    target = tgt.reshape(-1).index_select(0, rows)

    def loss_and_grads(**kw):
        model.zero_grad()
        logits, _ = model(src, lengths, prev, logit_rows=rows, **kw)
        loss = F.cross_entropy(logits, target, ignore_index=d.pad())
        loss.backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    ref, ref_grads = loss_and_grads()
    out, grads = loss_and_grads(packed=packed)
    keep = target.ne(d.pad())  # the rows added to round the count up: other logits, ignored by the loss
    torch.testing.assert_close(out[keep], ref[keep])
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, msg=lambda m: f"{n}: {m}")
    with pytest.raises(ValueError, match="another batch"):
        model(src, lengths, prev, logit_rows=rows[:-1], packed=packed)
    with pytest.raises(ValueError, match="with logit_rows"):
        model(src, lengths, prev, packed=packed)


def test_padded_packing_gives_the_same_loss_and_gradients():
    """Rows added as one more sentence of padding tokens and sentences without tokens (fixed shapes for a
    CUDA graph) change nothing the loss sees: the same logits and gradients (up to the rounding of GEMMs
    over more rows)."""
    from ls_fairseq.fairseq_ext.packing import pack_batch, pad_packing

    d = make_dict()
    torch.manual_seed(0)
    model = build_model("ls_transformer_wmt_en_de_big_t2t", d, encoder_layers=2, decoder_layers=2,
                        encoder_embed_dim=16, decoder_embed_dim=16, encoder_ffn_embed_dim=32,
                        decoder_ffn_embed_dim=32, encoder_attention_heads=4, decoder_attention_heads=4,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                        share_all_embeddings=True).double()
    model.train()
    src, lengths, prev, tgt = _batch(d)
    rows = tgt.ne(d.pad()).reshape(-1).nonzero().squeeze(1)
    packed = pack_batch(src, prev, tgt, rows, d.pad())
    grown = pad_packing(packed, 24, 17, 7, d.pad())
    assert grown["src_tokens"].shape == (1, 24) and grown["tgt_tokens"].shape == (1, 17)
    assert grown["cu_src"].tolist() == [0, 7, 12, 14, 20, 24, 24, 24] and grown["max_src"] == 7
    assert grown["cu_tgt"].tolist() == [0, 6, 9, 13, 14, 17, 17, 17]
    target = tgt.reshape(-1).index_select(0, rows)

    def run(p):
        model.zero_grad()
        logits, _ = model(src, lengths, prev, logit_rows=rows, packed=p)
        F.cross_entropy(logits, target).backward()
        return logits.detach(), [q.grad.clone() for q in model.parameters()]

    (a, ga), (b, gb) = run(packed), run(grown)
    torch.testing.assert_close(b, a)
    for x, y in zip(gb, ga):
        torch.testing.assert_close(x, y)
    with pytest.raises(ValueError, match="does not fit"):
        pad_packing(packed, 24, 17, 4, d.pad())
    with pytest.raises(ValueError, match="both sides"):
        pad_packing(packed, 24, 14, 5, d.pad())
