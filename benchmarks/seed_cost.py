"""Host time of the per-update seed: fairseq's ``utils.set_torch_seed`` (what ``Trainer._set_seed``
calls) against ``ls_fairseq.fairseq_ext.trainer.seed_generators`` (what LSTrainer calls), from a
Python stack as deep as fairseq's training loop makes it, and whether both leave the same CPU
(and, with CUDA, GPU) generator states.

    python benchmarks/seed_cost.py [--depth 40] [--calls 300]
"""

import argparse
import timeit

import torch
from fairseq import utils

from ls_fairseq.fairseq_ext.trainer import seed_generators


def _at_depth(depth, fn):
    return fn() if depth == 0 else _at_depth(depth - 1, fn)


def _states():
    states = [torch.get_rng_state()]
    if torch.cuda.is_available():
        states += [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return states


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=40)
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # initialised, as during training
    for name, fn in (("fairseq utils.set_torch_seed", utils.set_torch_seed), ("seed_generators", seed_generators)):
        t = timeit.timeit(lambda: _at_depth(args.depth, lambda: fn(11)), number=args.calls) / args.calls
        print(f"{name:30s} {t * 1e6:8.1f} us per call (stack depth {args.depth})")
    utils.set_torch_seed(23)
    want = _states()
    seed_generators(23)
    same = all(torch.equal(a, b) for a, b in zip(want, _states()))
    print(f"same generator states ({len(want)} generators): {same}")


if __name__ == "__main__":
    main()
