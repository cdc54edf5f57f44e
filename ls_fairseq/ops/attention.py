"""Multi-head attention pieces in the batch-major layout torch's SDPA wants.

qkv_split: [B, T, 3C] (+ bias [3C]) -> q, k, v each [B, H, T, C/H]
kv_split:  [B, S, 2C] slice (+ bias [2C]) -> k, v each [B, H, S, C/H]
merge_heads: [B, H, T, D] -> [B, T, H*D]
attention_probs: the attention weights themselves (for alignments; the attention below never forms them)
attention: softmax(q k^T / sqrt(D) + masks) v: on CUDA in fp16 / bf16 with both lengths <= 128 through the
           kernel of csrc/kernels/attention.cu (padded or packed), otherwise through PyTorch's kernels;
           key_padding_mask [B, S] bool (True = padding), optional causal mask; or, with ``varlen``,
           over packed sequences: q [1, H, Nq, D], k, v [1, H, Nk, D] hold sequences back to back
           (no padding), sequence i in rows [cu_q[i], cu_q[i + 1]) of q and [cu_k[i], cu_k[i + 1]) of k, v.
"""

import inspect
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ls_fairseq.ops._checks import check_dropout, up
from ls_fairseq.ops._dispatch import cpp_nodes, kernel_module
from ls_fairseq.ops._kernels import call


def _split_reference(x, bias, n: int, num_heads: int):
    B, T, W = x.shape
    if bias is not None:
        x = (up(x) + up(bias)).to(x.dtype)
    C = W // n
    parts = x.view(B, T, n, num_heads, C // num_heads).permute(2, 0, 3, 1, 4)
    return tuple(t.contiguous() for t in parts.unbind(0))


def _check_split(x, bias, n, num_heads, name):
    if x.dim() != 3 or x.shape[-1] % n != 0:
        raise ValueError(f"{name}: expected [batch, length, {n}*embed_dim], got {tuple(x.shape)}")
    C = x.shape[-1] // n
    if C % num_heads != 0:
        raise ValueError(f"{name}: embed_dim {C} is not divisible by num_heads {num_heads}")
    if bias is not None and bias.shape != (x.shape[-1],):
        raise ValueError(f"{name}: bias shape {tuple(bias.shape)} != ({x.shape[-1]},)")


def qkv_split_reference(qkv, bias, num_heads: int):
    return _split_reference(qkv, bias, 3, num_heads)


def qkv_split(qkv, bias, num_heads: int):
    _check_split(qkv, bias, 3, num_heads, "qkv_split")
    mod = kernel_module("qkv_split", qkv, bias)
    if mod is not None:
        return _fused_split(mod, qkv, bias, 3, num_heads)
    return qkv_split_reference(qkv, bias, num_heads)


def kv_split(kv, bias, num_heads: int):
    _check_split(kv, bias, 2, num_heads, "kv_split")
    mod = kernel_module("qkv_split", kv, bias)
    if mod is not None:
        return _fused_split(mod, kv, bias, 2, num_heads)
    return _split_reference(kv, bias, 2, num_heads)


def merge_heads_reference(x):
    B, H, T, D = x.shape
    return x.transpose(1, 2).reshape(B, T, H * D)


def merge_heads(x):
    if x.dim() != 4:
        raise ValueError(f"merge_heads: expected [batch, heads, length, head_dim], got {tuple(x.shape)}")
    B, H, T, D = x.shape
    token_major = x.transpose(1, 2)
    if token_major.is_contiguous():
        # SDPA's flash and memory-efficient kernels write their output token-major ([B, T, H, D]
        # in memory) and hand back a transposed view: the merge is then free, and so is its
        # backward, whose gradient arrives in exactly the layout the attention backward reads.
        return token_major.view(B, T, H * D)
    mod = kernel_module("merge_heads", x)
    if mod is not None:
        return _fused_merge(mod, x)
    return merge_heads_reference(x)


def _attn_mask(q, k, key_padding_mask, causal):
    """Boolean mask (True = attend) broadcastable to [B, H, Tq, S], or None."""
    Tq, S = q.shape[-2], k.shape[-2]
    mask = None
    if key_padding_mask is not None:
        mask = (~key_padding_mask.bool()).view(key_padding_mask.shape[0], 1, 1, S)
    if causal and Tq > 1:
        # query i sits at absolute position S - Tq + i and sees keys up to it
        c = torch.ones(Tq, S, dtype=torch.bool, device=q.device).tril(diagonal=S - Tq)
        mask = c if mask is None else (mask & c)
    return mask


def attention_probs(q, k, key_padding_mask=None, causal: bool = False):
    """The attention weights softmax(q k^T / sqrt(D) + masks) in fp32, [B, H, Tq, S], as fairseq's
    MultiheadAttention returns them (before dropout): for alignments only. Plain PyTorch, apart from
    :func:`attention`, which never materialises them."""
    scores = torch.matmul(up(q) * q.shape[-1] ** -0.5, up(k).transpose(-1, -2)).float()
    mask = _attn_mask(q, k, key_padding_mask, causal)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1)


class Varlen(NamedTuple):
    """Packed sequences for :func:`attention`: sequence i is rows [cu_q[i], cu_q[i + 1]) of the queries and
    [cu_k[i], cu_k[i + 1]) of the keys and values. cu_q, cu_k: int32 [n + 1] on the device of q, from 0 to
    the row counts; max_q, max_k: at least the longest sequence's length (the kernel's grid). A sequence
    with queries must have keys. Causal: query j of a sequence sees its keys 0 .. j."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def _varlen_mask(varlen: Varlen, causal: bool):
    """[Nq, Nk] bool (True = attend): within each sequence, causal from its first row."""
    def seg_pos(cu):
        cu = cu.long()
        n = cu.numel() - 1
        seg = torch.repeat_interleave(torch.arange(n, device=cu.device), cu[1:] - cu[:-1])
        return seg, torch.arange(seg.numel(), device=cu.device) - cu[seg]

    sq, pq = seg_pos(varlen.cu_q)
    sk, pk = seg_pos(varlen.cu_k)
    mask = sq[:, None] == sk[None, :]
    return mask & (pk[None, :] <= pq[:, None]) if causal else mask


def attention_reference(q, k, v, key_padding_mask=None, causal: bool = False, p: float = 0.0,
                        training: bool = True, varlen: "Varlen" = None):
    mask = _varlen_mask(varlen, causal) if varlen is not None else _attn_mask(q, k, key_padding_mask, causal)
    dt = q.dtype
    out = F.scaled_dot_product_attention(
        up(q), up(k), up(v), attn_mask=mask, dropout_p=p if training else 0.0
    )
    return out.to(dt)


def _check_varlen(q, k, key_padding_mask, varlen: Varlen):
    if key_padding_mask is not None:
        raise ValueError("attention: packed sequences (varlen) take no key_padding_mask")
    if q.shape[0] != 1 or k.shape[0] != 1:
        raise ValueError(f"attention: packed sequences need batch 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    for name, cu in (("cu_q", varlen.cu_q), ("cu_k", varlen.cu_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
            raise ValueError(f"attention: varlen {name} must be int32 [n + 1] on {q.device}, got {cu.dtype} "
                             f"{tuple(cu.shape)} on {cu.device}")
    if varlen.cu_q.numel() != varlen.cu_k.numel() or varlen.cu_q.numel() < 2:
        raise ValueError(f"attention: varlen cu_q and cu_k must have the same n + 1 >= 2 entries, got "
                         f"{varlen.cu_q.numel()} and {varlen.cu_k.numel()}")


def _varlen_cuda(q, k, v, varlen: Varlen, causal: bool, p: float):
    """Packed sequences on CUDA ([1, N, H, D] is the kernels' layout, a view of ours). fp16 / bf16: the kernel
    of csrc/kernels/attention.cu for sequences up to SHORT_KERNEL_LEN, else the flash kernel (sm80 and newer);
    both backwards replay the forward's dropout mask, also under CUDA graphs. fp32: the memory-efficient kernel,
    without dropout: over packed sequences its backward does not see the mask its forward drew (the gradient
    of a dropout attention disagrees with its output)."""
    if q.dtype in (torch.float16, torch.bfloat16):
        mod = _short_kernel(q, k, v, longest=max(varlen.max_q, varlen.max_k))
        if mod is not None:
            packed = dict(cu_q=varlen.cu_q, cu_k=varlen.cu_k, max_q=int(varlen.max_q), max_k=int(varlen.max_k))
            if mod.short_attention_fits(q, k, v, None, **packed):
                return mod.ag_short_attention(q, k, v, None, causal, p, **packed)
        out = torch.ops.aten._flash_attention_forward(
            q.transpose(1, 2)[0], k.transpose(1, 2)[0], v.transpose(1, 2)[0], varlen.cu_q, varlen.cu_k,
            int(varlen.max_q), int(varlen.max_k), float(p), bool(causal), False)[0]
        return out.unsqueeze(0).transpose(1, 2)
    if p > 0:
        raise ValueError("attention: packed sequences (varlen) with dropout need fp16 or bf16 on CUDA, got "
                         f"{q.dtype} with p={p}")
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    out = torch.ops.aten._efficient_attention_forward(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, varlen.cu_q, varlen.cu_k, int(varlen.max_q),
        int(varlen.max_k), 0.0, 1 if causal else 0, grad)[0]
    return out.transpose(1, 2)


def _short_kernel(q, k, v, key_padding_mask=None, longest=None):
    """The extension when the short-sequence kernel may take this call (its own check follows), else None:
    fp16 / bf16 with both lengths <= SHORT_KERNEL_LEN (``longest``: the longest packed sequence; default
    q's and k's lengths), outside torch.compile (which traces SDPA)."""
    if longest is None:
        longest = max(q.shape[-2], k.shape[-2])
    if q.dtype not in (torch.float16, torch.bfloat16) or longest > SHORT_KERNEL_LEN:
        return None
    if torch.compiler.is_compiling():
        return None
    return kernel_module("attention", q, k, v, key_padding_mask)


def attention(q, k, v, key_padding_mask=None, causal: bool = False, p: float = 0.0, training: bool = True,
              varlen: Varlen = None):
    check_dropout(p, "attention dropout")
    if varlen is not None:
        _check_varlen(q, k, key_padding_mask, varlen)
        if q.device.type == "cpu":
            return attention_reference(q, k, v, None, causal, p, training, varlen)
        return _varlen_cuda(q, k, v, varlen, causal, p if training else 0.0)
    if key_padding_mask is not None and key_padding_mask.shape != (k.shape[0], k.shape[-2]):
        raise ValueError(
            f"attention: key_padding_mask shape {tuple(key_padding_mask.shape)} != (batch, src_len) "
            f"({k.shape[0]}, {k.shape[-2]})"
        )
    if q.device.type == "cpu":
        return attention_reference(q, k, v, key_padding_mask, causal, p, training)
    mod = _short_kernel(q, k, v, key_padding_mask)
    if mod is not None:  # short sequences in fp16 / bf16: csrc/kernels/attention.cu
        attend = None if key_padding_mask is None else ~key_padding_mask.bool()
        if mod.short_attention_fits(q, k, v, attend):
            return mod.ag_short_attention(q, k, v, attend, causal, p if training else 0.0)
    # Longer sequences (and fp32): SDPA runs in the storage dtype, restricted to the flash and memory-efficient
    # backends. The cuDNN backend (PyTorch's default choice with a padding mask) builds an
    # execution plan for every new (batch, length) shape, far slower than a repeated call. fairseq
    # batches by --max-tokens, so almost every batch of the first epoch has a new shape; that is the
    # slow first epoch of native fairseq (benchmarks/RESULTS.md, "First epoch"), and we do not inherit it.
    # Which kernel: for short sequences (the bulk of a --max-tokens batch of sentences) the
    # memory-efficient kernel is faster than flash, with or without masks; flash wins on longer ones
    # (benchmarks/bench_attention.py; RESULTS.md, "Ops").
    short = max(q.shape[-2], k.shape[-2]) <= SHORT_ATTENTION_LEN
    with _backends(short):
        if key_padding_mask is None and causal and q.shape[-2] == k.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p if training else 0.0, is_causal=True)
        mask = _attn_mask(q, k, key_padding_mask, causal)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p if training else 0.0)


_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_SDPA_SHORT = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
SHORT_ATTENTION_LEN = 64
SHORT_KERNEL_LEN = 128  # kShortAttentionMax of csrc/kernels/launch.h
_HAS_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


class _Backends:
    """``sdpa_kernel(backends, set_priority)`` as a reusable object that sets PyTorch's SDPA backend
    flags directly (and only those that differ). A training step enters it once per attention call
    (36 times per step on transformer-big); the generic context manager costs ~14 us of host time
    per use, this ~3 us. Nests and restores exactly like sdpa_kernel."""

    def __init__(self, backends, set_priority=False):
        from torch.nn.attention import _backend_names

        self._flags = [(getattr(torch._C, f"_get_{name}_sdp_enabled"), getattr(torch._C, f"_set_sdp_use_{name}"),
                        getattr(SDPBackend, val) in backends) for name, val in _backend_names.items()]
        self._priority = [int(b) for b in backends] if set_priority else None
        self._saved = []

    def __enter__(self):
        prev = [get() for get, _, _ in self._flags]
        for (_, put, want), was in zip(self._flags, prev):
            if was != want:
                put(want)
        order = None
        if self._priority is not None:
            order = list(torch._C._get_sdp_priority_order())
            new = self._priority + [b for b in order if b not in self._priority]
            if new != order:
                torch._C._set_sdp_priority_order(new)
        self._saved.append((prev, order))
        return self

    def __exit__(self, *exc):
        prev, order = self._saved.pop()
        for (_, put, want), was in zip(self._flags, prev):
            if was != want:
                put(was)
        if order is not None:
            torch._C._set_sdp_priority_order(order)
        return False


def _choice(short: bool):
    """(backends, set_priority) for long and short sequences."""
    if not short:
        return _SDPA_BACKENDS, False
    if _HAS_PRIORITY:  # efficient first, flash where efficient cannot run
        return _SDPA_SHORT, True
    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], False


def _make_backends():
    try:
        return _Backends(*_choice(False)), _Backends(*_choice(True))
    except (ImportError, AttributeError):  # a torch without these internals: the public context manager
        return None


_FAST_BACKENDS = _make_backends()


def _backends(short: bool):
    if _FAST_BACKENDS is not None:
        return _FAST_BACKENDS[1] if short else _FAST_BACKENDS[0]
    backends, set_priority = _choice(short)
    # set_priority is True only where sdpa_kernel has the parameter (_HAS_PRIORITY)
    return sdpa_kernel(backends, set_priority=True) if set_priority else sdpa_kernel(backends)


class _SplitFn(torch.autograd.Function):
    """One kernel writes all n heads-major parts; the backward merges their gradients and sums the bias."""

    @staticmethod
    def forward(ctx, x, bias, n, num_heads):
        # token-major parts ([B, T, H, D] in memory, handed out as [B, H, T, D] views): the layout
        # SDPA's kernels use, so their output is token-major too (merge_heads is then a view) and
        # their backward reads the output gradient and writes dq, dk, dv without copies
        out = call("qkv_split_fwd", x.contiguous(), bias, int(n), int(num_heads), True)
        ctx.n = n
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return tuple(out.unbind(0))

    @staticmethod
    def backward(ctx, *grads):
        need_db = ctx.needs_input_grad[1]
        # one pass merges the parts' gradients (q, k, v, or a layer-batched cross-attention's keys and values) and
        # sums the bias gradient
        dx, db = call("split_heads_bwd", list(grads), bool(need_db))
        return dx, (db.to(ctx.bias_dtype) if need_db else None), None, None


class _MergeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.num_heads = x.shape[1]
        return call("merge_heads_fwd", x.contiguous())

    @staticmethod
    def backward(ctx, g):
        return call("merge_heads_bwd", g.contiguous(), int(ctx.num_heads))


def _fused_split(mod, x, bias, n, num_heads):  # kernel slot
    nodes = cpp_nodes(mod)
    if nodes is not None:
        return tuple(nodes.ag_split_heads(x, bias, int(n), int(num_heads)))
    return _SplitFn.apply(x, bias, n, num_heads)


def _fused_merge(mod, x):  # kernel slot
    return _MergeFn.apply(x)


def split_heads(x, bias, n: int, num_heads: int):
    """General form of qkv_split/kv_split: [B, T, n*C] (+ bias [n*C]) -> n tensors [B, H, T, C/H].

    The decoder uses it with n = 2 * n_layers to cut the layer-batched cross-attention K/V.
    """
    _check_split(x, bias, n, num_heads, "split_heads")
    mod = kernel_module("qkv_split", x, bias)
    if mod is not None:
        return _fused_split(mod, x, bias, n, num_heads)
    return _split_reference(x, bias, n, num_heads)
