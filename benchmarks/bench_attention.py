"""Attention forward + backward at the (batch, length) shapes fairseq's --max-tokens batching makes.

For each length T (batch = tokens // T; 16 heads of 64, fp16, dropout 0.1) and mask kind (none, causal, key
padding): GPU ms per fwd+bwd of ten calls captured in one CUDA graph, median of five replays, for ls_fairseq's
ops.attention (``ls``), SDPA's memory-efficient, flash, math and cuDNN backends alone, and the batched GEMMs of an
explicit-scores attention (``gemm``, the floor of a scores-materialising implementation).

    python benchmarks/bench_attention.py [--tokens 8192] [--lengths 16,32,64,128,256]

``--classes``: the short-sequence kernels per class of lengths as the packed training step launches them
(lengths drawn from make_wmt_synth.py's law within (0, 32], (32, 64], (64, 128]; bf16), forward and backward in
GPU microseconds with the bytes each must move. ``--packed MAX``: packed sequences of T-token sentences through
ops.attention told the longest is T or a longer MAX (as a packed shape bucket passes it), and through flash's
varlen kernel.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import graphed_ms  # noqa: E402


def timed_or_nan(fn):
    """graphed_ms(fn), or nan where the backend has no kernel for this mask / shape (flash with a padding mask)."""
    try:
        return graphed_ms(fn)
    except RuntimeError:
        return float("nan")


def packed(args):
    """Packed sequences (module docstring, --packed)."""
    import torch

    from ls_fairseq import ops
    from ls_fairseq.ops.attention import Varlen

    H, D, p = args.heads, args.head_dim, args.p
    maxes = [int(m) for m in args.packed.split(",")]
    print(f"{'T':>4} {'seqs':>5} " + " ".join(f"{'max=' + str(m):>8}" for m in ["T"] + maxes) + f" {'flash':>8}")
    for T in (int(t) for t in args.lengths.split(",")):
        n = max(1, args.tokens // T)
        cu = torch.arange(0, (n + 1) * T, T, device="cuda", dtype=torch.int32)
        q, k, v = (torch.randn(1, n * T, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                   .requires_grad_(True) for _ in range(3))
        g = torch.randn_like(q)

        def run_ls(m):
            def run():
                out = ops.attention(q, k, v, causal=True, p=p, varlen=Varlen(cu, cu, m, m))
                torch.autograd.grad(out, (q, k, v), g)
            return run

        def run_flash():
            out = torch.ops.aten._flash_attention_forward(q.transpose(1, 2)[0], k.transpose(1, 2)[0],
                                                          v.transpose(1, 2)[0], cu, cu, T, T, p, True, False)[0]
            torch.autograd.grad(out, (q, k, v), g.transpose(1, 2)[0])

        row = [graphed_ms(run_ls(m)) if m >= T else float("nan") for m in [T] + maxes] + [graphed_ms(run_flash)]
        print(f"{T:4d} {n:5d} " + " ".join(f"{x:8.3f}" for x in row), flush=True)


def classes(args):
    """Per class of lengths, corpus-like packed sentences (module docstring, --classes)."""
    import numpy as np
    import torch

    from ls_fairseq import ops
    from ls_fairseq.ops.attention import Varlen
    from make_wmt_synth import source_lengths

    H, D, p = args.heads, args.head_dim, args.p
    rng = np.random.default_rng(1)

    def lengths(lo, hi):
        out, total = [], 0
        while total < args.tokens:
            n = int(source_lengths(1, rng)[0]) + 1  # with end-of-sentence
            if lo < n <= hi:
                out.append(n)
                total += n
        return out

    print(f"{'class':>10} {'causal':>6} {'seqs':>5} {'fwd us':>8} {'TB/s':>6} {'bwd us':>8} {'TB/s':>6}")
    total = 0.0
    for lo, hi in ((0, 32), (32, 64), (64, 128)):
        for causal in (False, True):
            n = lengths(lo, hi)
            cu = torch.tensor([0] + list(np.cumsum(n)), dtype=torch.int32, device="cuda")
            rows = int(cu[-1])
            q, k, v = (torch.randn(1, rows, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
                       .requires_grad_(True) for _ in range(3))
            g = torch.randn_like(q)
            varlen = Varlen(cu, cu, hi, hi)

            def fwd():
                return ops.attention(q, k, v, causal=causal, p=p, varlen=varlen)

            def fwd_bwd():
                torch.autograd.grad(fwd(), (q, k, v), g)

            f = graphed_ms(fwd)
            b = graphed_ms(fwd_bwd) - f
            total += f + b
            tensor = rows * H * D * 2  # bytes of one [rows, H, D] tensor
            print(f"{f'({lo},{hi}]':>10} {int(causal):6d} {len(n):5d} {f * 1e3:8.1f} {4 * tensor / f / 1e9:6.2f} "
                  f"{b * 1e3:8.1f} {8 * tensor / b / 1e9:6.2f}", flush=True)
    print(f"all six, forward + backward: {total:.3f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--lengths", default="16,32,48,64,96,128,192,256")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--packed", default=None, help="longest lengths the packed kernels are sized for (a list)")
    ap.add_argument("--classes", action="store_true", help="per class of lengths, corpus-like packed sentences")
    args = ap.parse_args()
    if args.classes:
        return classes(args)
    if args.packed:
        return packed(args)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ls_fairseq import ops

    H, D, p = args.heads, args.head_dim, args.p
    print(f"{'T':>4} {'B':>5} {'mask':>8} {'ls':>8} {'memeff':>8} {'flash':>8} {'math':>8} {'gemm':>8} {'cudnn':>8}"
          f"  ls/best SDPA")
    for T in (int(t) for t in args.lengths.split(",")):
        B = max(1, args.tokens // T)
        for kind in ("none", "causal", "padding"):
            q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=torch.float16, requires_grad=True)
                       for _ in range(3))
            g = torch.randn(B, H, T, D, device="cuda", dtype=torch.float16)
            kpm = None
            if kind == "padding":
                lengths = torch.randint(max(1, T // 2), T + 1, (B,), device="cuda")
                kpm = torch.arange(T, device="cuda")[None, :] >= lengths[:, None]
            causal = kind == "causal"

            def run_ls():
                out = ops.attention(q, k, v, key_padding_mask=kpm, causal=causal, p=p, training=True)
                torch.autograd.grad(out, (q, k, v), g)

            def sdpa(backends):
                def run():
                    mask = ops.attention.__globals__["_attn_mask"](q, k, kpm, causal)
                    with sdpa_kernel(backends):
                        if mask is None:
                            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p)
                        else:
                            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
                    torch.autograd.grad(out, (q, k, v), g)
                return run

            q2, k2, v2 = (t.detach().reshape(B * H, T, D) for t in (q, k, v))
            s = torch.empty(B * H, T, T, device="cuda", dtype=torch.float16)

            def run_gemm():
                torch.bmm(q2, k2.transpose(1, 2), out=s)
                o = torch.bmm(s, v2)
                torch.bmm(s.transpose(1, 2), o)  # dV
                ds = torch.bmm(o, v2.transpose(1, 2))  # dP
                torch.bmm(ds, k2)  # dQ
                torch.bmm(ds.transpose(1, 2), q2)  # dK

            row = [graphed_ms(run_ls)]
            for backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
                row.append(timed_or_nan(sdpa([backend])))
            row.append(graphed_ms(run_gemm))
            row.append(timed_or_nan(sdpa([SDPBackend.CUDNN_ATTENTION])))
            best = min(x for x in (row[1], row[2], row[3], row[5]) if x == x)
            print(f"{T:4d} {B:5d} {kind:>8} " + " ".join(f"{x:8.3f}" for x in row) + f"  {row[0] / best:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
