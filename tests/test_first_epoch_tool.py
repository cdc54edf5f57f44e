"""benchmarks/first_epoch.py's analysis (the recording needs a GPU) on a made-up record whose answer is known."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import first_epoch  # noqa: E402


def _record():
    """Epoch 1: an eager update (50 ms of GPU time), a capture (the GPU waits 30 ms for it), then replays, a hidden
    capture and one taken before its turn (the GPU waits 8 ms for it); epoch 2: the same buckets at their plain cost
    (buckets A and C 10 ms, bucket B 20 ms). Host time = GPU time from zero."""
    steps, t = [], 0.0

    def add(bucket, gpu_ms, capture_ms=0.0, wait_ms=0.0, due=True):
        nonlocal t
        g0 = t
        t += (wait_ms + gpu_ms) / 1e3
        steps.append({"h0": g0, "h1": t, "g0": g0, "g1": t, "bucket": bucket, "capture": capture_ms / 1e3,
                      "due": due})

    add(None, 50.0)                         # eager: 40 ms over the median of all epoch-2 updates (10 ms)
    add("A", 10.0, capture_ms=30.0, wait_ms=30.0)  # early capture: the GPU waited 30 ms
    add("A", 10.0)
    add("B", 25.0)                          # 5 ms over B's median, right after the capture
    for _ in range(20):
        add("A", 10.0)
    add("B", 20.0, capture_ms=5.0)          # a later capture, hidden: no excess
    for _ in range(4):
        add("A", 10.0)
    add("C", 10.0, capture_ms=12.0, wait_ms=8.0, due=False)  # before its turn (nothing could stand in): 8 ms
    e1 = (0.0, t, 0, len(steps))
    n2 = len(steps)
    t += 0.007                              # epoch 2 starts; the GPU waits 7 ms for its first update
    for k, b in enumerate(["A"] * 6 + ["B"] * 3 + ["C"]):
        add(b, {"A": 10.0, "B": 20.0, "C": 10.0}[b], wait_ms=2.0 if k == 4 else 0.0)  # and 2 ms before its fifth
        if k == 4:
            steps[-1]["g0"] += 0.002
    return {"steps": steps, "epochs": [e1, (e1[1], t + 0.003, n2, len(steps))]}  # ends 3 ms after the GPU


def test_first_epoch_analysis_splits_the_extra_time_by_cause():
    out = first_epoch.analyze(_record())
    parts = out["parts"]
    assert parts["eager updates"] == pytest.approx(0.040)
    assert parts["captures, early"] == pytest.approx(0.030)
    assert parts["after a capture"] == pytest.approx(0.005)
    assert parts["captures, later"] == pytest.approx(0.0, abs=1e-9)
    assert parts["captures, later, before their turn"] == pytest.approx(0.008)
    assert parts["other updates"] == pytest.approx(0.0, abs=1e-9)
    assert out["captures"] == 3 and out["capture_host"] == pytest.approx(0.047)
    assert out["epoch1"] == pytest.approx(0.403) and out["epoch2"] == pytest.approx(0.142)
    gpu2 = out["epoch2_gpu"]
    assert gpu2["busy"] == pytest.approx(0.130)
    assert gpu2["idle_start"] == pytest.approx(0.007) and gpu2["idle_between"] == pytest.approx(0.002)
    assert gpu2["idle_end"] == pytest.approx(0.003)
    assert out["queue"][0][0] == 1 and out["queue"][0][1] == pytest.approx(0.0, abs=1e-6)  # nothing queued at update 1
    assert any("epoch 1 / steady" in line for line in out["lines"])
