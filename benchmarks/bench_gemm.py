"""The projections' GEMMs of transformer-big through ATen and as GEMM tuning chooses (csrc/torch/gemm.cpp).

    python benchmarks/bench_gemm.py --tokens 8192 4096 [--json OUT.json]

For each projection (K -> N) and each of its three GEMMs (forward x W^T, input gradient dY W, weight gradient dY^T x),
in bf16 and in FP8 (e4m3 inputs, e5m2 gradients, fast accumulation): GPU time per GEMM from CUDA-graph replays
(benchmarks/_timing.py) through ATen (torch.mm / torch._scaled_mm) and through the extension with tuning on at the
row count (rows = 0.906 x tokens, as packed batches have them), and the results' difference. "per update" weighs each
GEMM by its uses in one update with encoder and decoder at the same row count.
"""

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from _timing import graphed_ms  # noqa: E402

# name: (K, N, uses per update)
PROJECTIONS = {"qkv": (1024, 3072, 12), "out / cross q, out": (1024, 1024, 24), "ffn 1": (1024, 4096, 12),
               "ffn 2": (4096, 1024, 12), "cross k,v (6 layers)": (1024, 12288, 1), "vocabulary": (1024, 32000, 1)}
ROWS_PER_TOKEN = 0.906  # real rows of a packed batch per --max-tokens (3712 at 4096)


def operands(rows, K, N, fp8):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, K, device="cuda", generator=g) * 0.5
    w = torch.randn(N, K, device="cuda", generator=g) * 0.5
    dy = torch.randn(rows, N, device="cuda", generator=g) * 0.5
    if not fp8:
        x, w, dy = x.bfloat16(), w.bfloat16(), dy.bfloat16()
        return [("forward", x, w.t(), 0), ("input gradient", dy, w, 0), ("weight gradient", dy.t(), x, 1)]
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    xq, wq, gq = x.to(e4), w.to(e4), dy.to(e5)
    xt, wt, gt = x.t().contiguous().to(e4), w.t().contiguous().to(e4), dy.t().contiguous().to(e5)
    return [("forward", xq, wq.t(), 0), ("input gradient", gq, wt.t(), 0), ("weight gradient", gt, xt.t(), 1)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 4096])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from ls_fairseq import _ext

    ext = _ext.get()
    if ext is None or not ext.gemm_tuning_available():
        sys.exit(f"bench_gemm: needs the CUDA extension with cuBLASLt ({_ext.reason()})")
    one = torch.ones((), device="cuda")
    fp8_ok = torch.cuda.get_device_capability() >= (8, 9)
    print(f"{torch.cuda.get_device_name()}, cuBLASLt {ext.gemm_tuning_version()}, torch {torch.__version__}")
    results = []
    for tokens in args.tokens:
        rows = int(round(tokens * ROWS_PER_TOKEN / 16)) * 16
        ext.gemm_tuning_clear()
        ext.gemm_tuning_enable([rows], 8)
        totals = {}
        print(f"\n{tokens} tokens ({rows} rows)\n| GEMM | M x K x N | precision | ATen ms | tuned ms | ATen / tuned "
              "| max rel. diff |\n|---|---|---|---|---|---|---|")
        for prec in (["bf16", "fp8"] if fp8_ok else ["bf16"]):
            for name, (K, N, uses) in PROJECTIONS.items():
                for kind, a, b, token in operands(rows, K, N, prec == "fp8"):
                    if prec == "fp8":
                        aten = lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16, use_fast_accum=True)
                        tuned = lambda: ext.gemm_scaled(a, b, one, one, None, torch.bfloat16, token)
                    else:
                        aten = lambda: torch.mm(a, b)
                        tuned = lambda: ext.gemm_mm(a, b, None, token)
                    ref, got = aten().float(), tuned().float()  # (the first tuned call measures the class)
                    diff = ((got - ref).abs().max() / ref.abs().max()).item()
                    t_aten, t_tuned = graphed_ms(aten), graphed_ms(tuned)
                    m, k, n = a.shape[0], a.shape[1], b.shape[1]
                    print(f"| {name} {kind} | {m} x {k} x {n} | {prec} | {t_aten:.4f} | {t_tuned:.4f} | "
                          f"{t_aten / t_tuned:.2f}x | {diff:.1e} |")
                    tot = totals.setdefault(prec, [0.0, 0.0])
                    tot[0] += uses * t_aten
                    tot[1] += uses * t_tuned
                    results.append(dict(tokens=tokens, rows=rows, projection=name, gemm=kind, precision=prec,
                                        aten_ms=t_aten, tuned_ms=t_tuned, max_rel_diff=diff))
        for prec, (a_ms, t_ms) in totals.items():
            print(f"per update, {prec}: ATen {a_ms:.3f} ms, tuned {t_ms:.3f} ms ({a_ms / t_ms:.3f}x)")
    ext.gemm_tuning_disable()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
