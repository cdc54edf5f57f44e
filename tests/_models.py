"""Helpers for the tests: native and ls transformer models without data on disk, binarised toy data,
fairseq's and the plugin's mains run in-process, checked command runs, two-rank runs. (The C++ modules
built for the CPU tests: tests/_cpu_builds.py.)"""

import argparse
import contextlib
import json
import logging
import os
import sys
import types

import torch


# lightseq-train flags of the small transformer the GPU tests train on a WMT-shaped corpus
SMALL_LS_TRAIN = ["--arch", "ls_transformer_wmt_en_de", "--encoder-layers", "2", "--decoder-layers", "2",
                  "--encoder-embed-dim", "256", "--decoder-embed-dim", "256", "--encoder-ffn-embed-dim", "1024",
                  "--decoder-ffn-embed-dim", "1024", "--encoder-attention-heads", "4",
                  "--decoder-attention-heads", "4", "--share-all-embeddings", "--optimizer", "ls_adam",
                  "--adam-betas", "(0.9, 0.98)", "--lr", "5e-4", "--lr-scheduler", "inverse_sqrt",
                  "--warmup-updates", "50", "--criterion", "ls_label_smoothed_cross_entropy",
                  "--label-smoothing", "0.1"]


def saved_bytes(fn, params=()):
    """(fn(), bytes of the distinct storages autograd keeps for the backward of what fn records, ``params``
    (the weights, static memory) left out)."""
    storages = {}
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def make_dict(n_words: int = 50):
    """A fairseq Dictionary of ``n_words`` words. (fairseq is imported where needed: the two-rank workers
    import this module, and those that do not use fairseq start faster without it.)"""
    from fairseq.data import Dictionary

    d = Dictionary()
    for i in range(n_words):
        d.add_symbol(f"w{i}")
    return d


def build_model(arch: str, dictionary, task_cfg=None, **overrides):
    import ls_fairseq.fairseq_ext  # noqa: F401  (registers the ls archs)
    from fairseq.models import ARCH_CONFIG_REGISTRY, ARCH_MODEL_REGISTRY

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)
    ARCH_MODEL_REGISTRY[arch].add_args(parser)
    args = parser.parse_args([])
    for k, v in overrides.items():
        setattr(args, k, v)
    ARCH_CONFIG_REGISTRY[arch](args)
    task = types.SimpleNamespace(source_dictionary=dictionary, target_dictionary=dictionary)
    if task_cfg is not None:
        task.cfg = task_cfg
    return ARCH_MODEL_REGISTRY[arch].build_model(args, task)


def random_batch(d, B=3, S=7, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(d.nspecial, len(d), (B, S), generator=g)
    tgt = torch.randint(d.nspecial, len(d), (B, T), generator=g)
    src[0, -2:] = d.pad()  # a padded source row
    tgt[1, -3:] = d.pad()  # a padded target row (right padding, as fairseq batches it)
    prev = torch.cat([torch.full((B, 1), d.eos()), tgt[:, :-1]], dim=1)
    prev[1, -2:] = d.pad()
    lengths = src.ne(d.pad()).sum(1)
    return src, lengths, prev, tgt


# ----------------------------------------------------------------------------- fairseq's mains in-process
# A subprocess pays seconds for importing fairseq; a test that is not about the command line itself (its
# process, its exit, its console script) runs the main in the test's process instead.
TOY_CORPUS = {"n_train": 240, "n_valid": 32, "n_test": 37, "seed": 5}  # 37: not a multiple of 8


class _JsonRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.items = []

    def emit(self, record):
        try:
            self.items.append((record.name, json.loads(record.getMessage())))
        except ValueError:
            pass


@contextlib.contextmanager
def fairseq_run():
    """Collect fairseq's json progress records (``--log-format json``) as (logger name, record); restore
    sys.argv and the root logging handlers afterwards."""
    lg = logging.getLogger("fairseq.logging.progress_bar")
    handler, level = _JsonRecords(), lg.level
    lg.setLevel(logging.INFO)
    lg.addHandler(handler)
    argv, root_handlers = list(sys.argv), list(logging.root.handlers)
    try:
        yield handler.items
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)
        sys.argv = argv
        for h in list(logging.root.handlers):
            if h not in root_handlers:
                logging.root.removeHandler(h)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@contextlib.contextmanager
def log_lines(names=("fairseq", "fairseq_cli", "ls_fairseq")):
    """The messages (INFO and up) logged under the loggers ``names`` while inside, as a list of lines: what
    a lightseq-train process would print."""
    handler = _Lines()
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        yield handler.lines
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


def lightseq_train(argv):
    """lightseq-train ``argv`` in this process; its json progress records (see :func:`fairseq_run`)."""
    from ls_fairseq.cli import train

    with fairseq_run() as records:
        train.cli_main(list(argv))
    return records


def fairseq_main(name, argv):
    """fairseq's own ``fairseq-<name>`` (fairseq_cli.<name>.cli_main, which reads sys.argv) on ``argv`` in this
    process; its json progress records (see :func:`fairseq_run`)."""
    import importlib

    module = importlib.import_module(f"fairseq_cli.{name}")
    with fairseq_run() as records:
        sys.argv = [f"fairseq-{name}", *argv]
        module.cli_main()
    return records


def inner_by_update(records):
    """{num_updates: train_inner record} of :func:`lightseq_train`'s records."""
    return {int(r["num_updates"]): r for name, r in records if name == "train_inner"}


def preprocess(raw, dest, src="src", tgt="tgt", test=True):
    """fairseq-preprocess (in this process) of ``raw``/{train,valid[,test]}.{src,tgt} into ``dest``, with a
    joined dictionary; returns ``dest`` as a string."""
    from fairseq import options
    from fairseq_cli import preprocess as fairseq_preprocess

    raw, dest = str(raw), str(dest)
    args = options.get_preprocessing_parser().parse_args([
        "--source-lang", src, "--target-lang", tgt, "--joined-dictionary", "--workers", "1",
        "--trainpref", f"{raw}/train", "--validpref", f"{raw}/valid", "--destdir", dest,
        *(["--testpref", f"{raw}/test"] if test else []),
    ])
    with fairseq_run():
        fairseq_preprocess.main(args)
    return dest


def make_toy_data_bin(work):
    """scripts/make_toy_corpus.py's corpus (:data:`TOY_CORPUS`) under ``work``/raw, binarised into
    ``work``/data-bin."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("make_toy_corpus",
                                                  os.path.join(root, "scripts", "make_toy_corpus.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.make_corpus(os.path.join(str(work), "raw"), **TOY_CORPUS)
    return preprocess(os.path.join(str(work), "raw"), os.path.join(str(work), "data-bin"))


def run_checked(cmd, cwd, env, timeout: int):
    """Run ``cmd``; its stdout + stderr, or an AssertionError with the command and the output's tail."""
    import subprocess

    res = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    out = res.stdout + res.stderr
    if res.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({res.returncode}):\n{out[-6000:]}")
    return out


def binarize(root, src="en", tgt="de"):
    """fairseq-preprocess {train,valid,test}.{src,tgt} under ``root`` (a pathlib.Path) into root/bin."""
    import subprocess

    subprocess.run(["fairseq-preprocess", "--source-lang", src, "--target-lang", tgt, "--trainpref",
                    str(root / "train"), "--validpref", str(root / "valid"), "--testpref", str(root / "test"),
                    "--destdir", str(root / "bin"), "--joined-dictionary", "--workers", "1"],
                   check=True, capture_output=True)
    return str(root / "bin")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, worker, port, out_dir):
    # before the worker joins a process group, as in every fairseq process with the plugin
    # (otherwise the group can outlive destroy_process_group() and abort the rank at exit)
    from ls_fairseq._collective_defaults import import_collective_defaults_early

    import_collective_defaults_early()

    worker(rank, port, out_dir)


def spawn_two_ranks(worker, out_dir):
    """Run ``worker(rank, port, out_dir)`` in two processes (torch.multiprocessing.spawn)."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(worker, free_port(), str(out_dir)), nprocs=2, join=True)


def save_rank_result(out_dir, rank: int, result) -> None:
    """What a two-rank worker hands back to its test (read by :func:`two_rank_results`)."""
    import os

    torch.save(result, os.path.join(str(out_dir), f"rank{rank}.pt"))


def two_rank_results(worker, out_dir):
    """spawn_two_ranks, then what each rank saved with :func:`save_rank_result`."""
    import os

    spawn_two_ranks(worker, out_dir)
    return [torch.load(os.path.join(str(out_dir), f"rank{r}.pt")) for r in (0, 1)]


def lightseq_train_two_ranks(data, save_dir, log_dir, flags, env=None, timeout: int = 300, runner=None,
                             backend: str = "gloo"):
    """lightseq-train as two processes (ranks 0 and 1, --distributed-no-spawn): gloo on the CPU, or
    ``backend="nccl"`` with rank r on GPU r (``--device-id``). Returns rank 0's train_inner records
    by update (``--log-format json`` in ``flags``); raises with the log's tail when a rank fails.
    ``runner(rank)``: the command before lightseq-train's arguments (default
    ``python -m ls_fairseq.cli.train``)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    port = free_port()
    # a rank that aborts prints its Python stack into its log
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", **(env or {}))
    procs, logs = [], []
    for rank in (0, 1):
        prefix = runner(rank) if runner is not None else [sys.executable, "-m", "ls_fairseq.cli.train"]
        cmd = [*prefix, data, "--save-dir", str(save_dir), *flags,
               "--distributed-world-size", "2", "--distributed-rank", str(rank), "--distributed-backend", backend,
               "--distributed-init-method", f"tcp://127.0.0.1:{port}", "--distributed-no-spawn"]
        if backend == "nccl":
            cmd += ["--device-id", str(rank)]
        log = open(os.path.join(str(log_dir), f"rank{rank}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for log in logs:
            log.close()
    text = open(os.path.join(str(log_dir), "rank0.log")).read()
    if codes != [0, 0]:
        raise AssertionError(f"two-rank lightseq-train exited with {codes}:\n{text[-4000:]}")
    return train_inner_records(text)


def train_inner_records(text: str):
    """The train_inner records of a ``--log-format json`` training log, by update."""
    import json

    records = {}
    for line in text.splitlines():
        if "| train_inner |" in line:
            rec = json.loads(line.split("| train_inner | ", 1)[1])
            records[int(rec["num_updates"])] = rec
    return records


def load_checkpoint(path: str):
    """A fairseq checkpoint on the CPU, read as lightseq-train reads it (torch >= 2.6 included)."""
    from fairseq import checkpoint_utils

    from ls_fairseq.fairseq_ext.compat import patch_checkpoint_loading

    patch_checkpoint_loading()
    return checkpoint_utils.load_checkpoint_to_cpu(path)


def checkpoint_optimizer_tensors(state) -> dict:
    """{(parameter index, key): tensor} of a checkpoint's optimizer state."""
    opt = state["last_optimizer_state"]["state"]
    return {(i, k): v for i, entry in opt.items() for k, v in entry.items() if torch.is_tensor(v)}


def assert_same_checkpoint_state(path_a, path_b):
    """The two checkpoints hold the same weights and the same optimizer state, bit for bit."""
    a, b = load_checkpoint(str(path_a)), load_checkpoint(str(path_b))
    assert sorted(a["model"]) == sorted(b["model"])
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    ta, tb = checkpoint_optimizer_tensors(a), checkpoint_optimizer_tensors(b)
    assert sorted(ta) == sorted(tb) and len(tb) > 0
    for k in tb:
        assert torch.equal(ta[k], tb[k]), k
