"""Print, for each fairseq training log, its train_inner losses and mean words/s after a given update.

    python benchmarks/summarize_train_logs.py "DIR/s*.log" 60
"""

import glob
import re
import sys


def train_inner_rows(path):
    """The key=value fields of every train_inner line of a --log-format simple log."""
    return [dict(re.findall(r"(\w+)=([\d.]+)", line)) for line in open(path) if "train_inner" in line]


def wps_after(rows, after):
    """The words/s of the train_inner intervals that end after update ``after``."""
    return [float(r["wps"]) for r in rows if "wps" in r and int(r["num_updates"]) > after]


def main():
    pattern, after = sys.argv[1], int(sys.argv[2])
    for f in sorted(glob.glob(pattern)):
        rows = train_inner_rows(f)
        late = wps_after(rows, after)
        print(f.split("/")[-1], "loss@" + " ".join(f"{r['num_updates']}:{r['loss']}" for r in rows),
              f"| wps mean after update {after}: {sum(late) / max(1, len(late)):.0f}")


if __name__ == "__main__":
    main()
