"""End-to-end training throughput: native fairseq vs ls_fairseq, in ONE process tree.

For each (arch, --max-tokens, precision) it trains native `transformer_*` (adam +
label_smoothed_cross_entropy) and `ls_transformer_*` (ls_adam +
ls_label_smoothed_cross_entropy) with otherwise identical flags on the WMT14-shaped
synthetic corpus, and reports target words/s in epoch 1 and in steady state (mean of
epochs >= 2), peak GPU memory, MFU (model FLOPs / measured fp16 GEMM peak) and ls/native.

    python benchmarks/bench_train.py --out OUT [--pairs 120000] [--epochs 3]
        [--archs transformer_wmt_en_de_big_t2t,transformer_wmt_en_de_big] [--max-tokens 4096,8192,16384]
        [--bf16]
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

COMMON = [
    "--task", "translation", "-s", "src", "-t", "tgt", "--share-all-embeddings",
    "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000",
    "--adam-betas", "(0.9, 0.98)", "--label-smoothing", "0.1", "--seed", "1",
    "--no-save", "--disable-validation", "--log-format", "simple", "--log-interval", "100",
    "--num-workers", "4", "--skip-invalid-size-inputs-valid-test",
]


def measure_peak_tflops():
    import torch

    if not torch.cuda.is_available():
        return None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * 20 / (start.elapsed_time(end) / 1e3) / 1e12


def model_dims(arch):
    big = "big" in arch
    return dict(d=1024 if big else 512, ffn=4096 if big else 2048, layers=6)


def epoch_flops(data, arch, vocab):
    """Training FLOPs (3x forward) for one pass over the train split, from its lengths."""
    from fairseq.data import data_utils

    def sizes(lang):  # keep the mmap'd dataset alive while its sizes are copied
        ds = data_utils.load_indexed_dataset(os.path.join(data, f"train.src-tgt.{lang}"), None)
        return np.array(ds.sizes, dtype=np.float64)

    src, tgt = sizes("src"), sizes("tgt")
    m = model_dims(arch)
    d, f, L = m["d"], m["ffn"], m["layers"]
    enc_tok = 2 * L * (4 * d * d + 2 * d * f)          # per source token
    cross_kv = 2 * L * 2 * d * d                        # per source token (decoder K/V)
    dec_tok = 2 * L * (4 * d * d + 2 * d * d + 2 * d * f) + 2 * d * vocab  # per target token
    attn = 4 * d * L * ((src ** 2).sum() + 0.5 * (tgt ** 2).sum() + (src * tgt).sum())
    fwd = enc_tok * src.sum() + cross_kv * src.sum() + dec_tok * tgt.sum() + attn
    return 3 * fwd, tgt.sum()


MEMORY_MODES = {"ls_mem": ["--ls-invertible-layernorm", "--ls-recompute-activation", "--ls-recompute-logits"],
                "ls_inv": ["--ls-invertible-layernorm"], "ls_recompute": ["--ls-recompute-activation"],
                "ls_logits": ["--ls-recompute-logits"]}


def run(kind, arch, max_tokens, precision, data, epochs, out, entry=None):
    """One training run; ``entry``: the train_entry.py to run (another checkout's, for a baseline)."""
    ls = kind.startswith("ls")  # "ls", or "ls_me": ls with --memory-efficient-fp16/bf16
    a = ("ls_" + arch) if ls else arch
    flags = [data, "--arch", a, "--max-tokens", str(max_tokens), "--max-epoch", str(epochs)] + COMMON
    mode = {"ls_fairseq_train": "fairseq", "ls_deepspeed": "deepspeed"}.get(kind, "ls" if ls else "native")
    if mode == "deepspeed":  # DeepSpeed's optimizer and precision, from its config (ZeRO 0 on one GPU)
        flags += ["--optimizer", "adam", "--criterion", "ls_label_smoothed_cross_entropy", "--deepspeed_config",
                  os.path.join(ROOT, "configs", "deepspeed", {"fp16": "ds_fp16_zero0.json", "bf16": "ds_bf16_zero1.json",
                                                              "fp32": "ds_cpu_fp32.json"}[precision])]
    else:
        flags += ["--optimizer", "ls_adam", "--criterion", "ls_label_smoothed_cross_entropy"] if ls else \
            ["--optimizer", "adam", "--criterion", "label_smoothed_cross_entropy"]
        flags += {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[precision]
    if mode == "fairseq":  # plain fairseq-train with the plugin as --user-dir
        flags += ["--user-dir", os.path.join(ROOT, "user_dir")]
    if kind == "ls_me" and precision in ("fp16", "bf16"):
        flags += [f"--memory-efficient-{precision}"]
    if kind.startswith("ls_eager"):  # lightseq-train without its CUDA-graph step
        flags += ["--ls-graph-step", "off"]
    if kind.startswith("ls_buckets"):  # ls_buckets128: the CUDA-graph step with that many shape buckets
        flags += ["--ls-graph-buckets", kind[len("ls_buckets"):]]
    if kind.startswith("ls_fp8"):  # ls_fp8 (default gradient format), ls_fp8_e4m3, ls_fp8_e5m2
        flags += ["--fp8"] + (["--fp8-grad-format", kind.rsplit("_", 1)[1]] if kind.count("_") == 2 else [])
    flags += MEMORY_MODES.get(kind, [])
    name = f"{kind}_{arch}_{max_tokens}_{precision}"
    log_path = os.path.join(out, name + ".log")
    cmd = [sys.executable, entry or os.path.join(HERE, "train_entry.py"), mode] + flags
    # ..._py_layers: the layers' forward in Python (no one-call C++ layer); ..._py_ops: also every fused op through
    # its Python autograd.Function (no C++ autograd node): docs/op_paths.md
    env = dict(os.environ)
    for path in ("py_layers", "py_ops"):
        if kind.endswith("_" + path):
            env["BENCH_PY_PATHS"] = path
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    text = open(log_path).read()
    epochs_seen = [(int(e), float(s), int(w)) for e, s, w in
                   re.findall(r"BENCH epoch=(\d+) seconds=([\d.]+) tgt_tokens=(\d+)", text)]
    peak = re.findall(r"BENCH peak_mem_gb=([\d.]+)", text)
    res = {"name": name, "rc": rc, "wall": time.time() - t0, "epochs": epochs_seen,
           "peak_mem_gb": float(peak[-1]) if peak else None, "cmd": " ".join(cmd)}
    if rc != 0:
        res["error_tail"] = text[-3000:]
    return res


def summarize(res, flops_epoch, peak_tflops):
    ep = res["epochs"]
    if not ep or any(w <= 0 for _, _, w in ep):
        return None  # nothing counted: no speed to report
    wps1 = ep[0][2] / ep[0][1]
    steady = [w / s for e, s, w in ep[1:]]
    wps_s = float(np.mean(steady)) if steady else float("nan")
    secs = [s for e, s, w in ep[1:]]
    mfu = (flops_epoch / np.mean(secs) / 1e12 / peak_tflops) if (secs and peak_tflops) else float("nan")
    return dict(wps_epoch1=wps1, wps_steady=wps_s, epoch1_over_steady=wps1 / wps_s if steady else float("nan"),
                mfu=mfu, peak_mem_gb=res["peak_mem_gb"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None, help="existing data-bin (default: generate into OUT/data)")
    ap.add_argument("--pairs", type=int, default=120_000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--archs", default="transformer_wmt_en_de_big_t2t,transformer_wmt_en_de_big")
    ap.add_argument("--max-tokens", default="4096,8192,16384")
    ap.add_argument("--kinds", default="native,ls",
                    help="comma-separated: native, ls (lightseq-train's defaults), ls_fairseq_train (fairseq-train "
                         "--user-dir with the ls components), ls_deepspeed (lightseq-deepspeed, one process), "
                         "ls_eager (--ls-graph-step off), ls_py_layers / ls_eager_py_layers (the layers in "
                         "Python), ls_py_ops / ls_eager_py_ops (also the ops' Python autograd.Functions), "
                         "ls_buckets<K> (--ls-graph-buckets K), "
                         "ls_fp8 (--fp8), ls_fp8_e4m3 / ls_fp8_e5m2 (--fp8 with that gradient format), "
                         "ls_mem (all memory modes), ls_inv / ls_recompute / ls_logits (one of them)")
    ap.add_argument("--bf16", action="store_true", help="also run ls in bf16 (native fairseq cannot)")
    ap.add_argument("--precision", default="fp16", choices=["fp16", "bf16", "fp32"], help="fp32: CPU smoke test")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = args.data or os.path.join(args.out, "data")
    if not os.path.exists(os.path.join(data, "dict.src.txt")):
        subprocess.check_call([sys.executable, os.path.join(HERE, "make_wmt_synth.py"), data,
                               "--pairs", str(args.pairs)])
    vocab = sum(1 for _ in open(os.path.join(data, "dict.src.txt"))) + 4
    peak = measure_peak_tflops()
    print(f"measured fp16 GEMM peak: {peak and round(peak, 1)} TFLOP/s", flush=True)
    rows = []
    for arch in args.archs.split(","):
        flops, _ = epoch_flops(data, arch, vocab)
        for mt in [int(x) for x in args.max_tokens.split(",")]:
            pair = {}
            kinds = args.kinds.split(",")
            runs = [(k, args.precision) for k in kinds] + [(k, "bf16") for k in kinds if args.bf16 and k != "native"]
            for kind, prec in runs:
                r = run(kind, arch, mt, prec, data, args.epochs, args.out)
                s = summarize(r, flops, peak)
                pair[(kind, prec)] = s
                rows.append({**r, "summary": s, "arch": arch, "max_tokens": mt, "kind": kind, "precision": prec})
                print(json.dumps({k: v for k, v in rows[-1].items() if k != "cmd"}, default=str), flush=True)
            nat = pair.get(("native", args.precision))
            for (kind, prec), s in pair.items():
                if nat and s and kind != "native":
                    print(f"RATIO {arch} max_tokens={mt} {kind} {prec} / native {args.precision}: steady "
                          f"{s['wps_steady'] / nat['wps_steady']:.2f}x, epoch1 {s['wps_epoch1'] / nat['wps_epoch1']:.2f}x, "
                          f"peak mem {s['peak_mem_gb']} vs {nat['peak_mem_gb']} GB", flush=True)
    with open(os.path.join(args.out, "bench_train.json"), "w") as f:
        json.dump(rows, f, indent=1, default=str)
    print("\n| arch | max-tokens | run | wps epoch 1 | wps steady | ep1/steady | peak GB | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["summary"]
        if s is None:
            print(f"| {r['arch']} | {r['max_tokens']} | {r['kind']} {r['precision']} | FAILED rc={r['rc']} | | | | |")
            continue
        print(f"| {r['arch']} | {r['max_tokens']} | {r['kind']} {r['precision']} | {s['wps_epoch1']:.0f} | "
              f"{s['wps_steady']:.0f} | {s['epoch1_over_steady']:.2f} | {s['peak_mem_gb']} | {s['mfu']:.3f} |")


if __name__ == "__main__":
    main()
