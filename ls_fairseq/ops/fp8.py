"""FP8 linear layers: ``linear(x, weight, bias, fp8=mode)`` with the GEMMs on FP8 tensor cores.

Numerics (csrc/kernels/fp8.cu holds the kernel, this file the same rule in plain PyTorch):

- Per-tensor current scaling. Each GEMM input is quantised with one scale taken from its own absolute
  maximum at that moment, so a scale is never stale (no amax history to warm up, nothing to go wrong
  after an fp16 loss-scale change). The scale is the largest power of two s with ``amax * s`` at most the
  format's largest value (448 for e4m3, 57344 for e5m2): scaling is exact in fp32, the dequantisation
  factor ``1 / s`` is exact, and the only rounding is the one to FP8 (nearest even).
- Forward: ``y = (q(x) / s_x) (q(W) / s_W)^T`` with x and W in e4m3 (3 mantissa bits), accumulated in fp32
  by the tensor cores, output in the input's dtype.
- Backward: the input gradient is a second FP8 GEMM, dY quantised to the gradient format (``e4m3``, or
  ``e5m2`` with 2 mantissa bits and 5 exponent bits) against the forward's e4m3 W. The weight gradient
  ``dY^T x`` stays a GEMM in the input's dtype from the saved x, so the master weights' updates are as
  precise as without FP8.
- A weight whose sizes are not multiples of 16 (the FP8 GEMM's tile) uses the plain linear layer.
- Inf or NaN in a tensor gives a NaN scale and NaN outputs: an fp16 overflow still reaches the
  optimizer's overflow check.

``mode`` (an int, as the layers pass it): 0 off, 1 + the gradient format (``FORMATS``).
"""

import torch

from ls_fairseq import _ext

E4M3, E5M2 = 0, 1
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
FP8_DTYPES = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_MAX_EXPONENT = {E4M3: 9, E5M2: 16}  # the largest value is 0.875 * 2**F
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores


def mode_of(enabled: bool, grad_format: str) -> int:
    """The layers' fp8 mode for ``--fp8`` and ``--fp8-grad-format``."""
    if grad_format not in FORMATS:
        raise ValueError(f"--fp8-grad-format {grad_format!r}: choose from {', '.join(FORMATS)}")
    return 1 + FORMATS[grad_format] if enabled else 0


def shapes_ok(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def fp8_scale_reference(amax: torch.Tensor, fmt: int) -> torch.Tensor:
    """The scale (fp32) for a tensor whose absolute maximum is ``amax`` (fp32), by the rule above."""
    amax = amax.float()
    mantissa, exponent = torch.frexp(amax)
    top = _MAX_EXPONENT[fmt]
    k = torch.where(mantissa <= 0.875, top - exponent, top - exponent - 1).clamp(-126, 126)
    s = torch.ldexp(torch.ones_like(amax), k)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


def fp8_quantize_reference(x: torch.Tensor, fmt: int):
    """(codes in torch's FP8 dtype, 1 / scale as an fp32 scalar) of ``x``."""
    xf = x.float()
    amax = xf.abs().max() if xf.numel() else torch.zeros((), device=x.device)
    s = fp8_scale_reference(amax, fmt)
    return (xf * s).to(FP8_DTYPES[fmt]), 1.0 / s


def _dequantize(q, scale_inv):
    return q.float() * scale_inv


class _Fp8LinearReference(torch.autograd.Function):
    """What the FP8 linear node computes, in fp32 from the same FP8 codes (CPU and tests)."""

    @staticmethod
    def forward(ctx, x, weight, bias, grad_format):
        x2 = x.reshape(-1, x.shape[-1])
        xq, sx = fp8_quantize_reference(x2, E4M3)
        wq, sw = fp8_quantize_reference(weight, E4M3)
        y = _dequantize(xq, sx) @ _dequantize(wq, sw).t()
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x2, weight, wq, sw)
        ctx.has_bias = bias is not None
        ctx.grad_format = grad_format
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        x2, weight, wq, sw = ctx.saved_tensors
        g2 = g.reshape(-1, weight.shape[0])
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            gq, sg = fp8_quantize_reference(g2, ctx.grad_format)
            dx = (_dequantize(gq, sg) @ _dequantize(wq, sw)).to(g.dtype).reshape(*g.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            dw = (g2.float().t() @ x2.float()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.float().sum(0).to(weight.dtype)
        return dx, dw, db, None


def fp8_linear_reference(x, weight, bias=None, grad_format: int = E4M3):
    return _Fp8LinearReference.apply(x, weight, bias, grad_format)


def fp8_linear(x, weight, bias=None, grad_format: int = E4M3):
    """x W^T (+ b) with FP8 GEMMs: the C++ node on CUDA (bf16/fp16), the fp32 reference elsewhere."""
    if not shapes_ok(weight):
        raise ValueError(f"fp8_linear: weight {tuple(weight.shape)} has a size that is not a multiple of 16")
    mod = _ext.get()
    if (x.is_cuda and mod is not None and hasattr(mod, "ag_fp8_linear")
            and x.dtype in (torch.float16, torch.bfloat16)):
        return mod.ag_fp8_linear(x, weight, bias, grad_format)
    return fp8_linear_reference(x, weight, bias, grad_format)


def fp8_unavailable_reason(device: torch.device, dtype: torch.dtype):
    """Why ``--fp8`` cannot train on ``device`` with parameters of ``dtype`` (None when it can)."""
    if device.type != "cuda":
        return (f"--fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer: Ada, Hopper); this model is on {device.type}")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (f"--fp8 needs FP8 tensor cores (compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or "
                f"newer: Ada, Hopper); {name} has {cap[0]}.{cap[1]}: train without --fp8")
    if dtype not in (torch.float16, torch.bfloat16):
        return f"--fp8 runs the other layers in bf16 or fp16: add --bf16 or --fp16 (the model is {dtype})"
    mod = _ext.get()
    if mod is None or not hasattr(mod, "ag_fp8_linear"):
        return ("--fp8 needs the ls_fairseq CUDA extension built with FP8 support (python -m ls_fairseq.info "
                "says why it is not loaded)")
    return None
