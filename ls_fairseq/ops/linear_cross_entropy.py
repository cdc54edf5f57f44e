"""The vocabulary projection and the label-smoothed cross-entropy without keeping the logits:
--ls-recompute-logits.

loss, nll = label_smoothed_cross_entropy(h W^T, target), computed over blocks of ``chunk_rows`` rows: each
block's logits [rows, vocab] are made, reduced to the block's loss sums and one fp32 logsumexp per row, and
dropped. The backward makes each block's logits again (one more vocabulary GEMM), turns them into their
gradient in place and takes the block's share of dh = dlogits W and dW += dlogits^T h. Memory held for the
backward: h and the logsumexps instead of [rows, vocab] logits (32 KB per target token for a 32k vocabulary in
fp16, more than a transformer-big layer keeps); at any time at most one block of logits exists.

The same kernels as ls_fairseq/ops/cross_entropy.py on CUDA, the same arithmetic in PyTorch elsewhere. The
gradients are those of the stored path up to the summation order of dW over the blocks (one block: the same
GEMMs). Also returns each row's argmax (for --report-accuracy) without a second pass.

Shapes: h [N, C], weight [V, C], target [N] (int64) -> (loss, nll) fp32 sums, argmax [N] int64.
"""

import torch
import torch.nn.functional as F

from ls_fairseq.ops._checks import up
from ls_fairseq.ops._dispatch import kernel_module

CHUNK_ROWS = 4096  # a block of 4096 x 32k fp16 logits is 256 MB


def _weights(V, epsilon):
    eps_i = epsilon / (V - 1) if V > 1 else 0.0
    return eps_i, 1.0 - epsilon - eps_i


def _fwd_reference(logits, target, epsilon, ignore_index):
    """(loss sum, nll sum, lse [N]) in fp32, as the kernel computes them."""
    lf = up(logits)  # fp32 (fp64 stays fp64)
    lse = torch.logsumexp(lf, dim=-1)
    keep = target.ne(ignore_index)
    safe = target.masked_fill(~keep, 0)
    nll = (lse - lf.gather(1, safe.unsqueeze(1)).squeeze(1)).masked_fill(~keep, 0.0)
    smooth = (lf.shape[-1] * lse - lf.sum(-1)).masked_fill(~keep, 0.0)
    eps_i, w_nll = _weights(lf.shape[-1], epsilon)
    return w_nll * nll.sum() + eps_i * smooth.sum(), nll.sum(), lse


def _bwd_reference(logits, target, lse, g_loss, g_nll, epsilon, ignore_index):
    V = logits.shape[-1]
    eps_i, w_nll = _weights(V, epsilon)
    lf = up(logits)
    gl, gn = g_loss.to(lf.dtype), g_nll.to(lf.dtype)
    p = torch.exp(lf - lse.to(lf.dtype).unsqueeze(1))
    d = p * (gl * (w_nll + V * eps_i) + gn) - gl * eps_i
    keep = target.ne(ignore_index)
    d.scatter_add_(1, target.masked_fill(~keep, 0).unsqueeze(1), (-(gl * w_nll + gn)).expand(target.shape[0], 1))
    return d.masked_fill(~keep.unsqueeze(1), 0.0).to(logits.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, epsilon, ignore_index, chunk_rows, mod):
        N = h.shape[0]
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32  # the kernels: fp32
        lse = torch.empty(N, dtype=acc, device=h.device)
        best = torch.empty(N, dtype=torch.long, device=h.device)
        loss = torch.zeros((), dtype=acc, device=h.device)
        nll = torch.zeros((), dtype=acc, device=h.device)
        for s in range(0, N, chunk_rows):
            e = min(N, s + chunk_rows)
            logits = F.linear(h[s:e], weight)
            if mod is not None:
                lo, nl, lse[s:e] = mod.ls_cross_entropy_fwd(logits, target[s:e], epsilon, ignore_index)
            else:
                lo, nl, lse[s:e] = _fwd_reference(logits, target[s:e], epsilon, ignore_index)
            loss += lo
            nll += nl
            best[s:e] = logits.argmax(1)
            del logits  # before the next block's logits exist: one block at a time
        ctx.save_for_backward(h, weight, target, lse)
        ctx.meta = (float(epsilon), int(ignore_index), int(chunk_rows), mod)
        ctx.mark_non_differentiable(best)
        return loss, nll, best

    @staticmethod
    def backward(ctx, g_loss, g_nll, _g_best):
        h, weight, target, lse = ctx.saved_tensors
        epsilon, ignore_index, chunk_rows, mod = ctx.meta
        zero = torch.zeros((), dtype=torch.float32, device=h.device)
        g_loss = zero if g_loss is None else g_loss.float()
        g_nll = zero if g_nll is None else g_nll.float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = torch.empty_like(h) if need_h else None
        dw = torch.zeros_like(weight) if need_w else None
        for s in range(0, h.shape[0], chunk_rows):
            e = min(h.shape[0], s + chunk_rows)
            logits = F.linear(h[s:e], weight)
            if mod is not None:  # the gradient over the block's logits, in place
                d = mod.ls_cross_entropy_bwd(logits, target[s:e], lse[s:e], g_loss, g_nll, epsilon, ignore_index,
                                             True)
            else:
                d = _bwd_reference(logits, target[s:e], lse[s:e], g_loss, g_nll, epsilon, ignore_index)
            if need_h:
                torch.mm(d, weight, out=dh[s:e])
            if need_w:
                dw.addmm_(d.t(), h[s:e])
            del logits, d
        return dh, dw, None, None, None, None, None


def linear_cross_entropy(h, weight, target, epsilon: float = 0.0, ignore_index: int = -100,
                         chunk_rows: int = CHUNK_ROWS):
    """(loss, nll, argmax) of label_smoothed_cross_entropy(h W^T, target) without keeping the logits."""
    if not (0.0 <= float(epsilon) < 1.0):
        raise ValueError(f"label smoothing must be in [0, 1), got {epsilon}")
    if h.dim() != 2 or weight.dim() != 2 or h.shape[1] != weight.shape[1]:
        raise ValueError(f"linear_cross_entropy: features {tuple(h.shape)} do not match the projection "
                         f"{tuple(weight.shape)} (expected [rows, C] and [vocab, C])")
    if target.shape != h.shape[:1]:
        raise ValueError(f"linear_cross_entropy: target {tuple(target.shape)} does not match {h.shape[0]} rows")
    if chunk_rows < 1:
        raise ValueError(f"linear_cross_entropy: chunk_rows must be >= 1, got {chunk_rows}")
    mod = kernel_module("label_smoothed_cross_entropy", h, weight)
    if mod is not None and h.dtype != weight.dtype:
        mod = None
    return _LinearCrossEntropy.apply(h, weight, target.long(), float(epsilon), int(ignore_index), int(chunk_rows),
                                     mod)
