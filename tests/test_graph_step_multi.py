"""The CUDA-graph step on several ranks, checked on the CPU with two gloo ranks.

CUDA graphs do not run on the CPU; here the graph step runs its arithmetic instead of the replays
(``GraphStep(replay=False)``: each batch padded to its shape bucket, then :func:`split_step`), and
everything else is lightseq-train's: the bucket plan, the eligibility checks (as if on a GPU), the
deferred step's calls, the in-place zeroing of ls_adam's flat gradients and their reduction across
the ranks. Five updates (dropout 0, fp32, two shape buckets, so that batches are padded) are trained

(a) on two ranks, each taking one of the two batches of every update, with the graph step;
(b) in one process with --update-freq 2 over the same batches, with the graph step;
(c) in one process with --update-freq 2, eager (--ls-graph-step off),

and each batch's loss and the final weights must agree. Not bit for bit: (a) sums the two batches'
gradients across the ranks, (b) and (c) accumulate them in one buffer in another order (the head's
backward and the body's backward add into the shared embedding's gradient one after the other), and
(b) and (c) compute matrix products of other shapes (the padded ones), which round differently."""

import contextlib
import os

import pytest
import torch

from _models import lightseq_train, log_lines, save_rank_result, two_rank_results
from test_end_to_end import TRAIN_FLAGS, _params

UPDATES = 5
FLAGS = [*TRAIN_FLAGS, "--dropout", "0", "--max-update", str(UPDATES), "--ls-graph-buckets", "2",
         "--grouped-shuffling", "--disable-validation"]
GRAPHED = UPDATES - 1  # the graph step starts after one eager update (graph_step.WARMUP_UPDATES)
REDUCED_AFTER_BACKWARD = "ls_adam: gradients all-reduced after the backward pass, whole buffers"


class _AsIfOnCuda:
    """A trainer that says it is on a GPU, for graph_step.unsupported_reason's other checks."""

    cuda = True

    def __init__(self, trainer):
        self._trainer = trainer

    def __getattr__(self, name):
        return getattr(self._trainer, name)


@contextlib.contextmanager
def _graph_step_on_cpu(packed=False):
    """lightseq-train's graph step on the CPU, without the replays, over padded or ``packed`` buckets; yields
    what it records: the engines made, the loss of every micro-batch in order (graph step or eager), and how
    many batches were grown to a larger bucket ("padded")."""
    from fairseq.tasks import FairseqTask

    from ls_fairseq.fairseq_ext.graph import graph_step
    from ls_fairseq.fairseq_ext.graph.packed_buckets import choose_packed
    from ls_fairseq.fairseq_ext.graph.shape_buckets import choose

    seen = {"engines": [], "losses": [], "padded": 0}
    real_reason, real_engine, real_train_step = graph_step.unsupported_reason, graph_step.GraphStep, \
        FairseqTask.train_step

    class CpuGraphStep(real_engine):
        def __init__(self, trainer, max_buckets):
            super().__init__(trainer, max_buckets, replay=False, packed=packed)
            seen["engines"].append(self)

        def micro_batch(self, sample, optimizer, num_updates):
            out = super().micro_batch(sample, optimizer, num_updates)
            if out is not None:
                seen["losses"].append(float(out[2]["loss"]))
                net = sample["net_input"]
                if packed:
                    pad = self.pad
                    src, tgt = int(net["src_tokens"].ne(pad).sum()), int(net["prev_output_tokens"].ne(pad).sum())
                    longest = int(max(net["src_tokens"].ne(pad).sum(1).max(), net["prev_output_tokens"].ne(pad).sum(1).max()))
                    bucket = choose_packed(self.buckets, len(net["src_tokens"]), src, tgt, longest)
                    seen["padded"] += (bucket.src_rows, bucket.tgt_rows) != (src, tgt)
                else:
                    shape = net["src_tokens"].shape + net["prev_output_tokens"].shape[1:]
                    bucket = choose(self.buckets, *shape)
                    seen["padded"] += shape != (bucket.sentences, bucket.src_len, bucket.tgt_len)
            return out

    def train_step(self, *args, **kwargs):  # the eager micro-batches
        out = real_train_step(self, *args, **kwargs)
        seen["losses"].append(float(out[2]["loss"]))
        return out

    graph_step.unsupported_reason = lambda trainer, several_gpus=False: real_reason(_AsIfOnCuda(trainer), several_gpus)
    graph_step.GraphStep = CpuGraphStep
    FairseqTask.train_step = train_step
    try:
        yield seen
    finally:
        graph_step.unsupported_reason, graph_step.GraphStep = real_reason, real_engine
        FairseqTask.train_step = real_train_step


def _flat_reduction(engine):
    """(the reduction strategy's class name, whether ls_adam's state is sharded) of the run's ls_adam."""
    from ls_fairseq.fairseq_ext.step.pending_update import unwrap_optimizer

    ls_adam, _ = unwrap_optimizer(engine.trainer.optimizer)
    return type(ls_adam._reduction.strategy).__name__, ls_adam.sharded


def _two_rank_worker(rank, port, out_dir):
    save = os.path.join(out_dir, "two")
    packed = os.path.exists(os.path.join(out_dir, "packed"))
    with _graph_step_on_cpu(packed) as seen, log_lines() as lines:
        lightseq_train([os.path.join(out_dir, "data"), "--save-dir", save, *FLAGS,
                        "--distributed-world-size", "2", "--distributed-rank", str(rank),
                        "--distributed-backend", "gloo", "--distributed-init-method", f"tcp://127.0.0.1:{port}",
                        "--distributed-no-spawn", "--ls-graph-step", "on",
                        "--ls-shard-state", "on"])  # asked for: the graph step keeps the whole state anyway
    engine, = seen["engines"]
    save_rank_result(out_dir, rank, {"losses": seen["losses"], "graphed": engine.counts["graph"],
                                     "padded": seen["padded"], "reduction": _flat_reduction(engine),
                                     "lines": lines})


@pytest.mark.parametrize("packed", [False, True])
def test_two_ranks_with_the_graph_step_take_the_updates_of_one_process_with_update_freq_2(data_bin, tmp_path, packed):
    """Padded buckets (fp32's) and packed ones (fp16 / bf16's on a GPU; here their arithmetic in fp32)."""
    os.symlink(data_bin, tmp_path / "data")
    if packed:
        (tmp_path / "packed").write_text("")
    ranks = two_rank_results(_two_rank_worker, tmp_path)

    with _graph_step_on_cpu(packed) as one:
        lightseq_train([data_bin, "--save-dir", str(tmp_path / "one"), *FLAGS, "--update-freq", "2"])
    with _graph_step_on_cpu() as eager:
        lightseq_train([data_bin, "--save-dir", str(tmp_path / "eager"), *FLAGS, "--update-freq", "2",
                        "--ls-graph-step", "off"])

    # the graph step ran on both ranks, through padded batches, and the reduction stayed after the backward
    engine, = one["engines"]
    assert engine.counts["graph"] == 2 * GRAPHED and one["padded"] > 0
    assert eager["engines"] == [] and len(eager["losses"]) == 2 * UPDATES
    for r in ranks:
        assert r["graphed"] == GRAPHED and r["padded"] > 0
        assert r["reduction"] == ("ReduceAfterBackward", False)
        said = [x for x in r["lines"] if REDUCED_AFTER_BACKWARD in x]
        assert len(said) == 1 and "optimizer state not sharded" in said[0], said
        assert not any("CUDA-graph step off" in x for x in r["lines"])

    # rank r's batch of update u is micro-batch r of update u in one process
    two = [loss for u in range(UPDATES) for loss in (ranks[0]["losses"][u], ranks[1]["losses"][u])]
    assert len(ranks[0]["losses"]) == len(ranks[1]["losses"]) == UPDATES
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(one["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-6)

    weights = {name: _params(str(tmp_path / name / "checkpoint_last.pt")) for name in ("two", "one", "eager")}
    for a, b in (("two", "one"), ("one", "eager")):
        for k in weights[b]:
            if k.endswith("k_proj.bias"):  # no effect on the softmax: rounding noise, which Adam scales up to lr
                torch.testing.assert_close(weights[a][k], weights[b][k], rtol=0, atol=UPDATES * 1e-3, msg=k)
                continue
            torch.testing.assert_close(weights[a][k], weights[b][k], rtol=1e-5, atol=1e-6, msg=f"{a}/{b}: {k}")


@pytest.mark.parametrize("packed", [False, True])
def test_batches_run_in_a_larger_captured_bucket_keep_the_eager_losses(data_bin, tmp_path, packed):
    """Capture pacing: batches that ran in a larger bucket while theirs waited for its capture have the eager
    step's losses, and the run's weights end where the eager run's do."""
    flags = [*TRAIN_FLAGS, "--dropout", "0", "--max-update", "12", "--ls-graph-buckets", "8", "--disable-validation"]
    with _graph_step_on_cpu(packed) as paced:
        lightseq_train([data_bin, "--save-dir", str(tmp_path / "paced"), *flags])
    with _graph_step_on_cpu() as eager:
        lightseq_train([data_bin, "--save-dir", str(tmp_path / "eager"), *flags, "--ls-graph-step", "off"])
    engine, = paced["engines"]
    assert engine.counts["stand_in"] > 0 and engine.counts["graph"] == 12 - graph_step_warmup()
    torch.testing.assert_close(torch.tensor(paced["losses"]), torch.tensor(eager["losses"]), rtol=1e-5, atol=1e-6)
    a, b = (_params(str(tmp_path / n / "checkpoint_last.pt")) for n in ("paced", "eager"))
    for k in b:  # the key bias: rounding noise that Adam scales up to lr (the two-rank test above)
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=12e-3 if k.endswith("k_proj.bias") else 1e-6, msg=k)


def graph_step_warmup():
    from ls_fairseq.fairseq_ext.graph.graph_step import WARMUP_UPDATES

    return WARMUP_UPDATES
