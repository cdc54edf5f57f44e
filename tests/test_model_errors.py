"""Bad input gets a clear error naming the limit or the flag, before any kernel runs."""

import pytest
import torch

from tests._models import build_model, make_dict, random_batch

BASE = dict(dropout=0.0, share_all_embeddings=True)


def test_source_longer_than_max_positions():
    d = make_dict()
    m = build_model("ls_transformer_tiny", d, max_source_positions=6, **BASE)
    src, lengths, prev, _ = random_batch(d, S=7)
    with pytest.raises(ValueError, match=r"length 7 exceeds .* maximum of 6 .*--max-source-positions"):
        m(src, lengths, prev)


def test_target_longer_than_max_positions():
    d = make_dict()
    m = build_model("ls_transformer_tiny", d, max_target_positions=4, **BASE)
    src, lengths, prev, _ = random_batch(d, T=5)
    with pytest.raises(ValueError, match=r"length 5 exceeds .* maximum of 4 .*--max-target-positions"):
        m(src, lengths, prev)


def test_unknown_activation():
    with pytest.raises(ValueError, match=r"--activation-fn tanh is not supported .*relu, gelu"):
        build_model("ls_transformer_tiny", make_dict(), activation_fn="tanh", **BASE)


@pytest.mark.parametrize("flag,value", [("dropout", 1.0), ("attention_dropout", -0.1), ("activation_dropout", 1.5)])
def test_dropout_outside_unit_interval(flag, value):
    with pytest.raises(ValueError, match=r"--" + flag.replace("_", "-") + r" probability must be in \[0, 1\)"):
        build_model("ls_transformer_tiny", make_dict(), **{**BASE, flag: value})


def test_hidden_size_not_divisible_by_heads():
    with pytest.raises(ValueError, match=r"--encoder-embed-dim 64 is not divisible by --encoder-attention-heads 3"):
        build_model("ls_transformer_tiny", make_dict(), encoder_attention_heads=3, **BASE)


@pytest.mark.parametrize("flag,value,name", [
    ("encoder_layerdrop", 0.1, "--encoder-layerdrop"),
    ("layernorm_embedding", True, "--layernorm-embedding"),
    ("adaptive_softmax_cutoff", "10,20", "--adaptive-softmax-cutoff"),
    ("quant_noise_scalar", 0.1, "--quant-noise-scalar"),
    ("quant_noise_pq", 0.1, "--quant-noise-pq"),
])
def test_unsupported_flags_are_rejected_by_name(flag, value, name):
    with pytest.raises(ValueError, match=name):
        build_model("ls_transformer_tiny", make_dict(), **{**BASE, flag: value})


def test_dictionary_mismatch_on_checkpoint_load():
    small, big = make_dict(40), make_dict(50)
    sd = build_model("transformer_tiny", small, **BASE).state_dict()
    m = build_model("ls_transformer_tiny", big, **BASE)
    with pytest.raises(ValueError, match=r"source embedding has 44 rows but the source dictionary has 54 entries"):
        m.load_state_dict(sd)


def test_checkpoint_activations_is_honoured():
    d = make_dict()
    torch.manual_seed(0)
    a = build_model("ls_transformer_tiny", d, **BASE)
    b = build_model("ls_transformer_tiny", d, checkpoint_activations=True, **BASE)
    b.load_state_dict(a.state_dict())
    assert b.encoder.checkpoint_activations and b.decoder.checkpoint_activations
    src, lengths, prev, _ = random_batch(d)
    la, lb = a(src, lengths, prev)[0].sum(), b(src, lengths, prev)[0].sum()
    la.backward()
    lb.backward()
    assert torch.allclose(la, lb)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.allclose(pa.grad, pb.grad, atol=1e-6), n


def test_fairseq_train_user_dir_refuses_what_lightseq_train_refuses(data_bin, tmp_path):
    """The refusal lives in the model's build_model: fairseq-train --user-dir stops on the flag before training,
    as lightseq-train does."""
    import os

    from ls_fairseq.fairseq_ext.config import OptionError
    from tests._models import fairseq_main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    flags = [data_bin, "--user-dir", os.path.join(root, "user_dir"), "--arch", "ls_transformer_tiny",
             "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "512", "--max-update", "1", "--cpu",
             "--num-workers", "0", "--save-dir", str(tmp_path), "--no-save"]
    with pytest.raises(OptionError, match=r"--quant-noise-scalar \(quantization noise\) is not supported"):
        fairseq_main("train", flags + ["--quant-noise-scalar", "0.1"])
    with pytest.raises(OptionError, match=r"--encoder-layerdrop \(LayerDrop\) is not supported"):
        fairseq_main("train", flags + ["--encoder-layerdrop", "0.1"])


def test_error_hook_prints_one_line(monkeypatch, capsys):
    import sys

    from ls_fairseq.fairseq_ext.config import OptionError
    from ls_fairseq.fairseq_ext.data_checks import install_error_hook

    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda *a: seen.append(a[0]))
    monkeypatch.setattr(sys, "argv", ["/usr/bin/fairseq-train", "data"])
    install_error_hook()
    install_error_hook()  # idempotent: one hook
    sys.excepthook(OptionError, OptionError("ls_transformer: --quant-noise-scalar is not supported"), None)
    assert capsys.readouterr().err == "fairseq-train: error: ls_transformer: --quant-noise-scalar is not supported\n"
    assert seen == []
    sys.excepthook(KeyError, KeyError("x"), None)  # anything else: the previous hook
    assert seen == [KeyError]
