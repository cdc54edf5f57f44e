"""Adam / AdamW update over flat fp32 master buffers, and the flat gradient norm.

All buffers are 1-D and the same length: param (fp32 master), exp_avg, exp_avg_sq (fp32),
grad (fp32/fp16/bf16), and optionally param_lp, a low-precision copy of param that is
rewritten after the update. ``grad_scale`` multiplies the gradient first (loss-scale
unscale and clip coefficient folded into one factor). mode="fairseq": fairseq's Adam;
mode="torch": torch.optim.AdamW's formula.

Skipping a step on overflow on the host or on the device (``skip_if_nonfinite``,
``grad_scale_tensor``), the peer copy of the weights (``param_lp_peer``), the norm in the
update's own pass (``with_norm``), the split master (``param_lo``) and ``ranges`` are described
in docs/optimizer.md, section "The adam_ op".
"""

import math

import torch

from ls_fairseq.ops._dispatch import kernel_module
from ls_fairseq.ops._kernels import call

MODES = ("fairseq", "torch")


_CHUNK = 1 << 22  # elements per piece in split_master / join_master (their int64 temporaries stay small)


def split_master(master: torch.Tensor, out=None):
    """(bf16 weights, int16 remainders) holding the fp32 ``master`` exactly (module docstring): the weights are the
    master rounded to nearest with ties away from zero (0x8000 added to its bit pattern, the upper 16 bits kept), the
    remainders ``bits(master) - (bits(weights) << 16)``, which lie in [-0x8000, 0x7fff]. ``out``: (weights,
    remainders) tensors of the master's size to write instead of new ones."""
    if master.dtype != torch.float32:
        raise ValueError(f"split_master: the master must be float32, got {master.dtype}")
    flat = master.contiguous().view(-1)
    if out is None:
        out = (torch.empty(master.shape, dtype=torch.bfloat16, device=master.device),
               torch.empty(master.shape, dtype=torch.int16, device=master.device))
    w, r = (t.view(-1) for t in out)
    for a in range(0, flat.numel(), _CHUNK):
        bits = flat[a:a + _CHUNK].view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # the unsigned bit pattern
        hi = (bits + 0x8000) >> 16  # 0 .. 0x10000 (0x10000 only from NaN patterns, which wrap)
        r[a:a + _CHUNK] = (bits - (hi << 16)).to(torch.int16)
        hi = hi & 0xFFFF
        w[a:a + _CHUNK] = torch.where(hi >= 0x8000, hi - 0x10000, hi).to(torch.int16).view(torch.bfloat16)
    return out


def join_master(weights: torch.Tensor, lo: torch.Tensor, out=None) -> torch.Tensor:
    """The fp32 master that (bf16 ``weights``, int16 ``lo``) hold (:func:`split_master`): ``out`` (an fp32 tensor of
    their size, on any device) or a new tensor on their device."""
    if weights.dtype != torch.bfloat16 or lo.dtype != torch.int16 or weights.shape != lo.shape:
        raise ValueError(f"join_master: expected bf16 weights and int16 remainders of one shape, got {weights.dtype} "
                         f"{tuple(weights.shape)} and {lo.dtype} {tuple(lo.shape)}")
    if out is None:
        out = torch.empty(weights.shape, dtype=torch.float32, device=weights.device)
    w, r, o = weights.contiguous().view(-1), lo.contiguous().view(-1), out.view(-1)
    for a in range(0, w.numel(), _CHUNK):
        hi = w[a:a + _CHUNK].view(torch.int16).to(torch.int64) & 0xFFFF
        bits = ((hi << 16) + r[a:a + _CHUNK].to(torch.int64)) & 0xFFFFFFFF
        bits = torch.where(bits >= 0x80000000, bits - 0x100000000, bits).to(torch.int32)
        o[a:a + _CHUNK] = bits.view(torch.float32)
    return out


def adam_reference_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                    grad_scale=1.0, param_lp=None, mode="fairseq", skip_if_nonfinite=None, grad_scale_tensor=None,
                    param_lp_peer=None, ranges=None, param_lo=None):
    if skip_if_nonfinite is not None and not bool(torch.isfinite(skip_if_nonfinite)):
        return
    if param_lo is not None:  # a split master: update it whole in fp32, then split it again
        if grad_scale_tensor is not None and not math.isfinite(float(grad_scale_tensor)):
            return  # skipped: nothing is written
        hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step,
                  grad_scale=grad_scale, mode=mode, grad_scale_tensor=grad_scale_tensor)
        for lo, hi in (ranges if ranges is not None else [(0, param.numel())]):
            master = join_master(param[lo:hi], param_lo[lo:hi])
            adam_reference_(master, grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], **hp)
            split_master(master, out=(param[lo:hi], param_lo[lo:hi]))
            if param_lp_peer is not None:
                param_lp_peer[lo:hi].copy_(param[lo:hi])
        return
    if ranges is not None:
        for lo, hi in ranges:
            adam_reference_(*(t[lo:hi] for t in (param, grad, exp_avg, exp_avg_sq)), lr=lr, beta1=beta1,
                            beta2=beta2, eps=eps, weight_decay=weight_decay, step=step, grad_scale=grad_scale,
                            param_lp=None if param_lp is None else param_lp[lo:hi], mode=mode,
                            grad_scale_tensor=grad_scale_tensor,
                            param_lp_peer=None if param_lp_peer is None else param_lp_peer[lo:hi])
        return
    if grad_scale_tensor is not None:
        factor = float(grad_scale_tensor)
        if not math.isfinite(factor):
            return
        grad_scale = float(torch.tensor(grad_scale, dtype=torch.float32) * torch.tensor(factor, dtype=torch.float32))
    g = grad.float()
    if grad_scale != 1.0:
        g = g * grad_scale
    exp_avg.mul_(beta1).add_(g, alpha=1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bc1 = 1 - beta1 ** step
    bc2 = 1 - beta2 ** step
    if mode == "fairseq":
        denom = exp_avg_sq.sqrt().add_(eps)
        step_size = lr * math.sqrt(bc2) / bc1
        if weight_decay != 0:
            param.add_(param, alpha=-weight_decay * lr)
        param.addcdiv_(exp_avg, denom, value=-step_size)
    else:
        param.mul_(1 - lr * weight_decay)
        denom = (exp_avg_sq.sqrt() / math.sqrt(bc2)).add_(eps)
        param.addcdiv_(exp_avg, denom, value=-lr / bc1)
    if param_lp is not None:
        param_lp.copy_(param)
    if param_lp_peer is not None:
        param_lp_peer.copy_(param)


def check_ranges(ranges, *buffers):
    """``ranges`` as a flat list [lo0, hi0, lo1, hi1, ...] after checking that they are ascending, disjoint
    (lo, hi) pairs inside the buffers, which must be 1-D (None entries are skipped); None stays None."""
    if ranges is None:
        return None
    for t in buffers:
        if t is not None and t.dim() != 1:
            raise ValueError(f"ranges index 1-D flat buffers; got a buffer of shape {tuple(t.shape)}")
    n = buffers[0].numel()
    flat, prev = [], 0
    for r in ranges:
        try:
            lo, hi = (int(x) for x in r)
        except (TypeError, ValueError):
            raise ValueError(f"ranges must be (lo, hi) pairs, got {r!r}") from None
        if not 0 <= lo <= hi <= n:
            raise ValueError(f"range [{lo}, {hi}) is not inside the {n} elements of the buffers")
        if lo < prev:
            raise ValueError(f"ranges must be ascending and disjoint: [{lo}, {hi}) starts before the previous range "
                             f"ends at {prev}")
        flat += (lo, hi)
        prev = hi
    return flat


def _check(param, grad, exp_avg, exp_avg_sq, param_lp, mode, step, param_lp_peer=None, param_lo=None):
    if mode not in MODES:
        raise ValueError(f"adam mode must be one of {MODES}, got {mode!r}")
    if step < 1:
        raise ValueError(f"adam step must be >= 1, got {step}")
    n = param.numel()
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("param_lp", param_lp),
                    ("param_lp_peer", param_lp_peer), ("param_lo", param_lo)):
        if t is not None and t.numel() != n:
            raise ValueError(f"adam: {name} has {t.numel()} elements, param has {n}")
    if param_lo is not None:
        if param.dtype != torch.bfloat16 or param_lo.dtype != torch.int16:
            raise ValueError(f"adam: a split master is bf16 weights and int16 remainders, got param {param.dtype} and "
                             f"param_lo {param_lo.dtype}")
        if param_lp is not None:
            raise ValueError("adam: with param_lo, param is the bf16 weights themselves; pass no param_lp")
        if param_lo.device != param.device:
            raise ValueError(f"adam: param_lo is on {param_lo.device}, param on {param.device}")
    masters = (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq))
    if param_lo is None:
        masters = (("param", param),) + masters
    for name, t in masters:
        if t.dtype != torch.float32:
            raise ValueError(f"adam: {name} must be float32 (master state), got {t.dtype}")
    if param_lp_peer is not None:
        want = param_lp.dtype if param_lp is not None else param.dtype
        if param_lp_peer.dtype != want:
            raise ValueError(f"adam: param_lp_peer must be {want} (what param_lp receives), got {param_lp_peer.dtype}")
        if param_lp_peer.device != param.device:
            raise ValueError(f"adam: param_lp_peer is on {param_lp_peer.device}, param on {param.device} (a peer "
                             "GPU's weights must be mapped into param's device)")


def adam_(param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, grad_scale=1.0,
          param_lp=None, mode="fairseq", skip_if_nonfinite=None, grad_scale_tensor=None, param_lp_peer=None,
          ranges=None, with_norm=False, param_lo=None):
    """In-place update of param, exp_avg, exp_avg_sq (and param_lp, param_lp_peer, param_lo).

    ``skip_if_nonfinite``: optional 0-dim fp32 tensor (e.g. :func:`grad_norm`'s result); when it is
    inf/NaN nothing is updated (checked on the device by the fused kernel).
    ``grad_scale_tensor``: optional one-element fp32 tensor on param's device, multiplied into
    ``grad_scale`` on the device; when it is inf/NaN nothing is updated.
    ``ranges``: optional ascending, disjoint (lo, hi) pairs; only these elements are updated.
    ``with_norm``: return the L2 norm (fp32 0-dim tensor) of ``grad`` as read, over ``ranges``, summed in the
    update's pass; not with ``skip_if_nonfinite`` (module docstring).
    ``param_lo``: int16 remainders of a split master whose upper halves are ``param`` (bf16; module docstring).
    """
    _check(param, grad, exp_avg, exp_avg_sq, param_lp, mode, step, param_lp_peer, param_lo)
    if with_norm and skip_if_nonfinite is not None:
        raise ValueError("adam: with_norm and skip_if_nonfinite exclude each other (the norm is known only after "
                         "the update)")
    flat_ranges = check_ranges(ranges, param, grad, exp_avg, exp_avg_sq, param_lp, param_lp_peer, param_lo)
    if flat_ranges == []:  # no range: nothing to update (the extension reads an empty list as "everything")
        return torch.zeros((), dtype=torch.float32, device=grad.device) if with_norm else None
    if grad_scale_tensor is not None:
        if not torch.is_tensor(grad_scale_tensor) or grad_scale_tensor.numel() != 1:
            raise ValueError("adam: grad_scale_tensor must be a one-element tensor")
        if grad_scale_tensor.device != param.device:
            raise ValueError(f"adam: grad_scale_tensor is on {grad_scale_tensor.device}, param on {param.device}")
    mod = kernel_module("adam", param, grad, exp_avg, exp_avg_sq, param_lp, skip_if_nonfinite, grad_scale_tensor,
                        param_lp_peer, param_lo)
    flat = all(t is None or t.is_contiguous() for t in (param, exp_avg, exp_avg_sq, param_lp, param_lp_peer,
                                                        param_lo))
    if mod is not None and flat:
        norm = torch.empty((), dtype=torch.float32, device=param.device) if with_norm else None
        _fused(mod, param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, grad_scale,
               param_lp, mode, skip_if_nonfinite, grad_scale_tensor, param_lp_peer, flat_ranges, norm, param_lo)
        return norm
    norm = grad_norm_reference(grad, ranges) if with_norm else None  # Adam does not change the gradients
    adam_reference_(param, grad, exp_avg, exp_avg_sq, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay, step=step, grad_scale=grad_scale, param_lp=param_lp,
                    mode=mode, skip_if_nonfinite=skip_if_nonfinite, grad_scale_tensor=grad_scale_tensor,
                    param_lp_peer=param_lp_peer, ranges=ranges, param_lo=param_lo)
    return norm


def grad_norm_reference(grad, ranges=None):
    if ranges is None:
        return grad.float().norm(2)
    parts = [grad[lo:hi].float() for lo, hi in ranges]
    return torch.cat(parts).norm(2) if parts else grad.new_zeros((), dtype=torch.float32)


def grad_norm(grad, ranges=None):
    """L2 norm of a flat gradient buffer as an fp32 0-dim tensor (inf/NaN propagate); with ``ranges``
    (ascending, disjoint (lo, hi) pairs), the norm of those elements only."""
    flat_ranges = check_ranges(ranges, grad)
    if flat_ranges == []:
        return torch.zeros((), dtype=torch.float32, device=grad.device)
    mod = kernel_module("grad_norm", grad)
    if mod is not None:
        return _fused_norm(mod, grad, flat_ranges)
    return grad_norm_reference(grad, ranges)


def _fused(mod, param, grad, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step, grad_scale, param_lp,
           mode, skip_if_nonfinite=None, grad_scale_tensor=None, param_lp_peer=None, ranges=None,
           norm_out=None, param_lo=None):  # kernel slot
    norm = factor = None
    if skip_if_nonfinite is not None:
        norm = skip_if_nonfinite.detach().float().reshape(()).contiguous()
    if grad_scale_tensor is not None:
        factor = grad_scale_tensor.detach().float().reshape(()).contiguous()
    call("adam_step", param, grad.contiguous(), exp_avg, exp_avg_sq, param_lp, float(lr), float(beta1), float(beta2),
         float(eps), float(weight_decay), int(step), float(grad_scale), mode == "torch", norm, factor, param_lp_peer,
         ranges or [], norm_out, param_lo)


def _fused_norm(mod, grad, ranges=None):  # kernel slot
    return call("grad_norm", grad.contiguous(), ranges or [])
