"""The vocabulary projection and the label-smoothed cross-entropy without the logits (--ls-recompute-logits).

loss, nll = label_smoothed_cross_entropy(h W^T, target), computed over blocks of ``chunk_rows`` rows: each
block's logits [rows, vocab] are made, reduced to the block's loss sums and one fp32 logsumexp per row, and
dropped. The backward makes each block's logits again (one more vocabulary GEMM), turns them into their
gradient in place and takes the block's share of dh = dlogits W and dW += dlogits^T h. Memory held for the
backward: h and the logsumexps instead of [rows, vocab] logits (32 KB per target token for a 32k vocabulary in
fp16, more than a transformer-big layer keeps); at any time at most one block of logits exists.

The same kernels as ls_fairseq/ops/cross_entropy.py on CUDA, the same arithmetic in PyTorch elsewhere; the
gradients are the stored path's up to the summation order of dW over the blocks (docs/memory.md). On request
also each row's argmax (for --report-accuracy), from the same blocks.
Shapes: h [N, C], weight [V, C], target [N] (int64) -> (loss, nll) fp32 sums, argmax [N] int64.
"""

import torch
import torch.nn.functional as F

from ls_fairseq.ops._checks import up
from ls_fairseq.ops._dispatch import kernel_module
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_reference

CHUNK_ROWS = 4096  # a block of 4096 x 32k fp16 logits is 256 MB


def _block_loss(mod, logits, target, epsilon, ignore_index):
    """(loss sum, nll sum, logsumexp per row) of one block: the kernel, or the reference."""
    if mod is not None:
        return mod.ls_cross_entropy_fwd(logits, target, epsilon, ignore_index)
    loss, nll = label_smoothed_cross_entropy_reference(logits, target, epsilon, ignore_index)
    return loss, nll, torch.logsumexp(up(logits), dim=-1)


def _block_grad(mod, logits, target, lse, g_loss, g_nll, epsilon, ignore_index):
    """The gradient over one block's logits: the kernel (written over the logits), or the reference's autograd."""
    if mod is not None:
        return mod.ls_cross_entropy_bwd(logits, target, lse, g_loss, g_nll, epsilon, ignore_index, True)
    with torch.enable_grad():
        leaf = logits.detach().requires_grad_(True)
        loss, nll = label_smoothed_cross_entropy_reference(leaf, target, epsilon, ignore_index)
        (d,) = torch.autograd.grad(loss * g_loss + nll * g_nll, leaf)
    return d


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, epsilon, ignore_index, chunk_rows, mod, want_argmax):
        N = h.shape[0]
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32  # the kernels: fp32
        lse = torch.empty(N, dtype=acc, device=h.device)
        best = torch.empty(N, dtype=torch.long, device=h.device) if want_argmax else None
        loss = torch.zeros((), dtype=acc, device=h.device)
        nll = torch.zeros((), dtype=acc, device=h.device)
        for s in range(0, N, chunk_rows):
            e = min(N, s + chunk_rows)
            logits = F.linear(h[s:e], weight)
            lo, nl, lse[s:e] = _block_loss(mod, logits, target[s:e], epsilon, ignore_index)
            loss += lo
            nll += nl
            if want_argmax:
                best[s:e] = logits.argmax(1)
            del logits  # before the next block's logits exist: one block at a time
        ctx.save_for_backward(h, weight, target, lse)
        ctx.meta = (float(epsilon), int(ignore_index), int(chunk_rows), mod)
        if want_argmax:
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
            d = _block_grad(mod, logits, target[s:e], lse[s:e], g_loss, g_nll, epsilon, ignore_index)
            if need_h:
                torch.mm(d, weight, out=dh[s:e])
            if need_w:
                dw.addmm_(d.t(), h[s:e])
            del logits, d
        return dh, dw, None, None, None, None, None, None


def linear_cross_entropy(h, weight, target, epsilon: float = 0.0, ignore_index: int = -100,
                         chunk_rows: int = CHUNK_ROWS, argmax: bool = False):
    """(loss, nll, each row's argmax or None) of label_smoothed_cross_entropy(h W^T, target) without keeping the
    logits; ``argmax``: also the best token of each row (one more pass over each block)."""
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
                                     mod, bool(argmax))
