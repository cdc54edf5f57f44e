"""The first update's kernels loaded before the first epoch, beside the optimizer's setup.

The first call of a CUDA kernel in a process loads its code, and the first product of a cuBLAS kernel not
used before loads that kernel; each such load first waits for everything queued on the device. While the
host builds the optimizer before the first update, the GPU is idle: :class:`Prewarm` runs, on a helper
thread, a copy of the model cut to one encoder and one decoder layer through the first batch, forward and
backward, so the kernels load then, for the whole process. Nothing of the training is shared (own weights,
own copy of the batch, dropout from a generator fairseq reseeds every update); the trainer waits for the
helper before anything else runs the model, and a failure in the helper is logged and stops only the
warm-up. docs/graph_step.md ("The warm-up of the first update") has the details.
"""

import contextlib
import copy
import logging
import sys
import threading
import time

import torch

logger = logging.getLogger("fairseq.trainer")

SWITCH_INTERVAL = 0.0005  # seconds between the interpreter's thread switches while the helper runs


def _cut_copy(model):
    """A copy of an ls_transformer ``model`` with its first encoder and first decoder layer only (made on the
    calling thread: the live model's layer lists are swapped for the copy, then put back)."""
    enc, dec = model.encoder, model.decoder
    layers = (enc.layers, dec.layers)
    enc.layers = torch.nn.ModuleList(list(layers[0])[:1])
    dec.layers = torch.nn.ModuleList(list(layers[1])[:1])
    try:
        replica = copy.deepcopy(model)
    finally:
        enc.layers, dec.layers = layers
    replica.encoder.num_layers = 1
    replica.train()
    return replica


class Prewarm:
    """Starts the helper thread (module docstring) on ``sample``, a fairseq translation batch on the host as
    LSTrainer marks it for the eager step (``SamplePrep.marked_copy``); :meth:`join` waits for it."""

    def __init__(self, model, criterion, sample, device, preload_tokens=None):
        self.replica = _cut_copy(model)
        # token counts at which the products' kernels are loaded after the batch (gemm_lt.preload), or None
        self.preload_tokens = list(preload_tokens) if preload_tokens else None
        self.preloaded = None
        self.criterion, self.sample, self.device = criterion, sample, torch.device(device)
        self.error = None
        self.seconds = 0.0
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, SWITCH_INTERVAL))
        self._thread = threading.Thread(target=self._run, name="ls_fairseq-prewarm", daemon=True)
        self._thread.start()

    def _run(self):
        t0 = time.perf_counter()
        try:
            cuda = self.device.type == "cuda"
            with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
                self._first_batch()
                if cuda and self.preload_tokens:
                    from ls_fairseq.fairseq_ext.graph import gemm_lt

                    vocab = self.replica.decoder.output_projection.weight.shape[0]
                    self.preloaded = gemm_lt.preload(self.preload_tokens, skip_size=vocab)
                if cuda:
                    torch.cuda.current_stream().synchronize()
        except Exception as e:  # noqa: BLE001 - the warm-up only: training goes on without it
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.replica = self.sample = None
            self.seconds = time.perf_counter() - t0

    def _first_batch(self):
        """The batch through the criterion and back, as the eager first update runs it."""
        from fairseq import utils

        s = self.sample
        if self.device.type == "cuda":
            s = utils.move_to_cuda(s, device=self.device)
        loss, _, _ = self.criterion(self.replica, s)
        loss.backward()

    def join(self) -> float:
        """Wait for the helper and log once what it did. Returns the seconds waited."""
        t0 = time.perf_counter()
        self._thread.join()
        waited = time.perf_counter() - t0
        sys.setswitchinterval(self._switch)
        if self.error is not None:
            logger.info("kernel warm-up before the first update stopped (%s); training is not affected", self.error)
        else:
            logger.info("kernel warm-up before the first update: the first batch through a one-layer copy of the "
                        "model in %.2f s beside the optimizer's setup (the first update waited %.2f s for it)",
                        self.seconds, waited)
            if self.preloaded is not None:
                logger.info("cuBLASLt kernels loaded before the first update: %d classes at %d token counts, %d shapes "
                            "planned, %d products run", self.preloaded["classes"], len(self.preload_tokens),
                            self.preloaded["shapes"], self.preloaded["runs"])
        return waited
