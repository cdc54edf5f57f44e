"""The interface fairseq's generators, scorers, ensembles and tasks call, against the native transformer with
the same weights (CPU, fp32): each entry point of docs/interface.md works as native's, or is refused by name."""

import os
import re

import pytest
import torch

from ls_fairseq.fairseq_ext.config import OptionError
from tests._models import build_model, fairseq_main, make_dict, random_batch
from tests.test_alignment import ALIGN_GEN, _pair, checkpoints  # noqa: F401  (checkpoints: a fixture)

TOL = dict(rtol=1e-5, atol=1e-5)


def _real(d, prev):
    return prev.ne(d.pad())


def test_features_only_and_extract_features():
    d, native, ls = _pair()
    src, lengths, prev, _ = random_batch(d)
    real = _real(d, prev)
    want = native(src, lengths, prev, features_only=True)[0]
    torch.testing.assert_close(ls(src, lengths, prev, features_only=True)[0][real], want[real], **TOL)
    torch.testing.assert_close(ls.extract_features(src, lengths, prev)[0][real],
                               native.extract_features(src, lengths, prev)[0][real], **TOL)
    enc_l, enc_n = ls.encoder(src, lengths), native.encoder(src, lengths)
    # native's positional order: (prev_output_tokens, encoder_out, incremental_state, full_context_alignment, ...)
    torch.testing.assert_close(ls.decoder.extract_features(prev, enc_l, None, False, 1)[1]["attn"][0][real],
                               native.decoder.extract_features(prev, enc_n, None, False, 1)[1]["attn"][0][real],
                               **TOL)


def test_return_all_hiddens():
    d, native, ls = _pair()
    src, lengths, prev, _ = random_batch(d)
    enc_n = native.encoder(src, lengths, return_all_hiddens=True)
    enc_l = ls.encoder(src, lengths, return_all_hiddens=True)
    assert len(enc_l["encoder_states"]) == len(enc_n["encoder_states"]) == 3  # the embedding, then each layer
    keep = src.ne(d.pad()).t().unsqueeze(-1)  # [T, B, 1]: padded source rows are not compared
    for a, b in zip(enc_l["encoder_states"], enc_n["encoder_states"]):
        torch.testing.assert_close(a * keep, b * keep, **TOL)
    assert ls.encoder(src, lengths)["encoder_states"] == []
    states_l = ls(src, lengths, prev, return_all_hiddens=True)[1]["inner_states"]
    states_n = native(src, lengths, prev, return_all_hiddens=True)[1]["inner_states"]
    assert len(states_l) == len(states_n) == 4
    real = _real(d, prev).t()
    for a, b in zip(states_l, states_n):
        torch.testing.assert_close(a[real], b[real], **TOL)


def test_token_embeddings_and_forward_embedding():
    d, native, ls = _pair()
    src, lengths, _, _ = random_batch(d)
    emb = torch.randn(*src.shape, 64)
    want = native.encoder(src, lengths, token_embeddings=emb)["encoder_out"][0]
    got = ls.encoder(src, lengths, token_embeddings=emb)["encoder_out"][0]
    keep = src.ne(d.pad()).t()
    torch.testing.assert_close(got[keep], want[keep], **TOL)
    for a, b in zip(ls.encoder.forward_embedding(src), native.encoder.forward_embedding(src)):
        torch.testing.assert_close(a, b, **TOL)
    with pytest.raises(OptionError, match=r"token_embeddings must be \[batch, length, dim\] of src_tokens"):
        ls.encoder(src, lengths, token_embeddings=emb[:, :-1])


@pytest.mark.parametrize("log_probs", [False, True])
def test_get_normalized_probs(log_probs):
    d, native, ls = _pair()
    src, lengths, prev, _ = random_batch(d)
    real = _real(d, prev)
    p_n = native.get_normalized_probs(native(src, lengths, prev), log_probs=log_probs)
    p_l = ls.get_normalized_probs(ls(src, lengths, prev), log_probs=log_probs)
    torch.testing.assert_close(p_l[real], p_n[real], **TOL)
    if not log_probs:
        torch.testing.assert_close(p_l.sum(-1), torch.ones_like(p_l.sum(-1)))


def test_max_positions():
    _, native, ls = _pair(max_source_positions=77, max_target_positions=55)
    assert ls.max_positions() == native.max_positions() == (77, 55)
    assert ls.max_decoder_positions() == native.max_decoder_positions() == 55
    assert ls.encoder.max_positions() == 77 and ls.decoder.max_positions() == 55


def test_reorder_encoder_out_and_incremental_state():
    """Beam search: the encoder output and the incremental state reordered mid-sentence, as native's."""
    d, native, ls = _pair()
    src, lengths, prev, _ = random_batch(d)
    src, lengths, prev = src[[0, 2]], lengths[[0, 2]], prev[[0, 2]]
    order = torch.tensor([1, 1, 0])
    enc = {}
    state = {"n": {}, "l": {}}
    for name, m in (("n", native), ("l", ls)):
        enc[name] = m.encoder(src, lengths, return_all_hiddens=True)
        m.decoder(prev[:, :2], enc[name], incremental_state=state[name])
        enc[name] = m.encoder.reorder_encoder_out(enc[name], order)
        m.decoder.reorder_incremental_state_scripting(state[name], order)
    torch.testing.assert_close(enc["l"]["encoder_out"][0], enc["n"]["encoder_out"][0], **TOL)
    for a, b in zip(enc["l"]["encoder_states"], enc["n"]["encoder_states"]):
        torch.testing.assert_close(a, b, **TOL)
    prev = prev[order]
    out_n = native.decoder(prev[:, :3], enc["n"], incremental_state=state["n"])[0]
    out_l = ls.decoder(prev[:, :3], enc["l"], incremental_state=state["l"])[0]
    torch.testing.assert_close(out_l, out_n, **TOL)


def test_torchscript_is_refused_by_name():
    _, _, ls = _pair()
    with pytest.raises(OptionError, match=r"TorchScript \(torch.jit.script\)"):
        torch.jit.script(ls)


# ----------------------------------------------------------------------------- fairseq-generate's options
def _gen(data, path, out, flags):
    fairseq_main("generate", [data, "--path", path, *ALIGN_GEN, "--results-path", str(out), *flags])
    with open(os.path.join(str(out), "generate-test.txt"), encoding="utf-8") as f:
        text = f.read()
    hyps = re.findall(r"^H-(\d+)\t(\S+)\t(.*)$", text, flags=re.M)
    assert len(hyps) >= 16, text[-3000:]
    return sorted(hyps)


def _same_hypotheses(a, b, score_tol=1e-4):
    assert [(i, h) for i, _, h in a] == [(i, h) for i, _, h in b]
    for (_, sa, _), (_, sb, _) in zip(a, b):
        assert abs(float(sa) - float(sb)) <= score_tol, (sa, sb)


@pytest.mark.parametrize("flags", [
    ["--beam", "4", "--nbest", "3", "--lenpen", "0.6", "--unkpen", "1"],
    ["--beam", "4", "--prefix-size", "1", "--no-repeat-ngram-size", "2"],
    ["--beam", "4", "--diverse-beam-groups", "2", "--diverse-beam-strength", "0.5"],
    ["--beam", "3", "--match-source-len"],
    ["--score-reference"],
], ids=["nbest-lenpen", "prefix-ngram", "diverse", "match-src-len", "score-reference"])
def test_generate_options_match_native(checkpoints, tmp_path, flags):  # noqa: F811
    data, native, ls = checkpoints
    _same_hypotheses(_gen(data, ls, tmp_path / "l", flags), _gen(data, native, tmp_path / "n", flags))


def test_sampling_is_reproducible(checkpoints, tmp_path):  # noqa: F811
    """--sampling works and --seed repeats it. (Its samples differ from native's at the same seed: fairseq seeds
    before building the model, whose initialisation draws other random numbers than native's.)"""
    data, _, ls = checkpoints
    flags = ["--beam", "3", "--nbest", "3", "--sampling", "--sampling-topk", "3", "--seed", "7"]
    first = _gen(data, ls, tmp_path / "a", flags)
    assert len(first) == 3 * 16 and first == _gen(data, ls, tmp_path / "b", flags)


def test_ensembles_of_several_paths(checkpoints, tmp_path):  # noqa: F811
    """--path a:b of ls models, and of an ls and a native model, average as two native models do."""
    data, native, ls = checkpoints
    flags = ["--beam", "3", "--print-alignment", "soft"]
    want = _gen(data, f"{native}:{native}", tmp_path / "nn", flags)
    _same_hypotheses(_gen(data, f"{ls}:{ls}", tmp_path / "ll", flags), want)
    _same_hypotheses(_gen(data, f"{ls}:{native}", tmp_path / "ln", flags), want)


def test_generate_retain_dropout_is_refused(checkpoints, tmp_path):  # noqa: F811
    data, _, ls = checkpoints
    with pytest.raises(OptionError, match=r"--retain-dropout"):
        _gen(data, ls, tmp_path, ["--retain-dropout"])


def test_hub_interface_from_pretrained(checkpoints):  # noqa: F811
    """fairseq's hub (from_pretrained + translate) on the ls checkpoint gives native's translation."""
    from fairseq.models.transformer import TransformerModel

    from ls_fairseq.fairseq_ext.model import LSTransformerModel

    data, native, ls = checkpoints
    out = {}
    for cls, path in ((TransformerModel, native), (LSTransformerModel, ls)):
        hub = cls.from_pretrained(os.path.dirname(path), checkpoint_file=os.path.basename(path),
                                  data_name_or_path=data, source_lang="en", target_lang="de", beam=3)
        out[cls] = hub.translate(["the cat sees the red car", "old child plays"])
    assert out[LSTransformerModel] == out[TransformerModel] and all(out[TransformerModel])
