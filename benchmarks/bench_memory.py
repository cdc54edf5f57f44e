"""Activation memory per token and the largest --max-tokens that trains on this GPU: native fairseq against
ls_fairseq with and without its memory modes, in one process tree.

    python benchmarks/bench_memory.py --out OUT [--data DIR] [--pairs 30000] [--arch transformer_wmt_en_de_big_t2t]
        [--kinds native,ls,ls_mem] [--max-tokens 8192,16384] [--find-max] [--baseline DIR]

Every (kind, --max-tokens) trains one epoch of the WMT-shaped synthetic corpus in fp16 and reads the run's peak
GPU memory (benchmarks/train_entry.py: torch's peak over the whole run, every batch shape of the epoch). From
the first two sizes: memory per token = the slope between them, fixed memory (weights, optimizer state) = the
intercept. --find-max predicts the largest --max-tokens whose peak fits in 97% of the GPU's memory and trains
one epoch at it, stepping down by 5% until a run succeeds (at most four tries): the result is a size that
trained, not an extrapolation.
Kinds: native, ls (lightseq-train's defaults), ls_mem (--ls-invertible-layernorm --ls-recompute-activation
--ls-recompute-logits), ls_inv, ls_recompute, ls_logits; --baseline DIR adds ls_baseline, lightseq-train from
another checkout of ls_fairseq with its extension built in place, for a before/after comparison in the same run.
"""

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from bench_train import run  # noqa: E402


def _one(kind, arch, mt, data, out, baseline):
    entry = os.path.join(baseline, "benchmarks", "train_entry.py") if kind == "ls_baseline" else None
    r = run("ls" if kind == "ls_baseline" else kind, arch, mt, "fp16", data, 1, out, entry=entry)
    r["kind"], r["max_tokens"] = kind, mt
    ep = r["epochs"]
    r["wps_epoch1"] = ep[0][2] / ep[0][1] if ep and ep[0][1] > 0 else None
    print(json.dumps({k: v for k, v in r.items() if k not in ("cmd", "error_tail")}), flush=True)
    if r["rc"] != 0:
        tail = r.get("error_tail", "")
        r["oom"] = "out of memory" in tail.lower()
        print(f"  {kind} at {mt}: FAILED rc={r['rc']} ({'out of memory' if r['oom'] else tail[-400:]})", flush=True)
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=None, help="existing data-bin (default: generate into OUT/data)")
    ap.add_argument("--pairs", type=int, default=30_000)
    ap.add_argument("--arch", default="transformer_wmt_en_de_big_t2t")
    ap.add_argument("--kinds", default="native,ls,ls_mem")
    ap.add_argument("--max-tokens", default="8192,16384")
    ap.add_argument("--find-max", action="store_true")
    ap.add_argument("--baseline", default=None, help="another ls_fairseq checkout: adds the kind ls_baseline")
    args = ap.parse_args()
    import torch

    os.makedirs(args.out, exist_ok=True)
    data = args.data or os.path.join(args.out, "data")
    if not os.path.exists(os.path.join(data, "dict.src.txt")):
        subprocess.check_call([sys.executable, os.path.join(HERE, "make_wmt_synth.py"), data, "--pairs",
                               str(args.pairs)])
    kinds = args.kinds.split(",") + (["ls_baseline"] if args.baseline else [])
    sizes = [int(x) for x in args.max_tokens.split(",")]
    total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    print(f"GPU: {torch.cuda.get_device_name(0)}, {total_gb:.1f} GiB", flush=True)
    report = {}
    for kind in kinds:
        runs = [_one(kind, args.arch, mt, data, args.out, args.baseline) for mt in sizes]
        rep = {"runs": runs}
        ok = [r for r in runs if r["rc"] == 0 and r["peak_mem_gb"] is not None]
        if len(ok) >= 2:
            (t0, p0), (t1, p1) = [(r["max_tokens"], r["peak_mem_gb"]) for r in ok[:2]]
            slope = (p1 - p0) / (t1 - t0)
            fixed = p0 - slope * t0
            rep.update(kb_per_token=slope * 2**20, fixed_gb=fixed)
            predicted = int((0.97 * total_gb - fixed) / slope) // 1024 * 1024
            rep["predicted_max_tokens"] = predicted
            if args.find_max:
                mt = predicted
                for _ in range(4):
                    r = _one(kind, args.arch, mt, data, args.out, args.baseline)
                    rep["runs"].append(r)
                    if r["rc"] == 0:
                        rep["trained_max_tokens"] = mt
                        break
                    mt = int(mt * 0.95) // 1024 * 1024
        report[kind] = rep
    with open(os.path.join(args.out, "bench_memory.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print("\n| run | " + " | ".join(f"peak GB at {s}" for s in sizes) +
          " | KB per token | fixed GB | predicted max --max-tokens | trained at | words/s there (1 epoch) |")
    print("|---|" + "---|" * (len(sizes) + 5))
    for kind, rep in report.items():
        peaks = {r["max_tokens"]: r["peak_mem_gb"] for r in rep["runs"][:len(sizes)] if r["rc"] == 0}
        top = [r for r in rep["runs"] if r["max_tokens"] == rep.get("trained_max_tokens") and r["rc"] == 0]
        wps = f"{top[0]['wps_epoch1']:.0f}" if top and top[0]["wps_epoch1"] else ""
        cells = [str(peaks.get(s, "failed")) for s in sizes]
        kb = rep.get("kb_per_token")
        print(f"| {kind} | " + " | ".join(cells) + f" | {kb and round(kb, 1)} | {rep.get('fixed_gb') and round(rep['fixed_gb'], 2)} | "
              f"{rep.get('predicted_max_tokens', '')} | {rep.get('trained_max_tokens', '')} | {wps} |")
    base = report.get("ls_baseline") or report.get("ls")
    for kind, rep in report.items():
        if base and rep is not base and rep.get("kb_per_token") and base.get("kb_per_token"):
            print(f"RATIO {kind} / {'ls_baseline' if 'ls_baseline' in report else 'ls'}: memory per token "
                  f"{rep['kb_per_token'] / base['kb_per_token']:.3f}x", end="")
            if rep.get("trained_max_tokens") and base.get("trained_max_tokens"):
                print(f", largest --max-tokens {rep['trained_max_tokens'] / base['trained_max_tokens']:.2f}x", end="")
            print(flush=True)
    nat = report.get("native")
    for kind, rep in report.items():
        if nat and kind != "native" and rep.get("trained_max_tokens") and nat.get("trained_max_tokens"):
            print(f"RATIO {kind} / native: largest --max-tokens {rep['trained_max_tokens'] / nat['trained_max_tokens']:.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
