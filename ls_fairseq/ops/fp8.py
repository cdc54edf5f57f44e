"""FP8 linear layers: ``linear(x, weight, bias, fp8=use)`` with every GEMM on FP8 tensor cores.

The same rules in plain PyTorch as the kernels of csrc/kernels/fp8.cu (the reference the tests compare with):
per-tensor delayed scaling by a power of two from the maxima of each tensor's last ``HISTORY`` uses (a row of
the model's :class:`Fp8State`); :meth:`Fp8State.begin_forward` (once per training forward) rolls the histories
into the next scales and casts the body's weights in one launch (:meth:`Fp8State.cast_ahead`); the first forward
and backward of a new state use current scaling. Forward ``y = [x] [W]^T`` (e4m3), backward ``dx = [dY] [W]``
and ``dW = [dY]^T [x]`` (dY in e4m3 or e5m2), all with fast accumulation; a weight whose sizes are not multiples
of 16 uses the plain linear layer; inf or NaN gives NaN outputs and stays out of the history. The numerics in
full: docs/fp8.md, section "Kernels and layouts".

``Fp8Use`` (what the layers pass down): the mode (1 + gradient format, + 2 while scaling is current), the
state's tensor and the linear's slot in it (rows 3 slot, 3 slot + 1, 3 slot + 2: input, weight, gradient).
"""

from typing import List, NamedTuple, Optional, Tuple

import torch

from ls_fairseq import _ext

E4M3, E5M2 = 0, 1
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}
FP8_DTYPES = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
_MAX_EXPONENT = {E4M3: 9, E5M2: 16}  # the largest value is 0.875 * 2**F
MIN_CAPABILITY = (8, 9)  # Ada and Hopper: FP8 tensor cores
# a state row (csrc/kernels/launch.h): 1 / scale, scale, recorded amax, unused, then the history (newest first)
WIDTH, SCALE_INV, SCALE, AMAX, HIST = 20, 0, 1, 2, 4
HISTORY = WIDTH - HIST


def mode_of(enabled: bool, grad_format: str) -> int:
    """The layers' base fp8 mode for ``--fp8`` and ``--fp8-grad-format`` (0 off, 1 + the gradient format)."""
    if grad_format not in FORMATS:
        raise ValueError(f"--fp8-grad-format {grad_format!r}: choose from {', '.join(FORMATS)}")
    return 1 + FORMATS[grad_format] if enabled else 0


class Fp8Use(NamedTuple):
    mode: int  # 1 + gradient format, + 2 under current scaling
    state: torch.Tensor  # float32 [rows, WIDTH]
    slot: int

    @property
    def grad_format(self) -> int:
        return (self.mode - 1) & 1

    @property
    def current(self) -> bool:
        return self.mode >= 3

    def at(self, k: int) -> "Fp8Use":
        return self._replace(slot=self.slot + k)


class Fp8State:
    """The FP8 scaling state of a model's linear layers: 3 rows per linear, on the model's device, made at the
    first training forward (which then scales by current maxima) and rolled at every later one."""

    def __init__(self, linears: int, grad_format: int, in_fp8: Optional[int] = None):
        self.linears = linears
        self.in_fp8 = linears if in_fp8 is None else in_fp8  # how many of the linears use their slot
        self.grad_format = grad_format
        self.tensor: Optional[torch.Tensor] = None
        self.current = True
        # (weight, slot) of the FP8 projections inside the model's body, whose codes a training forward makes in
        # one launch at its start (cast_ahead); the vocabulary projection casts its own
        self.ahead: List[Tuple[torch.Tensor, int]] = []

    def begin_forward(self, device: torch.device) -> None:
        if self.tensor is None or self.tensor.device != device:
            self.tensor = torch.zeros(3 * self.linears, WIDTH, device=device)
            self.current = True
        else:
            self.current = False
            fp8_roll(self.tensor, self.grad_format)
            self.cast_ahead()

    def cast_ahead(self) -> None:
        """Under delayed scaling, the codes of the body's FP8 weights in one launch (``fp8_cast_weights``): each
        projection then takes its weight's codes instead of casting the weight itself, with the same result."""
        mod = _ext.get()
        if not self.ahead or not self.tensor.is_cuda or mod is None or not hasattr(mod, "fp8_cast_weights"):
            return
        mod.fp8_cast_weights([w for w, _ in self.ahead], self.tensor, [3 * slot + 1 for _, slot in self.ahead])

    def end_body(self) -> int:
        """The model's body has run: drop the weights' codes no projection took (returns how many)."""
        mod = _ext.get()
        if not self.ahead or mod is None or not hasattr(mod, "fp8_forget_weights"):
            return 0
        return mod.fp8_forget_weights()

    def use(self, slot: int) -> Fp8Use:
        if self.tensor is None:
            raise RuntimeError("FP8 state used before its first training forward (Fp8State.begin_forward)")
        return Fp8Use(1 + self.grad_format + (2 if self.current else 0), self.tensor, slot)


class Fp8Ref(NamedTuple):
    """A module's place in its model's FP8 state: its first slot, and which of its projections stay in the
    model's precision (bit k of ``skip`` for projection k: their slots are kept but unused)."""
    state: Fp8State
    slot: int
    skip: int = 0


SKIP_SHIFT = 4  # a C++ layer call's fp8 mode carries the skip bits from this bit on (csrc/torch/ops.h Fp8Args)


def fp8_now(module, k: int = 0) -> Optional[Fp8Use]:
    """What ``module``'s k-th projection passes as ``fp8`` now: its slot while it trains with FP8, None otherwise
    (evaluation runs in the model's own precision, and so do skipped projections)."""
    ref = getattr(module, "fp8", None)
    if ref is None or not module.training or (ref.skip >> k) & 1:
        return None
    return ref.state.use(ref.slot + k)


def cpp_fp8_args(use: Optional[Fp8Use]):
    """(mode, state, slot) as the C++ linear calls take them."""
    return (0, None, 0) if use is None else (use.mode, use.state, use.slot)


def layer_fp8_args(module):
    """(mode, state, slot) of a C++ layer call (csrc/torch/layers.cpp): the mode carries the skip bits."""
    ref = getattr(module, "fp8", None)
    if ref is None or not module.training:
        return (0, None, 0)
    use = ref.state.use(ref.slot)
    return (use.mode | (ref.skip << SKIP_SHIFT), use.state, use.slot)


def shapes_ok(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


def fp8_scale_reference(amax: torch.Tensor, fmt: int) -> torch.Tensor:
    """The scale (fp32) for a reference maximum ``amax`` (fp32), by the rule above."""
    amax = amax.float()
    mantissa, exponent = torch.frexp(amax)
    top = _MAX_EXPONENT[fmt]
    k = torch.where(mantissa <= 0.875, top - exponent, top - exponent - 1).clamp(-126, 126)
    s = torch.ldexp(torch.ones_like(amax), k)
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.where(torch.isfinite(amax), s, torch.full_like(s, float("nan")))


def _row_format(row: int, grad_format: int) -> int:
    return grad_format if row % 3 == 2 else E4M3


def fp8_roll_reference(state: torch.Tensor, grad_format: int) -> None:
    """What fp8_roll does to ``state`` (in place)."""
    for r in range(state.shape[0]):
        a = state[r, AMAX]
        if torch.isfinite(a):
            state[r, HIST + 1:] = state[r, HIST:WIDTH - 1].clone()
            state[r, HIST] = a
        s = fp8_scale_reference(state[r, HIST:].max(), _row_format(r, grad_format))
        state[r, AMAX], state[r, SCALE], state[r, SCALE_INV] = 0.0, s, 1.0 / s


def fp8_roll(state: torch.Tensor, grad_format: int) -> None:
    mod = _ext.get()
    if state.is_cuda and mod is not None and hasattr(mod, "fp8_roll"):
        mod.fp8_roll(state, grad_format)
    else:
        fp8_roll_reference(state, grad_format)


def fp8_quantize_reference(x: torch.Tensor, state: torch.Tensor, row: int, fmt: int, current: bool):
    """(codes of the 2-d ``x`` in torch's FP8 dtype, its transposed codes padded with zero rows to a multiple
    of 16 tokens) under ``state``'s row ``row``, updating the row as the kernel does."""
    xf = x.float()
    amax = xf.abs().max() if xf.numel() else torch.zeros((), device=x.device)
    st = state[row]
    st[AMAX] = torch.maximum(st[AMAX], amax.to(st.device))
    if current:
        s = fp8_scale_reference(st[AMAX], fmt)
        st[SCALE], st[SCALE_INV] = s, 1.0 / s
    else:
        s = st[SCALE].clone()
        if not torch.isfinite(amax):
            st[SCALE_INV] = float("nan")
    big = FP8_MAX[fmt]
    q = (xf * s.to(x.device)).clamp(-big, big).to(FP8_DTYPES[fmt])  # saturating, as the kernel; NaN stays NaN
    M = x.shape[0]
    pad = torch.zeros((-M) % 16, x.shape[1], dtype=q.dtype, device=x.device)
    return q, torch.cat([q, pad]).t().contiguous()


def _dequantize(q, scale_inv):
    return q.float() * scale_inv


def _reference_forward(x2, weight, use: Fp8Use):
    """(y = [x2] [W]^T in fp32, x2's codes, W's codes, 1/s of x2, 1/s of W): the reference's forward from the codes the
    kernels make, updating the state's rows as they do."""
    st, r = use.state, 3 * use.slot
    xq, _ = fp8_quantize_reference(x2, st, r, E4M3, use.current)
    wq, _ = fp8_quantize_reference(weight, st, r + 1, E4M3, use.current)
    sx, sw = st[r, SCALE_INV].clone(), st[r + 1, SCALE_INV].clone()
    return _dequantize(xq, sx) @ _dequantize(wq, sw).t(), xq, wq, sx, sw


def _reference_grads(g2, xq, wq, sx, sw, use: Fp8Use, need_dx: bool, need_dw: bool):
    """(dx, dW) in fp32 (None where not needed) of the reference, from the codes of the output gradient g2 in the
    gradient format and the forward's codes of x and W."""
    r = 3 * use.slot + 2
    gq, _ = fp8_quantize_reference(g2, use.state, r, use.grad_format, use.current)
    gd = _dequantize(gq, use.state[r, SCALE_INV])
    dx = gd @ _dequantize(wq, sw) if need_dx else None
    dw = gd.t() @ _dequantize(xq, sx) if need_dw else None
    return dx, dw


class _Fp8LinearReference(torch.autograd.Function):
    """What the FP8 linear node computes, in fp32 from the same FP8 codes (CPU and tests)."""

    @staticmethod
    def forward(ctx, x, weight, bias, use):
        y, xq, wq, sx, sw = _reference_forward(x.reshape(-1, x.shape[-1]), weight, use)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(xq, wq, sx, sw)
        ctx.has_bias = bias is not None
        ctx.use = use
        ctx.dtypes = (x.dtype, weight.dtype)
        return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, g):
        xq, wq, sx, sw = ctx.saved_tensors
        g2 = g.reshape(-1, wq.shape[0])
        dx, dw = _reference_grads(g2, xq, wq, sx, sw, ctx.use, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        db = None
        if dx is not None:
            dx = dx.to(ctx.dtypes[0]).reshape(*g.shape[:-1], wq.shape[1])
        if dw is not None:
            dw = dw.to(ctx.dtypes[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.float().sum(0).to(ctx.dtypes[1])
        return dx, dw, db, None


def fp8_linear_reference(x, weight, bias, use: Fp8Use):
    return _Fp8LinearReference.apply(x, weight, bias, use)


class Fp8HeadSaved(NamedTuple):
    """What the vocabulary projection's FP8 backward needs of its forward (:func:`fp8_head_forward`)."""
    xq: Optional[torch.Tensor]  # the features' codes (the reference only)
    wq: Optional[torch.Tensor]  # the weight's codes (the reference only)
    xq_t: Optional[torch.Tensor]  # the features' transposed codes
    wq_t: Optional[torch.Tensor]  # the weight's transposed codes
    sx: torch.Tensor  # 1/s of the features
    sw: torch.Tensor  # 1/s of the weight

    @property
    def kept_x(self) -> bool:
        """Whether the features' codes were kept (fp8_head_forward's keep_x): the weight's gradient needs them."""
        return self.xq_t is not None or self.xq is not None


def fp8_head_forward(x: torch.Tensor, weight: torch.Tensor, use: Fp8Use, keep_x: bool = True):
    """The logits ``x W^T`` of the vocabulary projection as an FP8 GEMM, outside autograd (the CUDA-graph step's
    head, ls_fairseq/fairseq_ext/graph/split_step.py): (logits in x's dtype, what :func:`fp8_head_backward` needs).
    x [rows, C], weight [vocab, C] with sizes that are multiples of 16. ``keep_x``: keep x's transposed codes for
    the weight's gradient. On CUDA the quantising kernels and torch's FP8 GEMM; elsewhere the fp32 reference of
    the same codes."""
    mod = _fp8_extension(x, "fp8_linear_forward_codes")
    if mod is not None:  # the FP8 linear node's forward, without autograd
        logits, xq_t, wq_t, sx, sw = mod.fp8_linear_forward_codes(x, weight, use.mode, use.state, use.slot, keep_x)
        return logits, Fp8HeadSaved(None, None, xq_t, wq_t, sx, sw)
    y, xq, wq, sx, sw = _reference_forward(x, weight, use)
    return y.to(x.dtype), Fp8HeadSaved(xq if keep_x else None, wq, None, None, sx, sw)


def fp8_head_backward(g: torch.Tensor, saved: Fp8HeadSaved, use: Fp8Use, need_dw: bool = True,
                      dw_out: Optional[torch.Tensor] = None):
    """(dx, dW or None) of :func:`fp8_head_forward` for the logits' gradient ``g`` [rows, vocab]: both GEMMs in
    FP8 from g's codes in the gradient format, in g's dtype. ``dw_out``: where dW is written (its shape and g's
    dtype, 16-byte aligned), then returned."""
    need_dw = need_dw and saved.kept_x
    mod = _fp8_extension(g, "fp8_quantize")
    if mod is not None:
        st, r = use.state, 3 * use.slot + 2
        gq, gq_t = mod.fp8_quantize(g, st, r, use.grad_format, use.current, True, need_dw)
        # the FP8 linear node's backward GEMMs
        return tuple(mod.fp8_backward_gemms(gq, gq_t, st[r, SCALE_INV], saved.xq_t, saved.wq_t, saved.sx, saved.sw,
                                            g.dtype, dw_out))
    dx, dw = _reference_grads(g, saved.xq, saved.wq, saved.sx, saved.sw, use, True, need_dw)
    dx, dw = dx.to(g.dtype), dw.to(g.dtype) if dw is not None else None
    if dw is not None and dw_out is not None:
        dw = dw_out.copy_(dw)
    return dx, dw


def fp8_head_loss_backward(logits: torch.Tensor, target: torch.Tensor, epsilon: float, ignore_index: int,
                           grad_scale, saved: Fp8HeadSaved, use: Fp8Use, need_dw: bool = True,
                           dw_out: Optional[torch.Tensor] = None):
    """The head's label-smoothed loss and its backward through :func:`fp8_head_forward`'s projection: (loss sum,
    nll sum, dx, dW or None), for the gradient of ``grad_scale * loss`` (None, a number or a 1-element tensor).
    ``dw_out`` as in :func:`fp8_head_backward`.

    On CUDA under delayed scaling the loss kernel writes the logits' gradient only as its FP8 codes
    (``ls_cross_entropy_fwd_bwd_fp8``): the gradient is never stored in the logits' dtype nor quantised by a pass
    of its own, and the logits are left as they are. Otherwise the gradient is written over the logits
    (:func:`~ls_fairseq.ops.cross_entropy.label_smoothed_cross_entropy_with_grad`) and :func:`fp8_head_backward`
    quantises it. Both make the same codes, hence the same results."""
    from ls_fairseq.ops.cross_entropy import grad_scale_tensor, label_smoothed_cross_entropy_with_grad

    need_dw = need_dw and saved.kept_x
    mod = _fp8_extension(logits, "ls_cross_entropy_fwd_bwd_fp8")
    if mod is None or use.current:
        loss, nll = label_smoothed_cross_entropy_with_grad(logits, target, epsilon, ignore_index, grad_scale)
        dx, dw = fp8_head_backward(logits, saved, use, need_dw, dw_out)
        return loss, nll, dx, dw
    gs = grad_scale_tensor(grad_scale, logits.device)
    st, r = use.state, 3 * use.slot + 2
    with torch.no_grad():
        loss, nll, gq, gq_t = mod.ls_cross_entropy_fwd_bwd_fp8(logits, target.long().contiguous(), float(epsilon),
                                                               int(ignore_index), gs, st, r, use.grad_format,
                                                               need_dw)
        dx, dw = mod.fp8_backward_gemms(gq, gq_t, st[r, SCALE_INV], saved.xq_t, saved.wq_t, saved.sx, saved.sw,
                                        logits.dtype, dw_out)
    return loss, nll, dx, dw


def _fp8_extension(x, entry: str):
    """The extension when it can run its FP8 node ``entry`` on x (a bf16/fp16 CUDA tensor), else None."""
    if not x.is_cuda or x.dtype not in (torch.float16, torch.bfloat16):
        return None
    mod = _ext.get()
    return mod if mod is not None and hasattr(mod, entry) else None


def fp8_linear(x, weight, bias, use: Fp8Use):
    """x W^T (+ b) with FP8 GEMMs: the C++ node on CUDA (bf16/fp16), the fp32 reference elsewhere."""
    if not shapes_ok(weight):
        raise ValueError(f"fp8_linear: weight {tuple(weight.shape)} has a size that is not a multiple of 16")
    mod = _fp8_extension(x, "ag_fp8_linear")
    if mod is not None:
        return mod.ag_fp8_linear(x, weight, bias, use.mode, use.state, use.slot)
    return fp8_linear_reference(x, weight, bias, use)


def fp8_split_node(x, weight, use: Optional[Fp8Use]):
    """The extension when an attention's input projection and head split run as one FP8 node
    (ls_fairseq._C.ag_fp8_linear_split), else None: the projection in FP8, a weight of multiples of 16, a bf16/fp16
    CUDA input [B, T, C]. The C++ layers take the same node under the same conditions (csrc/torch/layers.cpp)."""
    if use is None or not shapes_ok(weight) or x.dim() != 3:
        return None
    return _fp8_extension(x, "ag_fp8_linear_split")


def fp8_residual_node(x, weight, use: Optional[Fp8Use]):
    """The extension when an attention block's output projection and residual dropout run as one FP8 node
    (ls_fairseq._C.ag_fp8_linear_residual), else None: the projection in FP8, a weight of multiples of 16, a
    bf16/fp16 CUDA input. The C++ layers take the same node under the same conditions (csrc/torch/layers.cpp)."""
    if use is None or not shapes_ok(weight) or x.dim() < 2:
        return None
    return _fp8_extension(x, "ag_fp8_linear_residual")


def fp8_ffn_node(x, w1, w2, use1: Optional[Fp8Use], use2: Optional[Fp8Use]):
    """The extension when an FFN's two projections run as one FP8 node (ls_fairseq._C.ag_fp8_ffn), else None: both
    in FP8 under one mode, weights of multiples of 16, a bf16/fp16 CUDA input. The C++ layers take the same node
    under the same conditions (csrc/torch/layers.cpp)."""
    if use1 is None or use2 is None or use1.mode != use2.mode or not (shapes_ok(w1) and shapes_ok(w2)):
        return None
    return _fp8_extension(x, "ag_fp8_ffn")


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
