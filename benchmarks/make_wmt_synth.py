"""A WMT14-shaped synthetic corpus, binarized straight into fairseq's data-bin format.

Source lengths ~ lognormal(mu=3.2, sigma=0.55) clipped to 1..250, target length = source
length x N(1.05, 0.15) (clipped), tokens Zipf(1.07) over a joined vocabulary of 32k.
Only the shapes matter for speed, so the tokens are random; writing the binary files
directly skips fairseq-preprocess (minutes of text processing) for ~120k pairs.

    python benchmarks/make_wmt_synth.py OUT_DIR [--pairs 120000] [--vocab 32000] [--seed 1]
"""

import argparse
import os

import numpy as np
import torch


def zipf_sampler(vocab: int, a: float, rng):
    ranks = np.arange(1, vocab + 1, dtype=np.float64)
    p = ranks ** -a
    cdf = np.cumsum(p / p.sum())

    def draw(n):
        return np.minimum(np.searchsorted(cdf, rng.random(n)), vocab - 1)

    return draw


def source_lengths(n, rng, max_len=250):
    """``n`` source lengths (without end-of-sentence) from the corpus's law."""
    return np.clip(np.round(rng.lognormal(3.2, 0.55, n)), 1, max_len).astype(np.int64)


def lengths(n, rng, max_len=250):
    src = source_lengths(n, rng, max_len)
    tgt = np.clip(np.round(src * rng.normal(1.05, 0.15, n)), 1, max_len).astype(np.int64)
    return src, tgt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--pairs", type=int, default=120_000)
    ap.add_argument("--valid-pairs", type=int, default=3000)
    ap.add_argument("--vocab", type=int, default=32_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    from fairseq.data import Dictionary, indexed_dataset

    os.makedirs(args.out, exist_ok=True)
    d = Dictionary()
    for i in range(args.vocab - d.nspecial):
        d.add_symbol(f"t{i}", n=args.vocab - i)  # counts in Zipf order
    d.finalize(padding_factor=8)
    for lang in ("src", "tgt"):
        d.save(os.path.join(args.out, f"dict.{lang}.txt"))

    rng = np.random.default_rng(args.seed)
    draw = zipf_sampler(len(d) - d.nspecial, 1.07, rng)
    for split, n in (("train", args.pairs), ("valid", args.valid_pairs)):
        src_len, tgt_len = lengths(n, rng)
        for lang, lens in (("src", src_len), ("tgt", tgt_len)):
            prefix = os.path.join(args.out, f"{split}.src-tgt.{lang}")
            builder = indexed_dataset.make_builder(prefix + ".bin", impl="mmap", vocab_size=len(d))
            toks = draw(int(lens.sum())) + d.nspecial
            off = 0
            for L in lens:
                sent = np.empty(L + 1, dtype=np.int64)
                sent[:L] = toks[off:off + L]
                sent[L] = d.eos()
                off += L
                builder.add_item(torch.from_numpy(sent))
            builder.finalize(prefix + ".idx")
        print(f"{split}: {n} pairs, {int(src_len.sum())} source / {int(tgt_len.sum())} target tokens")


if __name__ == "__main__":
    main()
