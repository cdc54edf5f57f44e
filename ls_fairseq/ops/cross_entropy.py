"""Label-smoothed cross-entropy over the vocabulary, padding ignored.

logits [..., V] (any float dtype), target [...] (int64). Returns (loss, nll_loss), fp32
scalars summed over the non-ignored tokens, with fairseq's label_smoothed_nll_loss
definition: eps_i = epsilon / (V - 1),
loss = (1 - epsilon - eps_i) * nll + eps_i * sum_v(-log p_v).
label_smoothed_cross_entropy_with_grad: the same sums, with the gradient of grad_scale * loss written
over 2-D logits (on CUDA one kernel that reads the logits once).
"""

from typing import Optional

import torch

from ls_fairseq.ops._checks import up
from ls_fairseq.ops._dispatch import kernel_module
from ls_fairseq.ops._kernels import call


def label_smoothed_cross_entropy_reference(logits, target, epsilon: float = 0.0, ignore_index: int = -100):
    V = logits.shape[-1]
    lprobs = torch.log_softmax(up(logits.reshape(-1, V)), dim=-1)
    target = target.reshape(-1)
    keep = target.ne(ignore_index)
    safe_t = target.masked_fill(~keep, 0)
    nll = -lprobs.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1)
    smooth = -lprobs.sum(-1)
    nll = nll.masked_fill(~keep, 0.0).sum()
    smooth = smooth.masked_fill(~keep, 0.0).sum()
    eps_i = epsilon / (V - 1) if V > 1 else 0.0
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return loss, nll


def _check(logits, target, epsilon):
    if not (0.0 <= float(epsilon) < 1.0):
        raise ValueError(f"label smoothing must be in [0, 1), got {epsilon}")
    if logits.shape[:-1] != target.shape:
        raise ValueError(
            f"cross-entropy: logits {tuple(logits.shape)} do not match target {tuple(target.shape)} "
            "(expected logits [..., vocab] and target [...])"
        )


def label_smoothed_cross_entropy(logits, target, epsilon: float = 0.0, ignore_index: int = -100,
                                 reuse_logits: bool = False):
    """``reuse_logits``: the backward may write the gradient over ``logits`` (see _LabelSmoothedCEFn); only
    for logits the caller made for this loss and does not read after the backward."""
    _check(logits, target, epsilon)
    mod = kernel_module("label_smoothed_cross_entropy", logits, target)
    if mod is not None:
        return _LabelSmoothedCEFn.apply(logits, target, epsilon, ignore_index, reuse_logits)
    return label_smoothed_cross_entropy_reference(logits, target, epsilon, ignore_index)


class _LabelSmoothedCEFn(torch.autograd.Function):
    """Saves the logits, targets and one fp32 logsumexp per row; the gradient is in the logits' dtype.

    With ``reuse_logits`` the backward writes the gradient over the logits (their last use) instead of into
    a second [tokens, vocab] buffer: the same values, and the step's peak memory is one vocabulary-sized
    tensor lower. Only for logits nobody reads after the backward (the criterion's own, made by the model's
    forward for this loss); a leaf tensor is never overwritten, and a second backward through the same
    forward (retain_graph=True) is refused."""

    @staticmethod
    def forward(ctx, logits, target, epsilon, ignore_index, reuse_logits):
        V = logits.shape[-1]
        l2 = logits.reshape(-1, V).contiguous()
        t1 = target.reshape(-1).long().contiguous()
        loss, nll, lse = call("ls_cross_entropy_fwd", l2, t1, float(epsilon), int(ignore_index))
        ctx.save_for_backward(l2, t1, lse)
        ctx.meta = (float(epsilon), int(ignore_index), logits.shape)
        ctx.consumed = False
        ctx.reuse = bool(reuse_logits) and logits.grad_fn is not None
        return loss, nll

    @staticmethod
    def backward(ctx, g_loss, g_nll):
        if ctx.consumed:
            raise RuntimeError("label_smoothed_cross_entropy: a second backward through one forward is not "
                               "supported with reuse_logits=True (the gradient overwrote the logits)")
        l2, t1, lse = ctx.saved_tensors
        ctx.consumed = ctx.reuse
        eps, ignore_index, shape = ctx.meta
        args = (l2, t1, lse, g_loss, g_nll, eps, ignore_index)
        if ctx.reuse and not torch.compiler.is_compiling():  # (the custom op's schema returns a new tensor)
            d = call("ls_cross_entropy_bwd", *args, True)
        else:
            d = call("ls_cross_entropy_bwd", *args)
        return d.view(shape), None, None, None, None


def grad_scale_tensor(grad_scale, device: Optional[torch.device] = None):
    """``grad_scale`` of :func:`label_smoothed_cross_entropy_with_grad` (None, a number or a 1-element tensor) as
    None or a tensor of shape [1]; with ``device``, float32 there (what the loss kernels read)."""
    if grad_scale is None:
        return None
    if not isinstance(grad_scale, torch.Tensor):
        grad_scale = torch.tensor([float(grad_scale)])
    if grad_scale.numel() != 1:
        raise ValueError(f"cross-entropy with grad: grad_scale must have 1 element, got shape "
                         f"{tuple(grad_scale.shape)}")
    grad_scale = grad_scale.reshape(1)
    return grad_scale if device is None else grad_scale.to(device, torch.float32)


def label_smoothed_cross_entropy_with_grad(logits, target, epsilon: float = 0.0, ignore_index: int = -100,
                                           grad_scale=None):
    """Loss and gradient in one call, for a caller whose only backward through the loss is ``grad_scale * loss``
    (the training step's head). ``logits`` [tokens, vocab] (contiguous) are overwritten with
    d(grad_scale * loss)/dlogits in their own dtype; returns (loss, nll) as label_smoothed_cross_entropy does
    (fp32 sums; fp64 for fp64 logits). ``grad_scale``: None (1), a number, or a 1-element tensor (read on the
    device by the kernel). Not an autograd op: nothing is recorded, ``logits`` need no history.

    On CUDA the kernel reads each row once and writes its gradient over it (ls_cross_entropy_fwd_bwd);
    otherwise the reference runs under autograd on the detached logits (upcast), and the gradient is
    copied over them."""
    if logits.dim() != 2:
        raise ValueError(f"cross-entropy with grad: logits must be 2-D [tokens, vocab], got shape "
                         f"{tuple(logits.shape)}")
    _check(logits, target, epsilon)
    if logits.shape[1] < 1:
        raise ValueError("cross-entropy with grad: the vocabulary must not be empty")
    if not logits.is_contiguous():
        raise ValueError("cross-entropy with grad: logits must be contiguous (the gradient is written over them)")
    grad_scale = grad_scale_tensor(grad_scale)
    with torch.no_grad():
        mod = kernel_module("label_smoothed_cross_entropy", logits, target)
        if mod is not None:
            gs = grad_scale_tensor(grad_scale, logits.device)
            t1 = target.long().contiguous()
            loss, nll = call("ls_cross_entropy_fwd_bwd", logits, t1, float(epsilon), int(ignore_index), gs)
            return loss, nll
        with torch.enable_grad():
            x = up(logits.detach()).requires_grad_(True)
            loss, nll = label_smoothed_cross_entropy_reference(x, target, epsilon, ignore_index)
            (g,) = torch.autograd.grad(loss, x)
        if grad_scale is not None:
            g = g * grad_scale.to(g.device, g.dtype).reshape(())
        logits.copy_(g)
        return loss.detach(), nll.detach()
