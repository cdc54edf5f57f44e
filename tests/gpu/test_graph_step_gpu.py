"""The CUDA-graph step on a GPU: lightseq-train with --ls-graph-step on against the eager step
(--ls-graph-step off) on a small WMT-shaped corpus, update by update."""

import os
import re
import subprocess
import sys

import pytest

from tests._models import SMALL_LS_TRAIN, train_inner_records

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(corpus, tmp_path, name, *flags, updates=200, dropout=0.0, seed=1, shared=True):
    save = tmp_path / name
    arch = SMALL_LS_TRAIN if shared else [f for f in SMALL_LS_TRAIN if f != "--share-all-embeddings"]
    cmd = [sys.executable, "-m", "ls_fairseq.cli.train", corpus, *arch, "--dropout", str(dropout), "--attention-dropout", str(dropout),
           "--max-tokens", "2048", "--max-update", str(updates), "--seed", str(seed), "--no-save",
           "--disable-validation", "--log-format", "json", "--log-interval", "1", "--num-workers", "1",
           "--save-dir", str(save), "--ls-graph-buckets", "12", *flags]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    records = train_inner_records(out)
    return [float(records[k]["loss"]) for k in sorted(records)], out


def _graph_micro_batches(out):
    m = re.findall(r"CUDA-graph step: (\d+) micro-batches from (\d+) captured buckets", out)
    return max((int(a) for a, _ in m), default=0), max((int(b) for _, b in m), default=0)


PRECISION_FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}


@pytest.mark.parametrize("precision,shared", [("fp32", True), ("fp16", True), ("bf16", True), ("fp32", False),
                                              ("fp16", False)])
def test_graph_step_follows_the_eager_loss_curve(corpus, tmp_path, precision, shared):
    """dropout 0: the same updates up to rounding. Not bit for bit: padded or packed batches give cuBLAS
    other GEMM shapes (other tilings and summation orders), so the sums round differently. fp16 / bf16 take
    packed buckets (the real tokens only), fp32 padded ones.
    Unshared: the output projection's weight gets its gradient from the eager head alone, the embeddings from
    the graphs alone."""
    flags = PRECISION_FLAGS[precision]
    padded = precision == "fp32"
    eager, eager_out = _train(corpus, tmp_path, "eager", "--ls-graph-step", "off", *flags, shared=shared)
    graph, out = _train(corpus, tmp_path, "graph", "--ls-graph-step", "on", *flags, shared=shared)
    # the first update's kernels were warmed up while the optimizer was built (prewarm.py), with the graphs only
    assert "kernel warm-up before the first update: the first batch" in out, out[-3000:]
    assert "kernel warm-up" not in eager_out
    # the layers' products through cuBLASLt with the graphs (fp32 products through ATen), ATen's in the eager step
    assert "cuBLASLt" not in eager_out
    if not padded:
        assert re.search(r"cuBLASLt kernels loaded before the first update: \d+ classes", out), out[-3000:]
        used = re.findall(r"cuBLASLt products: \d+ classes, (\d+) shapes through cuBLASLt .*, (\d+) refused", out)
        assert used and int(used[-1][0]) > 0 and used[-1][1] == "0", out[-3000:]
    n_graph, n_buckets = _graph_micro_batches(out)
    assert n_graph > 150 and 1 <= n_buckets <= 12, out[-3000:]
    assert ("packed buckets" in out) == (not padded) and ("shape buckets" in out) == padded, out[-3000:]
    assert len(eager) == len(graph) >= 190
    assert graph[-1] < graph[0] - 1.0  # it learns
    tol = {"fp32": 2e-3, "fp16": 2e-2, "bf16": 5e-2}[precision]
    worst = max(abs(a - b) / abs(a) for a, b in zip(eager, graph))
    assert worst < tol, f"largest relative loss difference {worst:.2e}\n{list(zip(eager, graph))[:20]}"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_graph_step_dropout_is_random_and_reproducible(corpus, tmp_path, precision):
    """fp32: padded buckets; bf16: packed ones (attention dropout over packed sentences)."""
    flags = PRECISION_FLAGS[precision]
    a, out = _train(corpus, tmp_path, "a", *flags, updates=60, dropout=0.2, seed=1)
    assert _graph_micro_batches(out)[0] > 40
    b, _ = _train(corpus, tmp_path, "b", *flags, updates=60, dropout=0.2, seed=1)
    c, _ = _train(corpus, tmp_path, "c", *flags, updates=60, dropout=0.2, seed=2)
    assert a == b  # fairseq's per-update seeding reaches the replayed dropout kernels
    assert a[10:] != c[10:]


def test_graph_step_with_update_freq(corpus, tmp_path):
    eager, _ = _train(corpus, tmp_path, "e", "--ls-graph-step", "off", "--update-freq", "2", updates=80)
    graph, out = _train(corpus, tmp_path, "g", "--update-freq", "2", updates=80)
    assert _graph_micro_batches(out)[0] > 100
    worst = max(abs(a - b) / abs(a) for a, b in zip(eager, graph))
    assert len(eager) == len(graph) and worst < 2e-3


def test_graphs_are_captured_again_after_every_graph_was_dropped(corpus, tmp_path, monkeypatch):
    """A rebuilt optimizer (new flat buffers) drops every graph, and their memory pool goes with them: the
    captures after that must take a new pool and the graphs carry on (not the eager step, not a crash).
    Here the optimizer's buffer key changes every 40 micro-batches."""
    from ls_fairseq.fairseq_ext.graph import graph_step
    from tests._models import lightseq_train, log_lines

    real, calls = graph_step.GraphStep._buffers_key, [0]

    def changing_key(optimizer):
        calls[0] += 1
        return real(optimizer), calls[0] // 40

    monkeypatch.setattr(graph_step.GraphStep, "_buffers_key", staticmethod(changing_key))
    argv = [corpus, *SMALL_LS_TRAIN, "--dropout", "0.1", "--max-tokens", "2048", "--max-update", "130", "--bf16",
            "--no-save", "--disable-validation", "--log-format", "json", "--log-interval", "10", "--num-workers", "0",
            "--save-dir", str(tmp_path / "s"), "--ls-graph-buckets", "8", "--ls-graph-step", "on"]
    with log_lines() as lines:
        lightseq_train(argv)
    text = "\n".join(lines)
    assert text.count("the parameter buffers changed; the buckets are captured again") >= 2, text[-3000:]
    assert "CUDA-graph step off" not in text, text[-3000:]
    assert _graph_micro_batches(text)[0] >= 75, text[-3000:]  # the summary at the end of epoch 1
