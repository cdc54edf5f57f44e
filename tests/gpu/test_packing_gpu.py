"""Packed batches on the GPU: the attention kernels over packed sentences against attention per sentence,
their dropout's backward against its forward, and the packed ls_transformer against the padded one (C++
layers, fused kernels)."""

import pytest
import torch
import torch.nn.functional as F

from tests._models import build_model, make_dict
from tests.test_packing import _batch, _cu

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_packed_attention_kernel_matches_attention_per_sentence(dtype, causal):
    from ls_fairseq.ops import attention
    from ls_fairseq.ops.attention import Varlen

    torch.manual_seed(0)
    lq = [37, 1, 64, 5, 120]
    lk = lq if causal else [20, 3, 64, 77, 9]
    H, D = 4, 64

    def leaf(n):
        return torch.randn(1, H, n, D, device="cuda", dtype=dtype).requires_grad_(True)

    q, k, v = leaf(sum(lq)), leaf(sum(lk)), leaf(sum(lk))
    out = attention(q, k, v, causal=causal, varlen=Varlen(_cu(lq).cuda(), _cu(lk).cuda(), max(lq), max(lk)))
    assert out.shape == q.shape
    gy = torch.randn_like(out)
    grads = torch.autograd.grad((out * gy).sum(), [q, k, v])
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=3e-3, rtol=3e-3)
    for i in range(len(lq)):
        sl, kl = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        qi, ki, vi = (t.detach()[:, :, s].float().requires_grad_(True) for t, s in ((q, sl), (k, kl), (v, kl)))
        ref = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal)
        torch.testing.assert_close(out[:, :, sl].float(), ref, **tol)
        rg = torch.autograd.grad((ref * gy[:, :, sl].float()).sum(), [qi, ki, vi])
        for g, r, s in zip(grads, rg, (sl, kl, kl)):
            torch.testing.assert_close(g[:, :, s].float(), r, **tol)


def test_packed_attention_dropout_is_random_and_reproducible():
    from ls_fairseq.ops import attention
    from ls_fairseq.ops.attention import Varlen

    lq = [30, 7, 50]
    cu = _cu(lq).cuda()
    q = torch.randn(1, 4, sum(lq), 64, device="cuda", dtype=torch.float16)

    def run(seed):
        torch.manual_seed(seed)
        return attention(q, q, q, p=0.3, varlen=Varlen(cu, cu, 50, 50))

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.isfinite(a).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("graphed", [False, True])
def test_packed_attention_dropout_backward_replays_the_forward_mask(dtype, causal, graphed):
    """With dropout the output is linear in V, O = drop(P) V, so sum(V * dL/dV) = sum(O * dL/dO) exactly when
    the backward applies the mask the forward drew; eagerly and as a CUDA-graph replay (fresh masks each
    replay). A kernel whose backward draws another mask misses it by tens of percent."""
    from ls_fairseq.ops import attention
    from ls_fairseq.ops.attention import Varlen

    torch.manual_seed(0)
    lq = [37, 64, 5, 90, 12]
    lk = lq if causal else [20, 3, 64, 77, 9]
    vl = Varlen(_cu(lq).cuda(), _cu(lk).cuda(), max(lq), max(lk))
    q = torch.randn(1, 8, sum(lq), 64, device="cuda", dtype=dtype)
    k = torch.randn(1, 8, sum(lk), 64, device="cuda", dtype=dtype)
    v = torch.randn(1, 8, sum(lk), 64, device="cuda", dtype=dtype, requires_grad=True)
    gy = torch.randn(1, 8, sum(lq), 64, device="cuda", dtype=dtype)

    def step():
        v.grad = None
        out = attention(q, k, v, causal=causal, p=0.3, varlen=vl)
        out.backward(gy)
        return out.detach(), v.grad

    def check(out, dv):
        terms = out.float() * gy.float()
        b = (v.detach().float() * dv.float()).sum()
        # rounding moves the two sums by well under 1% of the terms' norm; another mask, by about all of it
        torch.testing.assert_close(b, terms.sum(), rtol=0, atol=0.05 * float(terms.norm()))

    if not graphed:
        check(*step())
        return
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, dv = step()
    seen = []
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        check(out, dv)
        seen.append(out.clone())
    assert not torch.equal(seen[0], seen[1])  # each replay draws a fresh mask


def _cuda(packed):
    """A packing's tensors on the GPU (its host numbers as they are)."""
    return {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in packed.items()}


def _small_model(dtype, attention_dropout=0.0):
    """A two-layer pre-LN ls_transformer on the GPU in ``dtype``, dropout off (but ``attention_dropout``),
    training mode."""
    d = make_dict(300)
    torch.manual_seed(0)
    model = build_model("ls_transformer_wmt_en_de_big_t2t", d, encoder_layers=2, decoder_layers=2,
                        encoder_embed_dim=256, decoder_embed_dim=256, encoder_ffn_embed_dim=1024,
                        decoder_ffn_embed_dim=1024, encoder_attention_heads=4, decoder_attention_heads=4,
                        dropout=0.0, attention_dropout=attention_dropout, activation_dropout=0.0,
                        share_all_embeddings=True).cuda().to(dtype)
    model.train()
    return d, model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_model_matches_the_padded_model_on_the_gpu(dtype):
    """The packed forward and backward (C++ layers, the kernels over packed sentences) against the padded
    one: the counted logits within the dtype's rounding and every gradient. In fp32 the gradients match
    elementwise; in bf16 both paths round differently (other GEMM shapes, other attention kernels) and on this
    small batch one rounding can flip a ReLU, so each bf16 gradient is held to the fp32 model's: the packed one
    may be at most twice as far from it (relative L2) as the padded one is. A padded position leaking into the
    packed sums would move whole gradients, far beyond that."""
    from ls_fairseq.fairseq_ext.packing import pack_batch

    d, model = _small_model(dtype)
    src, lengths, prev, tgt = _batch(d)
    rows = tgt.ne(d.pad()).reshape(-1).nonzero().squeeze(1)
    rows = torch.cat([rows, tgt.eq(d.pad()).reshape(-1).nonzero().squeeze(1)[:2]])
    packed = pack_batch(src, prev, tgt, rows, d.pad())
    packed = _cuda(packed)
    target = tgt.reshape(-1).index_select(0, rows).cuda()
    src, lengths, prev, rows = src.cuda(), lengths.cuda(), prev.cuda(), rows.cuda()

    def run(m, **kw):
        m.zero_grad()
        logits, _ = m(src, lengths, prev, logit_rows=rows, **kw)
        F.cross_entropy(logits.float(), target, ignore_index=d.pad(), reduction="sum").backward()
        return logits.detach().float(), {n: p.grad.float().clone() for n, p in m.named_parameters()}

    ref, ref_grads = run(model)
    out, grads = run(model, packed=packed)
    keep = target.ne(d.pad())
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(out[keep], ref[keep], **tol)
    if dtype == torch.float32:
        for n, g in ref_grads.items():
            scale = g.abs().max().clamp_min(1e-6)
            torch.testing.assert_close(grads[n] / scale, g / scale, **tol, msg=lambda m: f"{n}: {m}")
        return
    _, exact = run(_small_model(torch.float32)[1])  # the same weights in fp32
    for n, g in exact.items():
        norm = g.norm().clamp_min(1e-9)
        padded_err = ((ref_grads[n] - g).norm() / norm).item()
        packed_err = ((grads[n] - g).norm() / norm).item()
        assert packed_err <= max(2 * padded_err, 0.02), f"{n}: packed {packed_err:.4f} vs padded {padded_err:.4f}"


def test_packed_step_under_cuda_graph_capture():
    """A packed forward and backward grown to fixed sizes (one sentence of padding rows, sentences without
    tokens) is captured as a CUDA graph (no host syncs), and its replay gives the loss and gradients of the
    eager packed step of the batch as it came."""
    from ls_fairseq.fairseq_ext.packing import pack_batch, pad_packing

    d, model = _small_model(torch.bfloat16)
    src, lengths, prev, tgt = _batch(d)
    rows = tgt.ne(d.pad()).reshape(-1).nonzero().squeeze(1)
    packed = pack_batch(src, prev, tgt, rows, d.pad())
    target = tgt.reshape(-1).index_select(0, rows).cuda()
    src, lengths, prev = src.cuda(), lengths.cuda(), prev.cuda()

    def step(p):
        logits, _ = model(src, lengths, prev, logit_rows=p["rows"], packed=p)
        loss = F.cross_entropy(logits.float(), target, reduction="sum")
        loss.backward()
        return loss

    ref = step(_cuda(packed)).detach()
    ref_grads = [q.grad.clone() for q in model.parameters()]
    grown = _cuda(pad_packing(packed, 29, 21, 8, d.pad()))
    model.zero_grad(set_to_none=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the capture
        step(grown)
        model.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss = step(grown)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(loss, ref, rtol=1e-3, atol=1e-3)
    for q, g in zip(model.parameters(), ref_grads):
        torch.testing.assert_close(q.grad, g, rtol=2e-2, atol=2e-2)


def test_packed_fp32_refuses_attention_dropout():
    """fp32 over packed sequences has no CUDA kernel whose dropout backward is right: the op and the model (its
    C++ layer calls) refuse attention dropout by name instead of training on wrong gradients; without dropout
    (evaluation) the same model runs."""
    from ls_fairseq.fairseq_ext.packing import pack_batch
    from ls_fairseq.ops import attention
    from ls_fairseq.ops.attention import Varlen

    cu = _cu([5, 9]).cuda()
    q = torch.randn(1, 2, 14, 16, device="cuda")
    with pytest.raises(ValueError, match="need fp16 or bf16"):
        attention(q, q, q, p=0.1, varlen=Varlen(cu, cu, 9, 9))
    d, model = _small_model(torch.float32, attention_dropout=0.1)
    src, lengths, prev, tgt = _batch(d)
    rows = tgt.ne(d.pad()).reshape(-1).nonzero().squeeze(1)
    packed = _cuda(pack_batch(src, prev, tgt, rows, d.pad()))
    src, lengths, prev = src.cuda(), lengths.cuda(), prev.cuda()
    with pytest.raises((ValueError, RuntimeError), match="need fp16 or bf16"):
        model(src, lengths, prev, logit_rows=packed["rows"], packed=packed)
    model.eval()
    logits, _ = model(src, lengths, prev, logit_rows=packed["rows"], packed=packed)
    assert torch.isfinite(logits).all()

