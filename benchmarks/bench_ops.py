"""Op benchmarks: each fused op (forward + backward) against the torch eager reference and torch.compile
of the reference, at transformer-big shapes (hidden 1024, ffn 4096, vocab 32000; 8192 and 4096 tokens).

Times are CUDA-event medians after warm-up. GB/s counts the bytes a fused kernel must move at least
(inputs read once, outputs written once); "%copy" compares with the device copy bandwidth measured in
the same run (read + write of a 1 GiB buffer). Also reports which SDPA backend attention takes with a
key padding mask. Usage: python benchmarks/bench_ops.py [--tokens 8192 4096] [--dtype fp16]

``--fp8`` instead times every projection of transformer-big (forward + backward, bias included) as a bf16 linear
and as an FP8 linear (delayed scaling after one calibration step), splits the FP8 time into GEMMs and
quantisation, and sums both over one update (encoder and decoder at the same token count): what FP8 saves per
update, and what it would save if quantisation were free; then each FP8 GEMM of those projections with full and
with fast accumulation (the latter is what ls_fairseq uses): time, and error against the fp32 product.
"""

import argparse
import sys
import os

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import event_ms, graphed_ms  # noqa: E402
from ls_fairseq import ops  # noqa: E402
from ls_fairseq.ops import _dispatch  # noqa: E402
from ls_fairseq.ops.adam import adam_reference_  # noqa: E402
from ls_fairseq.ops.attention import _split_reference, merge_heads_reference  # noqa: E402
from ls_fairseq.ops.bias_act_dropout import bias_act_dropout_reference  # noqa: E402
from ls_fairseq.ops.bias_dropout_residual import bias_dropout_residual_reference  # noqa: E402
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_reference  # noqa: E402
from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_with_grad  # noqa: E402
from ls_fairseq.ops.embedding import embedding_reference  # noqa: E402
from ls_fairseq.ops.layer_norm import add_layer_norm_reference, layer_norm_reference  # noqa: E402


def cuda_time(fn, warmup=5, reps=25):
    """Wall seconds of one eager call (CUDA events around it, the median of ``reps``)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return event_ms(fn, reps) * 1e-3


def kernel_events(fn, iters=5):
    """(name, GPU seconds per call) of each kernel (and memset/copy) fn runs, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return [(e.name, (e.time_range.end - e.time_range.start) * 1e-6 / iters)
            for e in prof.events() if str(e.device_type).endswith("CUDA")]


def kernel_time(fn, iters=5):
    """GPU time of one call: the summed duration of the kernels it runs, i.e. without the host-side launch
    overhead that dominates short ops."""
    return sum(t for _, t in kernel_events(fn, iters))


def copy_bandwidth():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() / t


def fwd_bwd(fn, inputs, grads):
    """Callable running fn(*inputs) and the backward into `inputs` needing grad."""
    def run():
        outs = fn()
        if not isinstance(outs, (tuple, list)):
            outs = (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return run


def cases(N, dt):
    C, Fh, V, H = 1024, 4096, 32000, 16
    dev = "cuda"
    e = dt.itemsize
    r = lambda *s: torch.randn(*s, device=dev, dtype=dt)  # noqa: E731
    x, res, gy, gs = r(N, C), r(N, C), r(N, C), r(N, C)
    w = (torch.rand(C, device=dev, dtype=dt) + 0.5).requires_grad_(True)
    b = r(C).requires_grad_(True)
    xg, resg = x.clone().requires_grad_(True), res.clone().requires_grad_(True)
    out = []
    out.append(("layer_norm", 5 * N * C * e,
                lambda f: fwd_bwd(lambda: f(xg, w, b), [xg, w, b], [gy]),
                ops.layer_norm, layer_norm_reference))
    out.append(("add_layer_norm", 8 * N * C * e,
                lambda f: fwd_bwd(lambda: f(xg, resg, w, b), [xg, resg, w, b], [gy, gs]),
                ops.add_layer_norm, add_layer_norm_reference))
    bdr_ref = lambda a, bb, rr: bias_dropout_residual_reference(a, bb, rr, 0.1, True)  # noqa: E731
    bdr = lambda a, bb, rr: ops.bias_dropout_residual(a, bb, rr, 0.1, True)  # noqa: E731
    out.append(("bias_dropout_residual p=.1", 5 * N * C * e + 2 * N * C // 8,
                lambda f: fwd_bwd(lambda: f(xg, b, resg), [xg, b, resg], [gy]), bdr, bdr_ref))
    xf, gf = r(N, Fh).requires_grad_(True), r(N, Fh)
    bf = r(Fh).requires_grad_(True)
    for act, nb in (("relu", 5 * N * Fh * e + N * Fh // 8), ("gelu", 5 * N * Fh * e + 2 * N * Fh // 8)):
        fu = lambda a, bb, act=act: ops.bias_act_dropout(a, bb, act, 0.1, True)  # noqa: E731
        rf = lambda a, bb, act=act: bias_act_dropout_reference(a, bb, act, 0.1, True)  # noqa: E731
        out.append((f"bias_{act}_dropout p=.1 (ffn)", nb,
                    lambda f: fwd_bwd(lambda: f(xf, bf), [xf, bf], [gf]), fu, rf))
    B, T = N // 128, 128
    tokens = torch.randint(2, V, (B, T), device=dev)
    positions = torch.arange(2, T + 2, device=dev).expand(B, T).contiguous()
    W = (r(V, C) * 0.02).requires_grad_(True)
    P = r(T + 2, C)
    ge = r(B, T, C)
    emb = lambda tk, ww: ops.embedding(tk, ww, P, positions, scale=32.0, p=0.1, zero_pad=True)  # noqa: E731
    emb_ref = lambda tk, ww: embedding_reference(tk, ww, P, positions, 32.0, 0.1, True, 1, True)  # noqa: E731
    out.append(("embedding p=.1", 4 * N * C * e + V * C * e + N * C * e + N * C // 8,
                lambda f: fwd_bwd(lambda: f(tokens, W), [W], [ge]), emb, emb_ref))
    qkv = r(B, T, 3 * C).requires_grad_(True)
    qb = r(3 * C).requires_grad_(True)
    gq = [r(B, H, T, C // H) for _ in range(3)]
    out.append(("qkv_split (+bias)", 12 * N * C * e,
                lambda f: fwd_bwd(lambda: f(qkv, qb), [qkv, qb], gq),
                lambda a, bb: ops.qkv_split(a, bb, H), lambda a, bb: _split_reference(a, bb, 3, H)))
    mh = r(B, H, T, C // H).requires_grad_(True)
    out.append(("merge_heads", 4 * N * C * e,
                lambda f: fwd_bwd(lambda: f(mh), [mh], [ge]), ops.merge_heads, merge_heads_reference))
    logits = (r(N, V) * 2).requires_grad_(True)
    tgt = torch.randint(0, V, (N,), device=dev)
    tgt[::17] = 1
    ce = lambda lg: ops.label_smoothed_cross_entropy(lg, tgt, 0.1, 1)  # noqa: E731
    ce_ref = lambda lg: label_smoothed_cross_entropy_reference(lg, tgt, 0.1, 1)  # noqa: E731
    one = torch.ones((), device=dev)
    out.append(("label_smoothed_ce V=32000", 3 * N * V * e,
                lambda f: fwd_bwd(lambda: f(logits), [logits], [one, None]), ce, ce_ref))
    # loss and gradient in one kernel, written over the logits (the references: autograd as above); the buffer
    # holds gradients after the first call, which does not change the time
    buf = r(N, V) * 2
    ce_wg = lambda lg: label_smoothed_cross_entropy_with_grad(lg, tgt, 0.1, 1)  # noqa: E731
    out.append(("label_smoothed_ce_with_grad V=32000", 2 * N * V * e,
                lambda f: (lambda: f(buf)) if f is ce_wg else fwd_bwd(lambda: f(logits), [logits], [one, None]),
                ce_wg, ce_ref))
    return out


def bench_adam(n, dt):
    dev = "cuda"
    p, m, v = torch.randn(n, device=dev), torch.zeros(n, device=dev), torch.zeros(n, device=dev)
    g = torch.randn(n, device=dev).to(dt)
    lp = p.to(dt)
    hp = dict(lr=1e-4, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.01, step=3, grad_scale=0.5)
    fused = lambda: ops.adam_(p, g, m, v, param_lp=lp, **hp)  # noqa: E731
    ref = lambda: adam_reference_(p, g, m, v, param_lp=lp, **hp)  # noqa: E731
    comp = torch.compile(adam_reference_)
    compd = lambda: comp(p, g, m, v, param_lp=lp, **hp)  # noqa: E731
    nbytes = n * (24 + 2 * dt.itemsize)
    rows = [("adam_ (fairseq, +param_lp)", nbytes, (fused, ref, compd))]
    if dt == torch.bfloat16:  # the split master (bf16 weights + int16 remainders) that ls_adam keeps for bf16
        from ls_fairseq.ops.adam import split_master

        w, lo = split_master(p)
        sf = lambda: ops.adam_(w, g, m, v, param_lo=lo, **hp)  # noqa: E731
        sr = lambda: adam_reference_(w, g, m, v, param_lo=lo, **hp)  # noqa: E731
        sc = lambda: comp(w, g, m, v, param_lo=lo, **hp)  # noqa: E731
        rows.append(("adam_ (fairseq, split bf16 master)", n * (20 + 3 * dt.itemsize), (sf, sr, sc)))
    gn_c = torch.compile(lambda t: t.float().norm(2))
    rows.append(("grad_norm", n * dt.itemsize, (lambda: ops.grad_norm(g), lambda: g.float().norm(2),
                                                lambda: gn_c(g))))
    return rows


def sdpa_report(dt):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, T, D = 64, 16, 128, 64
    q, k, v = (torch.randn(B, H, T, D, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    kpm = torch.zeros(B, T, dtype=torch.bool, device="cuda")
    kpm[:, 100:] = True
    lines = []
    for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        def run():
            o = ops.attention(q, k, v, key_padding_mask=kpm, p=0.1)
            o.sum().backward()
        try:
            with sdpa_kernel([be]):
                t = cuda_time(run, warmup=2, reps=10)
            lines.append(f"  {name:9s}: ok, fwd+bwd {t * 1e3:.3f} ms")
        except Exception as e:  # noqa: BLE001
            lines.append(f"  {name:9s}: not usable ({str(e).splitlines()[0][:110]})")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        o = ops.attention(q, k, v, key_padding_mask=kpm, p=0.1)
        o.sum().backward()
        torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages() if "attention" in e.key.lower() or "fmha" in e.key.lower()
                    or "flash" in e.key.lower() or "cudnn" in e.key.lower()})
    lines.append("  default picks kernels: " + "; ".join(n[:90] for n in names[:6]))
    return lines


# transformer-big's projections: (name, K, N, uses per update with the encoder and decoder at N tokens each, bias)
FP8_LINEARS = [("self-attn qkv", 1024, 3072, 12, True), ("self-attn out", 1024, 1024, 12, True),
               ("ffn 1", 1024, 4096, 12, True), ("ffn 2", 4096, 1024, 12, True), ("cross-attn q", 1024, 1024, 6, True),
               ("cross-attn out", 1024, 1024, 6, True), ("cross-attn k,v (6 layers)", 1024, 12288, 1, True)]
FP8_VOCABULARY = ("vocabulary", 1024, 32000, 1, False)  # reported apart from the layers' total
QUANT_KERNELS = ("amax_kernel", "cast_kernel", "roll_kernel")


def fp8_projection(N, name, k, n, count, with_bias):
    """Prints one projection's row; returns its (bf16, fp8, fp8 GEMMs) GPU seconds per update."""
    from ls_fairseq.ops import fp8 as F8

    dt = torch.bfloat16
    x = torch.randn(N, k, device="cuda", dtype=dt, requires_grad=True)
    w = (torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5).requires_grad_()
    b = torch.zeros(n, device="cuda", dtype=dt, requires_grad=True) if with_bias else None
    dy = torch.randn(N, n, device="cuda", dtype=dt)
    state = torch.zeros(3, F8.WIDTH, device="cuda")
    base = F8.mode_of(True, "e5m2")
    ops.linear(x, w, b, fp8=F8.Fp8Use(base + 2, state, 0)).backward(dy)  # calibrate: current scaling
    F8.fp8_roll(state, F8.E5M2)
    use = F8.Fp8Use(base, state, 0)
    t_bf = sum(t for _, t in kernel_events(fwd_bwd(lambda: ops.linear(x, w, b), [x, w, b], [dy])))
    ev = kernel_events(fwd_bwd(lambda: ops.linear(x, w, b, fp8=use), [x, w, b], [dy]))
    t_f8 = sum(t for _, t in ev)
    t_q = sum(t for nm, t in ev if any(q in nm for q in QUANT_KERNELS))
    print(f"| {name} | {k} -> {n} | {count} | {t_bf * 1e3:.3f} | {t_f8 * 1e3:.3f} | {(t_f8 - t_q) * 1e3:.3f} | "
          f"{t_q * 1e3:.3f} | {t_bf / t_f8:.2f}x | {t_bf / (t_f8 - t_q):.2f}x |", flush=True)
    return count * t_bf, count * t_f8, count * (t_f8 - t_q)


def fp8_total(label, bf, f8, gemm):
    print(f"| {label} | | | {bf * 1e3:.2f} | {f8 * 1e3:.2f} | {gemm * 1e3:.2f} | {(f8 - gemm) * 1e3:.2f} | "
          f"{bf / f8:.2f}x | {bf / gemm:.2f}x |")


def fp8_report(N):
    print(f"\nFP8 linear layers at {N} tokens (bf16 activations; GPU ms of forward + backward, profiler):\n")
    print("| projection | K -> N | per update | bf16 | fp8 | fp8 GEMMs | fp8 quantisation | fp8 / bf16 | "
          "GEMMs only / bf16 |")
    print("|" + "---|" * 9)
    tot = [0.0, 0.0, 0.0]  # bf16, fp8, fp8 GEMMs
    for spec in FP8_LINEARS:
        tot = [a + b for a, b in zip(tot, fp8_projection(N, *spec))]
    fp8_total("layers, one update", *tot)
    tot = [a + b for a, b in zip(tot, fp8_projection(N, *FP8_VOCABULARY))]
    fp8_total("all with the vocabulary", *tot)
    print(f"\nper update: FP8 saves {(tot[0] - tot[1]) * 1e3:.2f} ms of linear-layer GPU time; with free "
          f"quantisation it would save {(tot[0] - tot[2]) * 1e3:.2f} ms.")


def _codes(t, fmt):
    """(codes of the 2-d ``t`` in format ``fmt``, its transposed codes, the dequantisation factor), scaled by its own
    maximum as ls_fairseq's first (current-scaling) step does."""
    from ls_fairseq.ops import fp8 as F8

    state = torch.zeros(1, F8.WIDTH, device=t.device)
    q, q_t = F8.fp8_quantize_reference(t, state, 0, fmt, current=True)
    return q, q_t, state[0, F8.SCALE_INV].clone()


def fp8_gemm_cases(N, device="cuda"):
    """[(label, (M, K, N), run(fast_accum) -> bf16 product, fp32 product of the same codes, the same product in
    bf16)] for the GEMMs of the FP8 projections at N tokens: forward (e4m3 x e4m3), input and weight gradient (e5m2
    gradient x e4m3)."""
    from ls_fairseq.ops.fp8 import E4M3, E5M2

    out = []
    for name, k, n, _, _ in FP8_LINEARS:
        if k * n < 1024 * 3072:  # the projections --fp8-projections auto runs in FP8
            continue
        g = torch.Generator(device=device).manual_seed(k + n)
        x = torch.randn(N, k, device=device, generator=g, dtype=torch.float32).to(torch.bfloat16)
        w = (torch.randn(n, k, device=device, generator=g) / k ** 0.5).to(torch.bfloat16)
        dy = (1e-3 * torch.randn(N, n, device=device, generator=g)).to(torch.bfloat16)
        xq, xq_t, sx = _codes(x, E4M3)
        wq, wq_t, sw = _codes(w, E4M3)
        gq, gq_t, sg = _codes(dy, E5M2)

        def mm(a, b, sa, sb):  # a [M, K] row-major, b [K, N] column-major
            ab, bb = a.to(torch.bfloat16), b.t().to(torch.bfloat16).t()  # the bf16 GEMM of the same layouts
            return (lambda fast: torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast),
                    lambda: (a.float() * sa) @ (b.float() * sb),
                    lambda: ab @ bb)

        out += [(f"{name} forward", (N, k, n)) + mm(xq, wq.t(), sx, sw),
                (f"{name} input gradient", (N, n, k)) + mm(gq, wq_t.t(), sg, sw),
                (f"{name} weight gradient", (n, N, k)) + mm(gq_t, xq_t.t(), sg, sx)]
    return out


def fp8_accumulation_report(N):
    """Each FP8 GEMM with full (fp32-promoted) and fast accumulation, against the bf16 GEMM of the same shape: GPU
    time (CUDA-graph replays) and error against fp32."""
    print(f"\nFP8 GEMMs at {N} tokens, full against fast accumulation, and the bf16 GEMM of the same shape "
          "(torch._scaled_mm, bf16 output; GPU ms per GEMM, median of CUDA-graph replays of 10 back-to-back calls; "
          "error: |product - fp32 product of the same codes| / |fp32 product|):\n")
    print("| GEMM | M x K x N | bf16 ms | full ms | fast ms | fast / full | bf16 / fast | fast TFLOP/s | "
          "error full / fast |")
    print("|" + "---|" * 9)
    for label, (m, k, n), run, exact, bf16 in fp8_gemm_cases(N):
        ref = exact()
        t = {fast: graphed_ms(lambda: run(fast)) for fast in (False, True)}
        t_bf = graphed_ms(bf16)
        err = {fast: ((run(fast).float() - ref).norm() / ref.norm()).item() for fast in (False, True)}
        print(f"| {label} | {m} x {k} x {n} | {t_bf:.4f} | {t[False]:.4f} | {t[True]:.4f} | "
              f"{t[False] / t[True]:.2f}x | {t_bf / t[True]:.2f}x | {2 * m * k * n / t[True] / 1e9:.0f} | "
              f"{err[False]:.2e} / {err[True]:.2e} |", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 4096])
    ap.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"])
    ap.add_argument("--adam-numel", type=int, default=100_000_000)
    ap.add_argument("--fp8", action="store_true", help="time the FP8 linear layers against bf16 instead")
    args = ap.parse_args()
    if args.fp8:
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
        for N in args.tokens:
            fp8_report(N)
            fp8_accumulation_report(N)
        return
    dt = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  dtype {args.dtype}")
    print(f"kernel path: {_dispatch.explain('layer_norm')}")
    bw = copy_bandwidth()
    print(f"copy bandwidth (read+write): {bw / 1e9:.0f} GB/s\n")
    print("GPU ms: summed kernel time (profiler); wall ms: CUDA events around the Python call (includes")
    print("launch overhead). GB/s and %copy from the fused GPU time; speed-ups from GPU times, wall in ().\n")
    hdr = ("| op | tokens | fused GPU ms | fused wall ms | GB/s | %copy | eager GPU ms | compile GPU ms | "
           "vs eager | vs compile |")
    print(hdr)
    print("|" + "---|" * 10)
    for N in args.tokens:
        for name, nbytes, mk, fused, ref in cases(N, dt):
            try:
                comp = torch.compile(ref)
                wf, we, wc = cuda_time(mk(fused)), cuda_time(mk(ref)), cuda_time(mk(comp))
                tf, te, tc = kernel_time(mk(fused)), kernel_time(mk(ref)), kernel_time(mk(comp))
            except Exception as e:  # noqa: BLE001
                print(f"| {name} | {N} | failed: {type(e).__name__}: {str(e)[:100]} |")
                continue
            print(f"| {name} | {N} | {tf * 1e3:.3f} | {wf * 1e3:.3f} | {nbytes / tf / 1e9:.0f} | "
                  f"{100 * nbytes / tf / bw:.0f}% | {te * 1e3:.3f} | {tc * 1e3:.3f} | "
                  f"{te / tf:.2f}x ({we / wf:.2f}x) | {tc / tf:.2f}x ({wc / wf:.2f}x) |", flush=True)
    for name, nbytes, fns in bench_adam(args.adam_numel, dt):
        (wf, tf), (we, te), (wc, tc) = [(cuda_time(f), kernel_time(f)) for f in fns]
        print(f"| {name} | n={args.adam_numel} | {tf * 1e3:.3f} | {wf * 1e3:.3f} | {nbytes / tf / 1e9:.0f} | "
              f"{100 * nbytes / tf / bw:.0f}% | {te * 1e3:.3f} | {tc * 1e3:.3f} | "
              f"{te / tf:.2f}x ({we / wf:.2f}x) | {tc / tf:.2f}x ({wc / wf:.2f}x) |")
    print("\nSDPA backends with a key padding mask (B=64, H=16, T=S=128, D=64, dropout 0.1, fwd+bwd):")
    for line in sdpa_report(dt):
        print(line)


if __name__ == "__main__":
    main()
