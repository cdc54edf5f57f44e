"""Alignments on the GPU: ls_transformer's attention weights against the native transformer's with the same
weights (fp32, fp16, bf16), and fairseq-generate --print-alignment hard / soft at beam 1 and 5 on one
checkpoint converted with lightseq-convert (the CPU versions: tests/test_alignment.py)."""

import pytest
import torch

from tests._models import build_model, make_dict, random_batch
from tests.gpu._tols import assert_close_to_gold
from tests.test_alignment import checkpoints  # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu

CFG = dict(dropout=0.0, share_all_embeddings=True, encoder_layers=2, decoder_layers=3, encoder_embed_dim=256,
           decoder_embed_dim=256, encoder_ffn_embed_dim=1024, decoder_ffn_embed_dim=1024,
           encoder_attention_heads=4, decoder_attention_heads=4)


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _models(dtype):
    d = make_dict(200)
    torch.manual_seed(0)
    native = build_model("transformer_tiny", d, **CFG).eval()
    ls = build_model("ls_transformer_tiny", d, **CFG).eval()
    ls.load_state_dict(native.state_dict())
    gold = native.cuda().double()  # the fp64 reference of the tolerance rule
    lowp = build_model("transformer_tiny", d, **CFG).eval()
    lowp.load_state_dict(native.state_dict())
    return d, gold, lowp.cuda().to(dtype), ls.cuda().to(dtype)


def _batch(d):
    src, lengths, prev, _ = random_batch(d, B=4, S=23, T=17)
    return src.cuda(), lengths.cuda(), prev.cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layer,heads", [(None, None), (0, 2)])
def test_full_forward_attention_gpu(dtype, layer, heads):
    d, gold, lowp, ls = _models(dtype)
    src, lengths, prev = _batch(d)
    real = prev.ne(d.pad())
    want = gold(src, lengths, prev, alignment_layer=layer, alignment_heads=heads)[1]["attn"][0]
    ref = lowp(src, lengths, prev, alignment_layer=layer, alignment_heads=heads)[1]["attn"][0]
    if layer is None:
        ls.decoder.make_generation_fast_(need_attn=True)
    got = ls(src, lengths, prev, alignment_layer=layer, alignment_heads=heads)[1]["attn"][0]
    assert got.dtype == dtype and got.shape == want.shape
    assert_close_to_gold(got[real], ref[real], want[real], dtype, "alignment weights")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_incremental_attention_gpu(dtype):
    d, gold, lowp, ls = _models(dtype)
    src, lengths, prev = _batch(d)
    keep = prev.ne(d.pad()).all(1)
    src, lengths, prev = src[keep], lengths[keep], prev[keep]
    ls.decoder.make_generation_fast_(need_attn=True)
    encs = [m.encoder(src, lengths) for m in (gold, lowp, ls)]
    states = [{}, {}, {}]
    for t in range(1, prev.shape[1] + 1):
        outs = [m.decoder(prev[:, :t], e, incremental_state=s, alignment_layer=1)[1]["attn"][0]
                for m, e, s in zip((gold, lowp, ls), encs, states)]
        assert_close_to_gold(outs[2], outs[1], outs[0], dtype, f"step {t}")


@pytest.mark.parametrize("beam", [1, 5])
@pytest.mark.parametrize("mode", ["hard", "soft"])
def test_generate_print_alignment_gpu(checkpoints, tmp_path, monkeypatch, beam, mode):  # noqa: F811
    import tests.test_alignment as cpu

    monkeypatch.setattr(cpu, "ALIGN_GEN", [f for f in cpu.ALIGN_GEN if f != "--cpu"])  # on the GPU
    cpu.assert_generated_alignments_match(*checkpoints, tmp_path, beam, mode, atol=1e-4)
