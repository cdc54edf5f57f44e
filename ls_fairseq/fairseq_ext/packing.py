"""Packed batches: the training forward over real tokens only.

fairseq pads every sentence of a batch to the batch's longest, and a transformer computes every
padded position: its GEMMs, layer norms and dropout run over B x length rows whatever the padding.
A packed batch puts the real tokens of all sentences back to back in one row ([1, tokens, C]); the
row-wise layers then compute only those, and attention runs over each sentence's own rows
(:class:`ls_fairseq.ops.attention.Varlen`: on CUDA the flash kernel over packed sequences in fp16 / bf16).
The loss, its gradients and the logged statistics are those of the padded batch; the values differ
by rounding only (other GEMM shapes, hence other summation orders).

:func:`pack_batch` builds the packing on the host from the padded batch (before its copy to the GPU;
its docstring lists the fields), :func:`pad_packing` grows it to fixed sizes (a CUDA graph's); the
ls_transformer model takes it as ``packed`` (a dict, so that fairseq's sample utilities move its
tensors with the batch).
"""

from typing import Dict, Optional

import numpy as np
import torch

from ls_fairseq.ops.attention import Varlen

PACKED_KEY = "packed"  # net_input entry the ls_transformer model reads


def _pack_side(tokens: np.ndarray, pad: int):
    real = tokens != pad
    lengths = real.sum(1)
    cu = np.zeros(tokens.shape[0] + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    positions = np.cumsum(real, 1)[real] + pad  # make_positions' numbers at the real tokens
    return tokens[real], positions, cu, int(lengths.max()) if lengths.size else 0, real


def pack_batch(src_tokens: torch.Tensor, prev_output_tokens: torch.Tensor, target: torch.Tensor,
               rows: torch.Tensor, pad: int) -> Optional[Dict[str, object]]:
    """The packing of a padded batch (host tensors), or None when it cannot be packed: a sentence
    without tokens on either side, or a counted target token whose decoder input is padding.

    Computed with NumPy, single-threaded: it runs in the training loop between two batches, where
    waking torch's multi-threaded CPU operators' thread pool costs more than the work.

    The fields:

    - ``src_tokens`` / ``tgt_tokens`` int64 [1, N]: the source tokens and the decoder input
      (prev_output_tokens) of sentence 0, then of sentence 1, ..., without padding;
    - ``src_positions`` / ``tgt_positions`` int64 [1, N]: their positions as fairseq numbers them in the
      padded batch (padding_idx + 1, + 2, ... from each sentence's first real token);
    - ``cu_src`` / ``cu_tgt`` int32 [B + 1]: sentence i is rows cu[i] .. cu[i + 1] - 1;
    - ``max_src`` / ``max_tgt``: the longest sentence's length on each side;
    - ``rows`` int64 [R]: the packed rows of the target positions the loss counts, in the order of the
      padded rows it was given; a given row whose target is padding (ls_label_smoothed_cross_entropy rounds
      its row count up with such rows, which the loss ignores) maps to packed row 0."""
    for name, t in (("src_tokens", src_tokens), ("prev_output_tokens", prev_output_tokens), ("target", target),
                    ("rows", rows)):
        if t.device.type != "cpu":
            raise ValueError(f"pack_batch: {name} is on {t.device}; the packing is built on the host (CPU tensors)")
    if src_tokens.dim() != 2 or prev_output_tokens.dim() != 2 or src_tokens.shape[0] != prev_output_tokens.shape[0] \
            or target.shape != prev_output_tokens.shape:
        return None
    src, src_pos, cu_src, max_src, _ = _pack_side(src_tokens.numpy(), pad)
    tgt, tgt_pos, cu_tgt, max_tgt, real = _pack_side(prev_output_tokens.numpy(), pad)
    if src_tokens.shape[0] == 0 or (cu_src[1:] == cu_src[:-1]).any() or (cu_tgt[1:] == cu_tgt[:-1]).any():
        return None
    flat = real.reshape(-1)
    r = rows.numpy()
    counted = target.numpy().reshape(-1)[r] != pad
    if (counted & ~flat[r]).any():
        return None
    packed_row = np.cumsum(flat) - 1  # the packed row of each real padded position

    def host(a, dtype=torch.int64):
        return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)

    return {"src_tokens": host(src).view(1, -1), "src_positions": host(src_pos).view(1, -1),
            "cu_src": host(cu_src, torch.int32), "max_src": max_src,
            "tgt_tokens": host(tgt).view(1, -1), "tgt_positions": host(tgt_pos).view(1, -1),
            "cu_tgt": host(cu_tgt, torch.int32), "max_tgt": max_tgt,
            "rows": host(np.where(counted, packed_row[r], 0))}


def _chunks(extra: int, parts: int):
    """``extra`` rows in ``parts`` sentences as even as can be (the first ones one longer)."""
    base, rest = divmod(extra, parts) if parts else (0, 0)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def pad_packing(packed, src_tokens: int, tgt_tokens: int, sentences: int, pad: int,
                max_len: Optional[int] = None) -> Dict[str, object]:
    """``packed`` grown to fixed sizes (a CUDA graph's shapes): ``src_tokens`` / ``tgt_tokens`` rows and
    ``sentences`` entries of cu_src / cu_tgt (+ 1). The added rows form more sentences of padding tokens (rows
    the loss never reads: their gradient is zero): one, or with ``max_len`` as many as keep each within
    ``max_len`` rows on either side, every one with a source row (a target row always has keys to attend to);
    the remaining entries are sentences without tokens. max_src / max_tgt grow to cover the added sentences.
    Host tensors."""
    n = packed["cu_src"].numel() - 1
    extra_s = src_tokens - packed["src_tokens"].shape[1]
    extra_t = tgt_tokens - packed["tgt_tokens"].shape[1]
    if max_len is None:
        parts = 1 if extra_s or extra_t else 0
    else:
        if max_len < 1:
            raise ValueError(f"pad_packing: max_len must be >= 1, got {max_len}")
        parts = max(-(-max(extra_s, 0) // max_len), -(-max(extra_t, 0) // max_len))
    if extra_s < 0 or extra_t < 0 or sentences < n + parts:
        raise ValueError(f"pad_packing: a packing of {n} sentences, {packed['src_tokens'].shape[1]} + "
                         f"{packed['tgt_tokens'].shape[1]} tokens does not fit {sentences} sentences, "
                         f"{src_tokens} + {tgt_tokens} tokens")
    if max_len is None and (extra_t > 0) != (extra_s > 0):
        raise ValueError("pad_packing: add rows on both sides or on neither")
    if extra_s < parts:  # the added target rows attend to the added source rows: every added sentence needs one
        raise ValueError(f"pad_packing: {parts} added sentences need as many added source rows, got {extra_s}")
    out = dict(packed)
    for side, extra, total in (("src", extra_s, src_tokens), ("tgt", extra_t, tgt_tokens)):
        fill = torch.full((1, extra), pad, dtype=packed[side + "_tokens"].dtype)
        out[side + "_tokens"] = torch.cat([packed[side + "_tokens"], fill], 1)
        out[side + "_positions"] = torch.cat([packed[side + "_positions"], fill], 1)
        cu = packed["cu_" + side]
        sizes = _chunks(extra, parts)
        added = int(cu[-1]) + np.cumsum(sizes, dtype=np.int64)
        out["cu_" + side] = torch.cat([cu, torch.from_numpy(added).to(cu.dtype),
                                       torch.full((sentences - n - parts,), total, dtype=cu.dtype)])
        out["max_" + side] = max([int(packed["max_" + side])] + sizes)
    return out


def self_varlen(packed, side: str) -> Varlen:
    """The self-attention's packed sequences of ``side`` ("src" or "tgt")."""
    cu, m = packed["cu_" + side], int(packed["max_" + side])
    return Varlen(cu, cu, m, m)


def cross_varlen(packed) -> Varlen:
    """The decoder's cross-attention: target rows as queries, source rows as keys."""
    return Varlen(packed["cu_tgt"], packed["cu_src"], int(packed["max_tgt"]), int(packed["max_src"]))
