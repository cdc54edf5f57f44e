"""fairseq-train / lightseq-train in-process, reporting what fairseq's log does not: the
per-epoch wall time measured around each epoch, and the peak GPU memory.

    python benchmarks/train_entry.py {native|ls|fairseq|deepspeed} DATA [flags...]

native and fairseq: fairseq-train (fairseq: the ls components through --user-dir); ls: lightseq-train;
deepspeed: lightseq-deepspeed as one process.

Lines it adds to the log:  BENCH epoch=N seconds=S tgt_tokens=W  and  BENCH peak_mem_gb=G

The peak is torch.cuda.max_memory_allocated() over the whole run: fairseq's Trainer resets the peak
statistics after every step (for its gb_free meter), which here is turned into a no-op, or the value
read at the end would only cover the last step's tail (the static weights and optimizer state).
"""

import os
import sys
import time


sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo, for ls_fairseq


def main():
    mode, argv = sys.argv[1], sys.argv[2:]
    import torch

    paths = os.environ.get("BENCH_PY_PATHS")  # bench_train.py's ..._py_layers / ..._py_ops kinds
    if paths:
        from ls_fairseq.ops import _dispatch

        _dispatch._CPP_LAYERS = False
        if paths == "py_ops":
            _dispatch._CPP_AUTOGRAD = _dispatch._CPP_LINEAR = False
        print(f"BENCH paths: {_dispatch.explain_autograd()}", flush=True)

    from fairseq_cli import train as fs_train

    if mode == "ls":
        from ls_fairseq.cli import train as ls_train

        runner = ls_train.cli_main
    elif mode == "deepspeed":
        from ls_fairseq.cli import deepspeed_train

        runner = deepspeed_train.cli_main
        _time_deepspeed_epochs()
    else:
        runner = fs_train.cli_main

    original = fs_train.train

    def timed_train(cfg, trainer, task, epoch_itr):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        words0 = _words(trainer)
        out = original(cfg, trainer, task, epoch_itr)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(f"BENCH epoch={epoch_itr.epoch} seconds={dt:.3f} tgt_tokens={_words(trainer) - words0}", flush=True)
        return out

    fs_train.train = timed_train
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats = lambda *a, **k: None  # the peak of the whole run (see above)
    from fairseq import trainer as fs_trainer

    from ls_fairseq.fairseq_ext.step.trainer import LSTrainer

    for cls in (fs_trainer.Trainer, LSTrainer):  # LSTrainer's own step does not go through fairseq's
        _count_words(cls)
    sys.argv = [sys.argv[0]] + argv
    try:
        runner()
    finally:
        if torch.cuda.is_available():
            print(f"BENCH peak_mem_gb={torch.cuda.max_memory_allocated() / 2**30:.3f}", flush=True)
            print(f"BENCH peak_reserved_gb={torch.cuda.max_memory_reserved() / 2**30:.3f}", flush=True)


def _count_words(cls):
    """Make cls.train_step add the target words of its samples to trainer._bench_words (once per
    step, also when one counted train_step calls another)."""
    step = cls.__dict__["train_step"]

    def counting_step(self, samples, *a, **kw):
        if self.__dict__.get("_bench_in_step"):
            return step(self, samples, *a, **kw)
        self._bench_words = getattr(self, "_bench_words", 0) + sum(
            int(s["ntokens"]) for s in samples if s and "ntokens" in s)
        self._bench_in_step = True
        try:
            return step(self, samples, *a, **kw)
        finally:
            self._bench_in_step = False

    cls.train_step = counting_step


def _time_deepspeed_epochs():
    """BENCH epoch lines for lightseq-deepspeed, whose loop asks its trainer for a new iterator before the first
    epoch and after each one."""
    import torch

    from ls_fairseq.cli.deepspeed_trainer import DeepSpeedTrainer

    _count_words(DeepSpeedTrainer)
    make = DeepSpeedTrainer.train_iterator
    state = {"epoch": 0}

    def train_iterator(self, *a, **k):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now, words = time.perf_counter(), _words(self)
        if state["epoch"]:
            print(f"BENCH epoch={state['epoch']} seconds={now - state['t0']:.3f} "
                  f"tgt_tokens={words - state['w0']}", flush=True)
        itr = make(self, *a, **k)
        state.update(epoch=state["epoch"] + 1, t0=time.perf_counter(), w0=words)
        return itr

    DeepSpeedTrainer.train_iterator = train_iterator


def _words(trainer):
    return getattr(trainer, "_bench_words", 0)


if __name__ == "__main__":
    main()
