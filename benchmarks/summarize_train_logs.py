"""Print, for each fairseq training log, its train_inner losses and mean words/s after a given update.

    python benchmarks/summarize_train_logs.py "DIR/s*.log" 60
"""

import glob
import re
import sys


def main():
    pattern, after = sys.argv[1], int(sys.argv[2])
    for f in sorted(glob.glob(pattern)):
        rows = [dict(re.findall(r"(\w+)=([\d.]+)", line)) for line in open(f) if "train_inner" in line]
        late = [float(r["wps"]) for r in rows if int(r["num_updates"]) > after]
        print(f.split("/")[-1], "loss@" + " ".join(f"{r['num_updates']}:{r['loss']}" for r in rows),
              f"| wps mean after update {after}: {sum(late) / max(1, len(late)):.0f}")


if __name__ == "__main__":
    main()
