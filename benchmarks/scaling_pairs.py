"""Scaling ratios of paired training logs: words/s of each 2-GPU log over its 1-GPU partner.

    python benchmarks/scaling_pairs.py AFTER ONE_GPU.log TWO_GPU.log [ONE_GPU.log TWO_GPU.log ...]

For each pair: the mean and the median of the train_inner words/s after update AFTER in both logs
and their ratios; then the median of the pairs' ratios. The median of the 20-update intervals is
less moved than the mean by the slow stretches of a busy host; both are printed.
"""

import statistics
import sys

from summarize_train_logs import train_inner_rows, wps_after


def intervals(path, after):
    return wps_after(train_inner_rows(path), after)


def main():
    after, logs = int(sys.argv[1]), sys.argv[2:]
    if not logs or len(logs) % 2:
        sys.exit("usage: scaling_pairs.py AFTER ONE_GPU.log TWO_GPU.log [...] (logs in pairs)")
    ratios = []
    for one, two in zip(logs[::2], logs[1::2]):
        a, b = intervals(one, after), intervals(two, after)
        if not a or not b:
            sys.exit(f"no train_inner words/s after update {after} in {one if not a else two}")
        mean = statistics.mean(b) / statistics.mean(a)
        med = statistics.median(b) / statistics.median(a)
        ratios.append((mean, med))
        print(f"{one.split('/')[-1]} {statistics.mean(a):.0f} (median {statistics.median(a):.0f}) | "
              f"{two.split('/')[-1]} {statistics.mean(b):.0f} (median {statistics.median(b):.0f}) | "
              f"ratio {mean:.3f} (medians {med:.3f})")
    if len(ratios) > 1:
        print(f"median over {len(ratios)} pairs: ratio {statistics.median(r[0] for r in ratios):.3f} "
              f"(medians {statistics.median(r[1] for r in ratios):.3f})")


if __name__ == "__main__":
    main()
