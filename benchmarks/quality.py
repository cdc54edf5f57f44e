"""Training quality, native fairseq vs ls_fairseq, from the same seed on a learnable corpus.

Generates the demo's rule-based toy language at scale (scripts/make_toy_corpus.py), binarizes it, trains each
run with identical flags and seed, validating every --validate-every updates, translates the test set with beam 4
and prints the validation-loss curves side by side, each run's sacreBLEU and the relative differences to native.

    python benchmarks/quality.py --out OUT [--pairs 300000] [--arch transformer_wmt_en_de]
        [--max-update 2000] [--validate-every 250] [--lr 3e-4] [--clip-norm 1.0] [--schedule linear_decay]
        [--runs native_fp16,ls_fp16,ls_bf16,ls-fp8_bf16,ls-fp8-e4m3_bf16,ls-fp8-all_bf16]
    python benchmarks/quality.py --out /tmp/q --cpu-smoke      # tiny, fp32, on the CPU
    python benchmarks/quality.py decode --out OUT [...]       # decoding speed, native vs ls (decode --help)

Runs: KIND_PRECISION, KIND one of native, ls, ls-fp8 (--fp8) and ls-fp8 with options: -e4m3 / -e5m2 (the gradient
format), -all (--fp8-projections all: every projection in FP8, the vocabulary projection too, which the toy
vocabulary is too small for under auto).
"""

import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def sh(cmd, log_path, env=None):
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    text = open(log_path).read()
    if rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{text[-3000:]}")
    return text


def prepare(out, pairs, workers, heldout=2000):
    raw, bin_dir = os.path.join(out, "raw"), os.path.join(out, "bin")
    if os.path.exists(os.path.join(bin_dir, "dict.src.txt")):
        return bin_dir
    sh([sys.executable, os.path.join(ROOT, "scripts", "make_toy_corpus.py"), "--out", raw, "--train", str(pairs),
        "--valid", str(heldout), "--test", str(heldout)], os.path.join(out, "corpus.log"))
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

# ---------------------------------------------------------------------------------------------------------------
# decode: generation speed and agreement of native fairseq-generate, lightseq-generate and
# fairseq-generate --user-dir on the same weights (converted with lightseq-convert).

GEN_RUNS = ("native", "ls", "user_dir")  # the first is the baseline of every comparison
TRANSLATED = re.compile(r"Translated ([\d,]+) sentences \(([\d,]+) tokens\) in ([\d.]+)s "
                        r"\(([\d.]+) sentences/s, ([\d.]+) tokens/s\)")
# fairseq-generate casts the model only under --fp16 (model.half()); --bf16 just implies --tpu. The ls model casts
# itself to bf16 for generation (LSTransformerModel.prepare_for_inference_); native's stays fp32.
# plain fairseq 0.12 reads checkpoints with torch.load's default, weights_only=True since torch 2.6
GEN_ENV = dict(os.environ, TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1")
BF16_NOTE = ("note: under --bf16 native fairseq-generate decodes its model in fp32 (it casts only under --fp16); "
             "the ls model decodes in bf16 in lightseq-generate and fairseq-generate --user-dir")


def checkpoint_arch(path):
    """The architecture stored in a fairseq checkpoint (one line naming the file when it cannot be read)."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any failure is the same bad input for this tool
        raise SystemExit(f"--checkpoint {path}: cannot be read as a checkpoint ({type(e).__name__})") from None
    cfg = state.get("cfg") or {}
    model = cfg.get("model") if hasattr(cfg, "get") else None
    arch = getattr(model, "_name", None) or getattr(model, "arch", None) \
        or (model.get("_name") or model.get("arch") if isinstance(model, dict) else None)
    if arch is None and state.get("args") is not None:
        arch = getattr(state["args"], "arch", None)
    if not arch or "transformer" not in arch:
        raise SystemExit(f"--checkpoint {path}: architecture {arch!r} is not a (ls_)transformer")
    return arch


def same_weights(ckpt, out, have=None):
    """{"native": path, "ls": path}: the checkpoint (of architecture kind ``have``, read from it when None) and
    its lightseq-convert twin under the other architecture."""
    have = have or ("ls" if checkpoint_arch(ckpt).startswith("ls_") else "native")
    other = "native" if have == "ls" else "ls"
    paths = {have: ckpt, other: os.path.join(out, f"weights_{other}.pt")}
    sh([sys.executable, "-m", "ls_fairseq.cli.convert", ckpt, paths[other], "--to", other],
       os.path.join(out, f"convert_{other}.log"))
    return paths


def gen_command(run, data, paths, subset, beam, batching, prec, args):
    """The command line of one run; every run gets the same generation flags."""
    flags = [data, "--path", paths["native" if run == "native" else "ls"], "--gen-subset", subset,
             "--beam", str(beam), "--lenpen", "0.6", batching[0], str(batching[1]),
             "--required-batch-size-multiple", "1"]
    flags += {"fp16": ["--fp16"], "bf16": ["--bf16"], "fp32": []}[prec]
    flags += (["--cpu", "--num-workers", "0"] if args.cpu else []) + args.gen_args.split()
    if run == "ls":
        return [sys.executable, "-m", "ls_fairseq.cli.generate"] + flags
    extra = ["--user-dir", os.path.join(ROOT, "user_dir")] if run == "user_dir" else []
    return [sys.executable, "-m", "fairseq_cli.generate"] + flags + extra


def parse_generation(text, log):
    """Best hypothesis and reference per sentence id (H- / T- lines) and the timing of fairseq's summary line."""
    m = TRANSLATED.search(text)
    if m is None:
        raise SystemExit(f"{log}: no 'Translated N sentences' line")
    hyps, refs = {}, {}
    for line in text.splitlines():
        if line.startswith("H-"):
            sid, _, hyp = (line[2:].split("\t") + ["", ""])[:3]
            hyps.setdefault(int(sid), hyp)
        elif line.startswith("T-"):
            sid, ref = (line[2:].split("\t", 1) + [""])[:2]
            refs[int(sid)] = ref
    sents, toks, sent_s, tok_s = int(m[1].replace(",", "")), int(m[2].replace(",", "")), float(m[4]), float(m[5])
    # the seconds printed have one decimal; N / (sentences/s) gives the same time to more digits
    return dict(hyps=hyps, refs=refs, sentences=sents, tokens=toks, sentences_per_s=sent_s, tokens_per_s=tok_s,
                seconds=sents / sent_s if sent_s > 0 else float(m[3]))


def corpus_bleu(hyps, refs):
    import sacrebleu

    return sacrebleu.corpus_bleu(hyps, [refs]).score


def compare(res, base):
    """Agreement of one run with the native run, and BLEU against native's hypotheses and the references."""
    ids = sorted(base["hyps"])
    hyps = [res["hyps"].get(i, "") for i in ids]
    same = sum(h == base["hyps"][i] and i in res["hyps"] for h, i in zip(hyps, ids))
    refs = [base["refs"].get(i, "") for i in ids]
    return dict(hypotheses=len(res["hyps"]), identical_share=same / max(len(ids), 1),
                bleu_vs_native=corpus_bleu(hyps, [base["hyps"][i] for i in ids]),
                bleu_vs_reference=corpus_bleu(hyps, refs) if base["refs"] else None,
                speed_vs_native=base["seconds"] / res["seconds"] if res["seconds"] > 0 else float("nan"))


def decode_rows(args, data, paths):
    rows, logs = [], os.path.join(args.out, "decode_logs")
    os.makedirs(logs, exist_ok=True)
    batchings = [("--batch-size", b) for b in args.batch_size] + [("--max-tokens", t) for t in args.max_tokens]
    for prec in args.precision:
        for beam in args.beam:
            for batching in batchings:
                tag = f"{prec}_beam{beam}_{batching[0][2:]}{batching[1]}"
                results = {}
                for rep in range(args.repeats):  # the fastest of the repeats; the hypotheses of the first
                    for run in GEN_RUNS:
                        cmd = gen_command(run, data, paths, args.subset, beam, batching, prec, args)
                        log = os.path.join(logs, f"{tag}_{run}_{rep}.log")
                        res = parse_generation(sh(cmd, log, env=GEN_ENV), log)
                        res["command"] = " ".join(cmd)
                        if run not in results or res["seconds"] < results[run]["seconds"]:
                            res["hyps"], res["refs"] = results.get(run, res)["hyps"], results.get(run, res)["refs"]
                            results[run] = res
                for run in GEN_RUNS:
                    res = results[run]
                    row = dict(precision=prec, beam=beam, batching=f"{batching[0]} {batching[1]}", run=run,
                               **{k: res[k] for k in ("sentences", "tokens", "seconds", "sentences_per_s",
                                                      "tokens_per_s", "command")},
                               **compare(res, results[GEN_RUNS[0]]))
                    rows.append(row)
                    print(f"{tag} {run}: {row['seconds']:.2f}s {row['sentences_per_s']:.1f} sent/s, identical "
                          f"{100 * row['identical_share']:.1f}%", flush=True)
    return rows


def markdown(rows):
    head = ("| precision | beam | batching | run | sentences | tokens | seconds | sentences/s | tokens/s | "
            "speed vs native | identical to native | BLEU vs native | BLEU vs reference |")
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for r in rows:
        ref = "-" if r["bleu_vs_reference"] is None else f"{r['bleu_vs_reference']:.2f}"
        lines.append(f"| {r['precision']} | {r['beam']} | {r['batching']} | {r['run']} | {r['sentences']} | "
                     f"{r['tokens']} | {r['seconds']:.2f} | {r['sentences_per_s']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speed_vs_native']:.2f}x | {100 * r['identical_share']:.1f}% | "
                     f"{r['bleu_vs_native']:.2f} | {ref} |")
    return "\n".join(lines)


def int_list(text):
    try:
        return [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas, got {text!r}") from None


def decode_main(argv):
    ap = argparse.ArgumentParser(prog="quality.py decode", description=(
        "Decoding speed on the same weights: native fairseq-generate (native checkpoint), lightseq-generate and "
        "fairseq-generate --user-dir user_dir (its lightseq-convert twin). Without --data/--checkpoint it trains "
        "a native model on the toy corpus first (as the quality runs do; kept in --out for the next call)."))
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", help="fairseq data-bin (with --checkpoint)")
    ap.add_argument("--checkpoint", help="a transformer_X or ls_transformer_X checkpoint trained on --data")
    ap.add_argument("--subset", default="test", choices=["valid", "test"])
    ap.add_argument("--beam", type=int_list, default=[4], help="beam sizes (comma list, e.g. 4,5)")
    ap.add_argument("--batch-size", type=int_list, default=[],
                    help="sentences per batch (comma list; default 128 unless --max-tokens)")
    ap.add_argument("--max-tokens", type=int_list, default=[],
                    help="tokens per batch (comma list; each value of either flag is a batching of its own)")
    ap.add_argument("--precision", default="fp16", help="comma list of fp16, bf16, fp32")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each command; the fastest is reported")
    ap.add_argument("--gen-args", default="", help="more fairseq-generate flags for every run, e.g. '--remove-bpe'")
    ap.add_argument("--json", help="result file (default OUT/decode.json)")
    ap.add_argument("--cpu", action="store_true", help="decode on the CPU")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="tiny model trained for seconds, fp32 on the CPU, 48 test sentences, beam 4 and 1")
    # the model trained when no --checkpoint is given (quality.py's flags)
    ap.add_argument("--arch", default="transformer_wmt_en_de_big_t2t")
    ap.add_argument("--pairs", type=int, default=100_000)
    ap.add_argument("--max-update", type=int, default=800)
    ap.add_argument("--train-max-tokens", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=300)
    args = ap.parse_args(argv)
    if (args.data is None) != (args.checkpoint is None):
        ap.error("give --data and --checkpoint together, or neither (a model is then trained)")
    if args.cpu_smoke:
        args.cpu, args.precision, args.beam, args.batch_size, args.max_tokens = True, "fp32", [4, 1], [16], []
        args.pairs, args.max_update, args.train_max_tokens, args.lr, args.warmup = 2000, 150, 1024, 5e-3, 10
        # a model this short-trained repeats words: the length limit keeps its hypotheses (and the run) short
        args.gen_args += " --max-len-a 1 --max-len-b 5"
    args.precision = args.precision.split(",")
    for prec in args.precision:
        if prec not in ("fp16", "bf16", "fp32"):
            ap.error(f"--precision: unknown precision {prec!r} (fp16, bf16 or fp32)")
        if args.cpu and prec != "fp32":
            ap.error(f"--precision {prec}: fairseq-generate decodes in fp32 on the CPU; use fp32 with --cpu")
    if not args.batch_size and not args.max_tokens:
        args.batch_size = [128]
    if not args.beam or min(args.beam) < 1 or min(args.batch_size + args.max_tokens) < 1 or args.repeats < 1:
        ap.error("--beam, --batch-size, --max-tokens and --repeats take numbers >= 1")
    os.makedirs(args.out, exist_ok=True)
    have = None
    if args.checkpoint is None:
        have = "native"
        args.data = prepare(args.out, args.pairs, 1 if args.cpu else 8, heldout=48 if args.cpu_smoke else 2000)
        save_dir = os.path.join(args.out, "ckpt_decode")
        args.checkpoint = os.path.join(save_dir, "checkpoint_last.pt")
        if not os.path.exists(args.checkpoint):
            targs = argparse.Namespace(arch=args.arch, lr=args.lr, warmup=args.warmup, schedule="inverse_sqrt",
                                       max_update=args.max_update, max_tokens=args.train_max_tokens, clip_norm=1.0,
                                       validate_every=args.max_update, cpu_smoke=args.cpu_smoke)
            flags = train_flags("native", "fp32" if args.cpu else "fp16", targs, args.data, save_dir)
            flags += ["--disable-validation"] + (["--num-workers", "0"] if args.cpu else [])
            sh([sys.executable, os.path.join(HERE, "train_entry.py"), "native"] + flags,
               os.path.join(args.out, "decode_train.log"))
    for path, flag in ((args.data, "--data"), (args.checkpoint, "--checkpoint")):
        if not os.path.exists(path):
            raise SystemExit(f"{flag} {path}: does not exist")
    paths = same_weights(args.checkpoint, args.out, have)
    rows = decode_rows(args, args.data, paths)
    notes = [BF16_NOTE] if "bf16" in args.precision else []
    print("\n" + markdown(rows) + "".join("\n\n" + n for n in notes))
    path = args.json or os.path.join(args.out, "decode.json")
    with open(path, "w") as f:
        json.dump(dict(data=args.data, checkpoint=args.checkpoint, weights=paths, subset=args.subset,
                       notes=notes, rows=rows), f, indent=1)
    print(f"\nwrote {path}")
    return rows


def main():
    if sys.argv[1:2] == ["decode"]:
        return decode_main(sys.argv[2:])
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
