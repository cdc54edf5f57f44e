"""Shared pieces of the lightseq-* commands: find the plugin's --user-dir, add it, and shield
the user from fairseq-fixed 0.12.3.1's traps (see each helper)."""

import importlib
import importlib.util
import logging
import os
import sys
import tempfile

from ls_fairseq.argv import has_flag  # noqa: F401  (the CLIs' name for it)

logger = logging.getLogger(__name__)

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PLUGIN_INIT = "import ls_fairseq.fairseq_ext  # noqa: F401\n"


def user_dir_path() -> str:
    """The folder to pass as --user-dir.

    In a source checkout (``pip install -e .``) it is the repository's ``user_dir/``.
    For a non-editable install, a one-line plugin folder is written once under the user's
    cache (its basename, ``user_dir``, is what fairseq imports; it only imports
    ls_fairseq.fairseq_ext, so it never registers anything twice).
    """
    repo = os.path.join(_PKG_ROOT, "user_dir")
    if os.path.isfile(os.path.join(repo, "__init__.py")):
        return repo
    cache = os.environ.get("XDG_CACHE_HOME", os.path.join(os.path.expanduser("~"), ".cache"))
    path = os.path.join(cache, "ls_fairseq", "plugin", "user_dir")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        path = os.path.join(tempfile.gettempdir(), f"ls_fairseq_plugin_{os.getuid()}", "user_dir")
        os.makedirs(path, exist_ok=True)
    init = os.path.join(path, "__init__.py")
    if not os.path.isfile(init):
        with open(init, "w") as f:
            f.write(_PLUGIN_INIT)
    return path


def with_user_dir(argv):
    """argv with --user-dir added unless the user already gave one."""
    argv = list(argv)
    if not has_flag(argv, "--user-dir"):
        argv += ["--user-dir", user_dir_path()]
    return argv


def with_full_last_batch(argv):
    """argv with ``--required-batch-size-multiple 1`` unless the user gave a value.

    fairseq-generate / fairseq-validate inherit the training default of 8; with a batch
    size that is not a multiple of it the batching silently leaves sentences out. Evaluating
    every sentence is what a user expects, so the lightseq commands ask for multiples of 1.
    """
    argv = list(argv)
    if not has_flag(argv, "--required-batch-size-multiple"):
        argv += ["--required-batch-size-multiple", "1"]
    return argv


def _flag_value(argv, flag):
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def checkpoint_task(path: str):
    """The task name a fairseq checkpoint was trained with, or None if it cannot be read.

    Reads the file memory-mapped, so the weights are not loaded."""
    import torch

    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as e:  # noqa: BLE001 - any failure means "unknown", fairseq reports it later
        logger.debug("could not read the task from %s: %s", path, e)
        return None
    cfg = state.get("cfg")
    task = None
    if cfg is not None:
        task = cfg.get("task", {}) if hasattr(cfg, "get") else None
        task = task.get("_name") if hasattr(task, "get") else None
    if task is None and state.get("args") is not None:
        task = getattr(state["args"], "task", None)
    return task


def with_task(argv, default="translation"):
    """argv with ``--task`` added unless given.

    fairseq-validate's parser has no default task (0.12 crashes with ``KeyError: None``
    without ``--task``); the task is read from the first ``--path`` checkpoint, falling
    back to ``default``.
    """
    argv = list(argv)
    if has_flag(argv, "--task"):
        return argv
    path = _flag_value(argv, "--path")
    task = checkpoint_task(path.split(os.pathsep)[0]) if path else None
    argv += ["--task", task or default]
    return argv


def set_argv(argv):
    sys.argv = [sys.argv[0]] + list(argv)


def ensure_checkpoint_compat():
    """Apply the torch>=2.6 checkpoint-loading fix before fairseq loads anything.

    The fix lives in ls_fairseq.fairseq_ext.compat and is applied when the plugin is
    imported. If the plugin as a whole cannot be imported (a broken install), the compat
    module is loaded on its own, so that a run with another --user-dir still loads
    checkpoints; the import error surfaces again when fairseq imports the user dir.
    """
    try:
        importlib.import_module("ls_fairseq.fairseq_ext.compat")
        return "plugin"
    except ImportError as e:
        path = os.path.join(_PKG_ROOT, "ls_fairseq", "fairseq_ext", "compat.py")
        logger.warning("ls_fairseq.fairseq_ext could not be imported (%s); applying the "
                       "checkpoint-loading fix on its own", e)
        spec = importlib.util.spec_from_file_location("_ls_fairseq_compat_standalone", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # patches fairseq.checkpoint_utils at import
        return "standalone"


def setup_logging():
    """fairseq's console log format, set before fairseq is imported (an import-time log
    message would otherwise install Python's default format first). No-op when the root
    logger already has handlers (e.g. under pytest)."""
    logging.basicConfig(
        format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        level=os.environ.get("LOGLEVEL", "INFO").upper(),
        stream=sys.stdout,
    )


def prepare(argv):
    """The argv every lightseq-* command starts from (sys.argv[1:] when None)."""
    setup_logging()
    argv = sys.argv[1:] if argv is None else list(argv)
    argv = with_user_dir(argv)
    ensure_checkpoint_compat()
    return argv


def check_checkpoint_paths(argv, prog: str) -> None:
    """Before fairseq starts: every --path checkpoint is a complete file, else one line naming it and what is
    wrong (exit status 1). With --checkpoint-suffix or shards the names are fairseq's to make: the checks
    :func:`run_fairseq_main` installs catch those when they are read."""
    if has_flag(argv, "--checkpoint-suffix") or has_flag(argv, "--checkpoint-shard-count"):
        return
    paths = _flag_value(argv, "--path")
    if not paths:
        return
    try:
        from ls_fairseq.fairseq_ext.checkpoint_files import CheckpointFileError, check_checkpoint_file
    except ImportError:  # a broken install: fairseq reports it when it imports the plugin
        return
    for path in paths.split(os.pathsep):
        try:
            check_checkpoint_file(path)
        except CheckpointFileError as e:
            raise SystemExit(f"{prog}: error: {e}") from None


def run_fairseq_main(prog: str, main) -> None:
    """fairseq's ``main()`` with every checkpoint it loads checked first, --max-tokens checked against the data
    and raw text files read with their undecodable lines named; bad input the plugin names (a checkpoint file,
    an option, a data file: InputError) ends it with one line and exit status 1."""
    try:
        import ls_fairseq.fairseq_ext  # noqa: F401  (the plugin: fairseq_ext/patches.py installs the checks)
        from ls_fairseq.fairseq_ext.data_checks import InputError
    except ImportError:  # a broken install: fairseq reports it when it imports the plugin
        main()
        return
    try:
        main()
    except InputError as e:
        raise SystemExit(f"{prog}: error: {e}") from None
