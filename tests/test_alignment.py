"""Alignments: ls_transformer's decoder returns fairseq's attention weights when asked (CPU, fp32).

Against the native transformer with the same weights: the chosen layer's cross-attention averaged over the
chosen heads, in a full forward, with full_context_alignment and in incremental decoding; by fairseq-generate
and fairseq-interactive --print-alignment (hard and soft, beam 1 and 5) on one checkpoint converted with
lightseq-convert. Without a request no weights are formed."""

import os
import re

import pytest
import torch

from ls_fairseq.fairseq_ext.config import OptionError
from ls_fairseq.modules.decoder_layer import DecoderLayer
from tests._models import build_model, make_dict, random_batch

BASE = dict(dropout=0.0, share_all_embeddings=True, encoder_layers=2, decoder_layers=3)


def _pair(**kw):
    d = make_dict()
    torch.manual_seed(0)
    native = build_model("transformer_tiny", d, **{**BASE, **kw}).eval()
    ls = build_model("ls_transformer_tiny", d, **{**BASE, **kw}).eval()
    ls.load_state_dict(native.state_dict())
    return d, native, ls


@pytest.mark.parametrize("kw", [dict(), dict(encoder_normalize_before=True, decoder_normalize_before=True)],
                         ids=["postLN", "preLN"])
@pytest.mark.parametrize("layer,heads", [(None, None), (0, None), (1, 1), (2, 3)])
def test_full_forward_attention_matches_native(kw, layer, heads):
    d, native, ls = _pair(**kw)
    src, lengths, prev, _ = random_batch(d)
    want = native(src, lengths, prev, alignment_layer=layer, alignment_heads=heads)[1]["attn"][0]
    if layer is None and heads is None:
        ls.decoder.make_generation_fast_(need_attn=True)  # what --print-alignment sets
    got = ls(src, lengths, prev, alignment_layer=layer, alignment_heads=heads)[1]["attn"][0]
    assert got.shape == want.shape == (3, 5, 7)
    real = prev.ne(d.pad())  # padded target rows: fairseq never reads them (and masks their keys differently)
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-6)
    assert torch.all(got[0, :, -2:] == 0)  # the padded source positions get no weight


def test_full_context_alignment_matches_native():
    d, native, ls = _pair()
    src, lengths, prev, _ = random_batch(d)
    x_n, e_n = native.decoder(prev, native.encoder(src, lengths), features_only=True, full_context_alignment=True,
                              alignment_layer=1)
    x_l, e_l = ls.decoder(prev, ls.encoder(src, lengths), features_only=True, full_context_alignment=True,
                          alignment_layer=1)
    # padded target rows hold what attention over padding gives; fairseq never reads them
    real = prev.ne(d.pad())
    torch.testing.assert_close(x_l[real], x_n[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(e_l["attn"][0][real], e_n["attn"][0][real], rtol=1e-5, atol=1e-6)
    causal = ls.decoder(prev, ls.encoder(src, lengths), features_only=True)[0]
    assert not torch.allclose(causal[real], x_l[real], atol=1e-3)  # the mask was really off


@pytest.mark.parametrize("layer,heads", [(None, None), (0, 2)])
def test_incremental_attention_matches_native(layer, heads):
    d, native, ls = _pair()
    src, lengths, prev, _ = random_batch(d)
    prev = prev[[0, 2]]  # rows without target padding, as beam search feeds them
    src, lengths = src[[0, 2]], lengths[[0, 2]]
    ls.decoder.make_generation_fast_(need_attn=True)
    enc_n, enc_l = native.encoder(src, lengths), ls.encoder(src, lengths)
    state_n, state_l = {}, {}
    for t in range(1, prev.shape[1] + 1):
        kw = dict(alignment_layer=layer, alignment_heads=heads)
        lp_n, ex_n = native.decoder(prev[:, :t], enc_n, incremental_state=state_n, **kw)
        lp_l, ex_l = ls.decoder(prev[:, :t], enc_l, incremental_state=state_l, **kw)
        torch.testing.assert_close(lp_l, lp_n, rtol=1e-5, atol=1e-5)
        assert ex_l["attn"][0].shape == (2, 1, 7)
        torch.testing.assert_close(ex_l["attn"][0], ex_n["attn"][0], rtol=1e-5, atol=1e-6)


def test_no_attention_weights_unless_asked(monkeypatch):
    """Training and plain decoding keep the fused layers: the weights are neither formed nor returned."""
    d, _, ls = _pair()
    src, lengths, prev, _ = random_batch(d)

    def refuse(*a, **k):
        raise AssertionError("attention weights formed without a request")

    monkeypatch.setattr(DecoderLayer, "forward_with_attn", refuse)
    assert ls(src, lengths, prev)[1]["attn"] == [None]
    enc = ls.encoder(src, lengths)
    assert ls.decoder(prev[:, :1], enc, incremental_state={})[1]["attn"] == [None]
    ls.decoder.make_generation_fast_(need_attn=True)
    ls.train()  # need_attn is for inference, as fairseq's layers read it
    assert ls(src, lengths, prev)[1]["attn"] == [None]


@pytest.mark.parametrize("kwargs,match", [
    (dict(alignment_layer=3), r"alignment_layer 3 is out of range: the decoder has 3 layers"),
    (dict(alignment_layer=-1), r"alignment_layer -1 is out of range"),
    (dict(alignment_heads=0), r"alignment_heads must be >= 1, got 0"),
])
def test_bad_alignment_arguments_are_named(kwargs, match):
    d, _, ls = _pair()
    src, lengths, prev, _ = random_batch(d)
    with pytest.raises(OptionError, match=match):
        ls(src, lengths, prev, **kwargs)


def test_retain_dropout_is_refused():
    _, _, ls = _pair()
    with pytest.raises(OptionError, match=r"--retain-dropout"):
        ls.decoder.make_generation_fast_(need_attn=False, retain_dropout=True)


# ----------------------------------------------------------------------------- the commands, end to end
ALIGN_GEN = ["--max-tokens", "2000", "--required-batch-size-multiple", "1", "--num-workers", "0", "--cpu"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A native transformer_tiny trained a few updates by fairseq-train, and the same weights converted to
    ls_transformer_tiny by lightseq-convert; with the data they were trained on."""
    from tests.test_convert import _convert, _train

    root = tmp_path_factory.mktemp("align")
    data = _make_data(root)
    native = _train(True, data, str(root / "native"))
    ls = str(root / "ls.pt")
    _convert(native, ls, "ls")
    return data, native, ls


def _make_data(root):
    import random

    from ls_fairseq.fairseq_ext.compat import patch_checkpoint_loading
    from tests._models import preprocess
    from tests.test_convert import WORDS

    rng = random.Random(3)
    for split, n in (("train", 200), ("valid", 20), ("test", 16)):
        src = [" ".join(rng.choices(WORDS, k=rng.randint(3, 9))) for _ in range(n)]
        (root / f"{split}.en").write_text("".join(s + "\n" for s in src))
        (root / f"{split}.de").write_text("".join(" ".join(reversed(s.split())) + "\n" for s in src))
    patch_checkpoint_loading()
    return preprocess(root, root / "bin", src="en", tgt="de")


def _generate(data, path, out, flags):
    from tests._models import fairseq_main

    fairseq_main("generate", [data, "--path", path, *ALIGN_GEN, "--results-path", str(out), *flags])
    with open(os.path.join(str(out), "generate-test.txt"), encoding="utf-8") as f:
        text = f.read()
    hyps = dict(re.findall(r"^H-(\d+)\t\S+\t(.*)$", text, flags=re.M))
    aligns = dict(re.findall(r"^A-(\d+)\t(.*)$", text, flags=re.M))
    assert len(hyps) == 16 and sorted(aligns) == sorted(hyps), text[-3000:]
    return hyps, aligns


def _hard_agreement(a, b):
    """The fraction of target tokens whose hard alignments (the source positions) agree."""
    def by_target(s):
        out = {}
        for pair in s.split():
            i, j = pair.split("-")
            out.setdefault(int(j), set()).add(int(i))
        return out

    same = total = 0
    for k in a:
        ta, tb = by_target(a[k]), by_target(b[k])
        for j in set(ta) | set(tb):
            total += 1
            same += ta.get(j) == tb.get(j)
    return same / max(total, 1), total


@pytest.mark.parametrize("beam", [1, 5])
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_generate_print_alignment_matches_native(checkpoints, tmp_path, beam, mode):
    assert_generated_alignments_match(*checkpoints, tmp_path, beam, mode, atol=2e-5)


def assert_generated_alignments_match(data, native, ls, tmp_path, beam, mode, atol):
    """fairseq-generate --print-alignment ``mode`` at ``beam`` on the native and the ls weights: the same
    hypotheses, hard alignments agreeing on >= 99% of target tokens, soft ones within ``atol``."""
    flags = ["--beam", str(beam), "--print-alignment", mode]
    hyps_n, al_n = _generate(data, native, tmp_path / "native", flags)
    hyps_l, al_l = _generate(data, ls, tmp_path / "ls", flags)
    assert hyps_l == hyps_n
    if mode == "hard":
        agree, total = _hard_agreement(al_l, al_n)
        assert total > 50 and agree >= 0.99, agree
    else:
        for k in al_n:
            rows_n = [[float(p) for p in row.split(",")] for row in al_n[k].split()]
            rows_l = [[float(p) for p in row.split(",")] for row in al_l[k].split()]
            torch.testing.assert_close(torch.tensor(rows_l), torch.tensor(rows_n), rtol=0, atol=atol)


def test_lightseq_generate_and_score_reference_print_alignment(checkpoints, tmp_path):
    """lightseq-generate --print-alignment, and fairseq-generate --score-reference --print-alignment, on ls."""
    from ls_fairseq.cli import generate
    from tests._models import fairseq_run

    data, native, ls = checkpoints
    flags = [data, "--path", ls, *ALIGN_GEN, "--beam", "2", "--print-alignment", "hard"]
    with fairseq_run():
        generate.cli_main([*flags, "--results-path", str(tmp_path / "a")])
    text = open(os.path.join(str(tmp_path / "a"), "generate-test.txt"), encoding="utf-8").read()
    assert len(re.findall(r"^A-\d+\t\d+-\d+", text, flags=re.M)) == 16
    _, al_n = _generate(data, native, tmp_path / "n", ["--score-reference", "--print-alignment", "hard"])
    _, al_l = _generate(data, ls, tmp_path / "l", ["--score-reference", "--print-alignment", "hard"])
    agree, total = _hard_agreement(al_l, al_n)
    assert total > 50 and agree >= 0.99, agree


def test_interactive_print_alignment_matches_native(checkpoints, monkeypatch, capsys):
    import io
    import sys

    from tests._models import fairseq_main

    data, native, ls = checkpoints
    lines = "the cat sees the red car\nold child plays\n"
    out = {}
    for name, path in (("native", native), ("ls", ls)):
        monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
        capsys.readouterr()
        fairseq_main("interactive", [data, "--path", path, "--cpu", "--beam", "3", "--print-alignment",
                                     "--source-lang", "en", "--target-lang", "de"])
        out[name] = re.findall(r"^A-(\d+)\t(.*)$", capsys.readouterr().out, flags=re.M)
    assert len(out["ls"]) == 2 and out["ls"] == out["native"]
