"""Run lightseq-train and count the host reads of tensor values (bool, item, tolist, float, int)
made inside LSTrainer.train_step by fairseq's trainer and meters and by LSTrainer's own modules.
On a GPU each read of a GPU tensor waits for the device; on a --cpu run every tensor is counted.
Used by tests/test_deferred_step.py and tests/gpu/test_multi_gpu.py:

    python tests/_host_reads.py OUT.json <lightseq-train args>

Writes {"steps": n, "reads": {"name file:line": count}}; the first steps (warm-up) are not counted,
nor the deliberate read of the settled update's pinned copy (PendingUpdate.values)."""

import atexit
import collections
import contextlib
import json
import os
import sys
import traceback

import torch

WATCHED = (os.sep + os.path.join("fairseq", "logging") + os.sep, os.sep + os.path.join("fairseq", "trainer.py"),
           *(os.path.join("ls_fairseq", "fairseq_ext", name + ".py") for name in (
               "trainer", "deferred_step", "pending_update", "step_stats", "sample_prep", "step_timing")))
_READS = ("__bool__", "item", "tolist", "__float__", "__int__")


@contextlib.contextmanager
def counting_host_reads(on_cpu: bool):
    """While inside, the host reads made inside LSTrainer.train_step are counted; yields a function that
    returns {"steps": n, "reads": {"name file:line": count}} so far. Everything patched is restored on
    the way out. ``on_cpu``: a --cpu run, where every tensor stands for one that would be on the GPU."""
    from ls_fairseq.fairseq_ext.step.trainer import LSTrainer

    counts = collections.Counter()
    state = {"inside": False, "steps": 0}
    originals = {name: getattr(torch.Tensor, name) for name in _READS}
    own = {name for name in _READS if name in torch.Tensor.__dict__}  # the others are torch._C.TensorBase's

    def wrap(name):
        orig = originals[name]

        def read(self, *a, **k):
            # on a GPU run only a GPU tensor's read waits for the device (the batch's host copy is
            # read on purpose); on a --cpu run every tensor stands for one that would be on the GPU
            if state["inside"] and state["steps"] >= 2 and (self.is_cuda or on_cpu):
                for frame in reversed(traceback.extract_stack(limit=4)[:-1]):
                    if frame.name == "values":
                        break  # PendingUpdate.values: the settled update's pinned copy
                    if any(w in frame.filename for w in WATCHED):
                        counts[f"{name} {os.path.basename(frame.filename)}:{frame.lineno}"] += 1
                        break
            return orig(self, *a, **k)

        setattr(torch.Tensor, name, read)

    step = LSTrainer.__dict__["train_step"]  # LSTrainer's own

    def train_step(self, samples, raise_oom=False):
        state["inside"] = True
        try:
            return step(self, samples, raise_oom)
        finally:
            state["inside"] = False
            state["steps"] += 1

    for name in _READS:
        wrap(name)
    LSTrainer.train_step = train_step
    try:
        yield lambda: {"steps": max(0, state["steps"] - 2), "reads": dict(counts)}
    finally:
        LSTrainer.train_step = step
        for name, orig in originals.items():
            if name in own:
                setattr(torch.Tensor, name, orig)
            else:
                delattr(torch.Tensor, name)


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    # run as a script, this file's folder is first on sys.path: put the checkout there too
    sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ls_fairseq.cli import train

    with counting_host_reads("--cpu" in argv) as counted:
        @atexit.register
        def write():
            with open(out, "w") as f:
                json.dump(counted(), f)

        train.cli_main(argv)


if __name__ == "__main__":
    main()
