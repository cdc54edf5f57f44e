"""Training quality, native fairseq vs ls_fairseq, from the same seed on a learnable corpus.

Generates the rule-based toy language of the demo at scale (scripts/make_toy_corpus.py),
binarizes it, then trains each run with identical flags and the same seed, validating every
--validate-every updates, and translates the test set with beam 4. Prints the validation-loss
curves side by side, the final sacreBLEU of each run and the relative differences to native.

    python benchmarks/quality.py --out OUT [--pairs 300000] [--arch transformer_wmt_en_de]
        [--max-update 2000] [--validate-every 250] [--lr 3e-4] [--clip-norm 1.0] [--schedule linear_decay]
        [--runs native_fp16,ls_fp16,ls_bf16,ls-fp8_bf16,ls-fp8-e4m3_bf16,ls-fp8-all_bf16]
    python benchmarks/quality.py --out /tmp/q --cpu-smoke      # tiny, fp32, on the CPU

Runs: KIND_PRECISION, KIND one of native, ls, ls-fp8 (--fp8) and ls-fp8 with options: -e4m3 / -e5m2 (the gradient
format), -all (--fp8-projections all: every projection in FP8, the vocabulary projection too, which the toy
vocabulary is too small for under auto).
"""

import argparse
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def sh(cmd, log_path):
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    text = open(log_path).read()
    if rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{text[-3000:]}")
    return text


def prepare(out, pairs, workers):
    raw, bin_dir = os.path.join(out, "raw"), os.path.join(out, "bin")
    if os.path.exists(os.path.join(bin_dir, "dict.src.txt")):
        return bin_dir
    sh([sys.executable, os.path.join(ROOT, "scripts", "make_toy_corpus.py"), "--out", raw, "--train", str(pairs),
        "--valid", "2000", "--test", "2000"], os.path.join(out, "corpus.log"))
    sh(["fairseq-preprocess", "--source-lang", "src", "--target-lang", "tgt", "--joined-dictionary",
        "--trainpref", os.path.join(raw, "train"), "--validpref", os.path.join(raw, "valid"),
        "--testpref", os.path.join(raw, "test"), "--destdir", bin_dir, "--workers", str(workers),
        "--padding-factor", "16"],  # a vocabulary of a multiple of 16: FP8 can take the vocabulary projection
       os.path.join(out, "preprocess.log"))
    return bin_dir


# inverse_sqrt: the WMT recipe's schedule; the learning rate is still high when the toy corpus is learned,
# and single validation points then jump by a few percent for native and ls alike (RESULTS.md).
# linear_decay: warm-up, then linearly to 0 at --max-update, so that the end point compares two settled
# models rather than two snapshots of a still-noisy trajectory.
SCHEDULES = {
    "inverse_sqrt": lambda args: ["--lr-scheduler", "inverse_sqrt"],
    "linear_decay": lambda args: ["--lr-scheduler", "polynomial_decay", "--power", "1", "--end-learning-rate", "0",
                                  "--total-num-update", str(args.max_update)],
}


def train_flags(kind, prec, args, bin_dir, save_dir):
    ls = kind.startswith("ls")  # ls, ls-fp8 (--fp8) and its variants (below)
    flags = [bin_dir, "--arch", ("ls_" if ls else "") + args.arch, "--share-all-embeddings",
             "--lr", str(args.lr), "--warmup-updates", str(args.warmup), *SCHEDULES[args.schedule](args),
             "--adam-betas", "(0.9, 0.98)", "--label-smoothing", "0.1", "--seed", "1",
             "--max-tokens", str(args.max_tokens), "--max-update", str(args.max_update), "--clip-norm", str(args.clip_norm),
             "--validate-interval-updates", str(args.validate_every), "--save-interval", "1000000",
             "--no-epoch-checkpoints",  # one checkpoint, at the end (the BLEU run reads it)
             "--save-dir", save_dir, "--log-format", "simple", "--log-interval", "100", "--num-workers", "2"]
    flags += ["--optimizer", "ls_adam", "--criterion", "ls_label_smoothed_cross_entropy"] if ls else \
        ["--optimizer", "adam", "--criterion", "label_smoothed_cross_entropy"]
    flags += {"fp16": ["--fp16"], "bf16": ["--bf16"], "fp32": []}[prec]
    if kind.startswith("ls-fp8"):  # ls-fp8[-e4m3|-e5m2][-all]: the gradient format; all: --fp8-projections all
        flags += ["--fp8"]
        for opt in kind.split("-")[2:]:
            if opt not in ("all", "e4m3", "e5m2"):
                raise SystemExit(f"run {kind}_{prec}: unknown ls-fp8 option {opt!r} (e4m3, e5m2 or all)")
            flags += ["--fp8-projections", "all"] if opt == "all" else ["--fp8-grad-format", opt]
    if args.cpu_smoke:
        flags += ["--cpu", "--encoder-embed-dim", "64", "--decoder-embed-dim", "64", "--encoder-ffn-embed-dim", "128",
                  "--decoder-ffn-embed-dim", "128", "--encoder-layers", "2", "--decoder-layers", "2",
                  "--encoder-attention-heads", "2", "--decoder-attention-heads", "2"]
    return flags


def valid_curve(text):
    return {int(u): float(loss) for loss, u in
            re.findall(r"\| valid on 'valid' subset \| loss ([\d.]+) \|.*?\| num_updates (\d+)", text)}


def bleu(out, run, bin_dir, save_dir, cpu):
    gen = os.path.join(out, f"{run}.gen.log")
    cmd = [sys.executable, "-m", "ls_fairseq.cli.generate", bin_dir, "--path",
           os.path.join(save_dir, "checkpoint_last.pt"), "--gen-subset", "test", "--beam", "4",
           "--batch-size", "256", "--scoring", "sacrebleu"] + (["--cpu"] if cpu else [])
    text = sh(cmd, gen)
    m = re.search(r"BLEU = ([\d.]+)", text.splitlines()[-1]) or re.search(r"BLEU = ([\d.]+)", text)
    return float(m.group(1)) if m else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--pairs", type=int, default=300_000)
    ap.add_argument("--arch", default="transformer_wmt_en_de")
    ap.add_argument("--max-update", type=int, default=2000)
    ap.add_argument("--validate-every", type=int, default=250)
    ap.add_argument("--max-tokens", type=int, default=8192)
    # with a higher learning rate and no clipping native and ls alike diverge once the toy corpus is learned
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--clip-norm", type=float, default=1.0)
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="inverse_sqrt",
                    help="learning-rate schedule (linear_decay: to 0 at --max-update; see SCHEDULES)")
    ap.add_argument("--runs", default="native_fp16,ls_fp16,ls_bf16")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny model, fp32, CPU: checks the pipeline only")
    args = ap.parse_args()
    if args.cpu_smoke:
        args.pairs, args.max_update, args.validate_every, args.max_tokens = 2000, 40, 20, 2048
        args.runs, args.warmup, args.workers = "native_fp32,ls_fp32", 10, 1
    os.makedirs(args.out, exist_ok=True)
    bin_dir = prepare(args.out, args.pairs, args.workers)
    curves, scores = {}, {}
    for run in args.runs.split(","):
        kind, prec = run.split("_")
        save_dir = os.path.join(args.out, "ckpt_" + run)
        text = sh([sys.executable, os.path.join(HERE, "train_entry.py"), "ls" if kind.startswith("ls") else "native"]
                  + train_flags(kind, prec, args, bin_dir, save_dir), os.path.join(args.out, f"{run}.train.log"))
        curves[run] = valid_curve(text)
        scores[run] = bleu(args.out, run, bin_dir, save_dir, args.cpu_smoke)
        print(f"{run}: valid loss {curves[run]}  test sacreBLEU {scores[run]}", flush=True)
    runs = list(curves)
    updates = sorted(set().union(*[set(c) for c in curves.values()]))
    print("\n| update | " + " | ".join(f"{r} valid loss" for r in runs) + " |")
    print("|---" * (len(runs) + 1) + "|")
    for u in updates:
        print(f"| {u} | " + " | ".join(f"{curves[r].get(u, float('nan')):.3f}" for r in runs) + " |")
    print("| test sacreBLEU (beam 4) | " + " | ".join(f"{scores[r]:.2f}" for r in runs) + " |")
    base = runs[0]
    last = updates[-1] if updates else None
    for r in runs[1:]:
        if last is not None and last in curves[base] and last in curves[r]:
            rel = (curves[r][last] - curves[base][last]) / curves[base][last]
            print(f"{r} vs {base}: final valid loss {100 * rel:+.2f}%, BLEU {scores[r] - scores[base]:+.2f}")


if __name__ == "__main__":
    main()
