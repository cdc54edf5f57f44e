"""Where the first epoch's extra time goes (GPU machine): lightseq-train with a CUDA event at the start and the end
of every update, then a breakdown of epoch 1 against epoch 2.

    python benchmarks/first_epoch.py run OUT.json DATA --arch ls_transformer_wmt_en_de_big_t2t [lightseq-train flags]
    python benchmarks/first_epoch.py analyze OUT.json

``run`` trains in this process (as benchmarks/train_entry.py does; give --max-epoch 2 or more) and writes, per
update, the host times around ``train_step``, the GPU times of its two events, the bucket its micro-batch ran in
and how long a capture in it took; then it prints the analysis. The GPU time an update adds (its end event's time
less the previous update's) is compared with the median for the same bucket in epoch 2; what epoch 1 adds beyond
that is split into: the eager updates before the first capture, the updates that captured (a capture is hidden
only as far as GPU work is queued when it begins: the queue at each capture is printed; the later captures are
split into those the pacing let through and those taken before their turn because no captured bucket could stand
in), the few updates after them, and the rest.
"""

import json
import os
import statistics
import sys
import time
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for ls_fairseq

EARLY = 15  # updates counted as "early": nothing is queued yet and few buckets are captured


def record(out_path, argv):
    """Train with lightseq-train's main on ``argv``, recording every update (module docstring) into ``out_path``."""
    import torch
    from fairseq_cli import train as fs_train

    from ls_fairseq.cli import train as ls_train
    from ls_fairseq.fairseq_ext.graph import graph_step
    from ls_fairseq.fairseq_ext.step.trainer import LSTrainer

    rec = {"steps": [], "epochs": []}
    events, current = [], {}

    step = LSTrainer.train_step

    def timed_step(self, samples, *a, **k):
        current.clear()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        h0 = time.perf_counter()
        out = step(self, samples, *a, **k)
        h1 = time.perf_counter()
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        events.append((start, end))
        rec["steps"].append({"h0": h0, "h1": h1, "bucket": current.get("bucket"),
                             "capture": current.get("capture", 0.0), "due": current.get("due")})
        return out

    capture = graph_step.GraphStep._capture

    def timed_capture(self, bucket, views):
        t0 = time.perf_counter()
        out = capture(self, bucket, views)
        current["capture"] = time.perf_counter() - t0
        return out

    paced = graph_step.GraphStep._paced

    def noted_paced(self, bucket, shape):
        # whether the pacing allowed a capture now; a capture that was not due had no captured bucket to stand in
        current["due"] = self.capture_due()
        out = paced(self, bucket, shape)
        current["bucket"] = str(out)
        return out

    train = fs_train.train

    def timed_train(cfg, trainer, task, epoch_itr):
        torch.cuda.synchronize()
        t0, n0 = time.perf_counter(), len(events)
        out = train(cfg, trainer, task, epoch_itr)
        torch.cuda.synchronize()
        rec["epochs"].append((t0, time.perf_counter(), n0, len(events)))
        return out

    LSTrainer.train_step = timed_step
    graph_step.GraphStep._capture = timed_capture
    graph_step.GraphStep._paced = noted_paced
    fs_train.train = timed_train
    sys.argv = [sys.argv[0]] + argv
    try:
        ls_train.cli_main()
    finally:
        torch.cuda.synchronize()
        if events:
            base = events[0][0]
            for s, (e0, e1) in zip(rec["steps"], events):
                s["g0"], s["g1"] = base.elapsed_time(e0) / 1e3, base.elapsed_time(e1) / 1e3
            with open(out_path, "w") as f:
                json.dump(rec, f)


def analyze(rec) -> dict:
    """The breakdown of epoch 1 against epoch 2 (seconds), from a ``record``'s dict; also printable lines."""
    S = rec["steps"]
    (a1, b1, n1, m1), (a2, b2, n2, m2) = rec["epochs"][:2]
    h_base = S[0]["h0"]  # the first update's start event runs as it is recorded: GPU time 0 = this host time

    def busy(i):  # GPU time update i adds, from the previous update's end (or its own start, if the GPU waited)
        prev = S[i - 1]["g1"] if i > 0 else S[i]["g0"]
        return S[i]["g1"] - max(prev, S[i]["g0"])

    by_bucket = defaultdict(list)
    for i in range(n2, m2):
        by_bucket[S[i]["bucket"]].append(busy(i))
    median = {k: statistics.median(v) for k, v in by_bucket.items()}
    overall = statistics.median([busy(i) for i in range(n2, m2)])
    captures = [i for i in range(n1, m1) if S[i]["capture"] > 0]
    after = {j for i in captures for j in range(i + 1, i + 5)}
    parts = defaultdict(float)
    for i in range(n1, m1):
        excess = busy(i) - median.get(S[i]["bucket"], overall)
        if S[i]["bucket"] is None:
            kind = "eager updates"
        elif S[i]["capture"] > 0:
            if i - n1 < EARLY:
                kind = "captures, early"
            elif S[i].get("due") is False:
                kind = "captures, later, before their turn"
            else:
                kind = "captures, later"
        else:
            kind = "after a capture" if i in after else "other updates"
        parts[kind] += excess
    queue = [(i - n1, (S[i - 1]["g1"] - (S[i]["h0"] - h_base)) * 1e3, S[i]["capture"] * 1e3)
             for i in captures if i > 0]
    out = {"epoch1": b1 - a1, "epoch2": b2 - a2, "updates": (m1 - n1, m2 - n2), "parts": dict(parts),
           "capture_host": sum(S[i]["capture"] for i in captures), "captures": len(captures), "queue": queue}
    # epoch 2 against its GPU time: where the GPU waited (host times and GPU times share an origin, as above)
    start2, end2 = a2 - h_base, b2 - h_base
    gaps = [S[i]["g0"] - S[i - 1]["g1"] for i in range(n2 + 1, m2)]
    out["epoch2_gpu"] = {"busy": sum(busy(i) for i in range(n2, m2)),
                         "idle_start": S[n2]["g0"] - start2, "idle_between": sum(g for g in gaps if g > 0),
                         "idle_end": end2 - S[m2 - 1]["g1"]}
    out["lines"] = [
        f"epoch 1 {out['epoch1']:.3f} s, epoch 2 {out['epoch2']:.3f} s ({m1 - n1} / {m2 - n2} updates): epoch 1 / "
        f"steady {out['epoch2'] / out['epoch1']:.3f}, {out['epoch1'] - out['epoch2']:.3f} s more",
        f"{len(captures)} captures in epoch 1, {out['capture_host']:.3f} s of host time",
        "GPU time epoch 1 adds over epoch 2's median of each update's bucket:",
        *[f"  {k}: {v:.3f} s" for k, v in sorted(parts.items())],
        "epoch 2: GPU busy {busy:.3f} s; GPU idle before its first update {idle_start:.3f} s, between updates "
        "{idle_between:.3f} s, after its last {idle_end:.3f} s".format(**out["epoch2_gpu"]),
        "queued GPU work when a capture began (update, queue ms, capture ms): "
        + ", ".join(f"({u}, {q:.0f}, {c:.0f})" for u, q, c in queue[:40]),
    ]
    return out


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode not in ("run", "analyze") or len(sys.argv) < 3:
        sys.exit(__doc__)
    path = sys.argv[2]
    if mode == "run":
        record(path, sys.argv[3:])
    with open(path) as f:
        rec = json.load(f)
    print("\n".join(analyze(rec)["lines"]))


if __name__ == "__main__":
    main()
