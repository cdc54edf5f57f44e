"""Checkpoint files that survive an interrupted save, and clear errors for those that did not.

fairseq writes each checkpoint to a temporary name and renames it (atomic), then *copies* it to the other names
of the same save (``checkpoint_last.pt``, ``checkpoint_best.pt``) with a plain copy: a process killed during that
copy leaves a truncated file, which the next run or command fails to read deep inside torch.load.

* :func:`install_atomic_copies` makes those copies atomic (a copy to a temporary file in the same folder,
  flushed and renamed over the old one): each name holds the old checkpoint or the new one at every moment.
* :func:`recover_last_checkpoint` (lightseq-train, before training) removes an interrupted save's temporary
  files and puts the newest readable checkpoint in place of an unreadable ``checkpoint_last.pt``, saying which.
* :func:`install_checkpoint_checks` makes every checkpoint fairseq loads checked first: a missing, empty,
  truncated or random-bytes file is a :class:`CheckpointFileError` naming the file and what is wrong.
"""

import glob
import logging
import os
import pickle
import re
import shutil
import zipfile
from typing import List, Optional

from ls_fairseq.fairseq_ext.data_checks import InputError, install_error_hook

logger = logging.getLogger("ls_fairseq.checkpoints")

TMP_SUFFIX = ".tmp"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_copy(src: str, dst: str) -> None:
    """Make ``dst`` a complete copy of ``src`` in one step: a copy to a temporary name in ``dst``'s folder,
    flushed to disk, renamed over ``dst``. (Not a hard link: a later in-place write to either name would change
    both.)"""
    folder = os.path.dirname(os.path.abspath(dst))
    tmp = os.path.join(folder, f".{os.path.basename(dst)}.{os.getpid()}{TMP_SUFFIX}")
    if os.path.lexists(tmp):
        os.unlink(tmp)
    with open(src, "rb") as fin, open(tmp, "wb") as fout:
        shutil.copyfileobj(fin, fout, 16 << 20)
        fout.flush()
        os.fsync(fout.fileno())
    os.replace(tmp, dst)
    _fsync_dir(folder)


class _AtomicCopies:
    """fairseq's PathManager with an atomic ``copy`` for local files (everything else is fairseq's)."""

    def __init__(self, inner):
        self._inner = inner

    def copy(self, src_path, dst_path, overwrite=False, **kwargs):
        if "://" in str(src_path) or "://" in str(dst_path):
            return self._inner.copy(src_path, dst_path, overwrite, **kwargs)
        if os.path.exists(dst_path) and not overwrite:
            return False
        atomic_copy(src_path, dst_path)
        return True

    def __getattr__(self, name):
        return getattr(self._inner, name)


def install_atomic_copies() -> None:
    """Make fairseq's checkpoint copies atomic (module docstring). Idempotent."""
    from fairseq import checkpoint_utils

    if not isinstance(checkpoint_utils.PathManager, _AtomicCopies):
        checkpoint_utils.PathManager = _AtomicCopies(checkpoint_utils.PathManager)


def checkpoint_problem(path: str) -> Optional[str]:
    """What is wrong with the local file ``path`` as a checkpoint, as a phrase to follow its name ("is empty
    (0 bytes) ..."), or None when it looks complete. torch saves zip archives, whose directory sits at the end
    of the file: a truncated file has none. (Files of torch's old, pre-zip format are taken as complete.)"""
    if not os.path.exists(path):
        return "was not found (no such file)"
    if os.path.isdir(path):
        return "is a folder, not a checkpoint file"
    try:
        if os.path.getsize(path) == 0:
            return "is empty (0 bytes): a save or copy that was interrupted before it wrote anything"
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"PK\x03\x04":
            if magic[:1] == b"\x80":
                return None  # a legacy pickle-format checkpoint
            return "is not a PyTorch checkpoint (it starts neither as a zip archive nor as a pickle)"
        with zipfile.ZipFile(path) as z:
            if not z.namelist():
                return "is an empty zip archive, not a checkpoint"
    except zipfile.BadZipFile:
        return "is truncated or damaged: its zip directory is missing (an interrupted save or copy?)"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def readable(path: str) -> bool:
    """Whether ``path`` is a complete checkpoint file (:func:`checkpoint_problem`)."""
    return checkpoint_problem(path) is None


def _update_count(path: str) -> int:
    m = re.search(r"checkpoint_(\d+)_(\d+)", os.path.basename(path))
    return int(m.group(2)) if m else -1


def candidates(save_dir: str, suffix: str = "") -> List[str]:
    """The checkpoints of ``save_dir`` other than checkpoint_last, newest first (by modification time)."""
    paths = [p for p in glob.glob(os.path.join(save_dir, f"checkpoint*{suffix}.pt"))
             if os.path.basename(p) != f"checkpoint_last{suffix}.pt"]
    return sorted(paths, key=lambda p: (os.path.getmtime(p), _update_count(p)), reverse=True)


def remove_stale_temporaries(save_dir: str) -> List[str]:
    """Delete the temporary files of interrupted saves (fairseq's ``*.pt.tmp`` and this module's)."""
    removed = []
    for p in glob.glob(os.path.join(save_dir, "*.pt.tmp")) + glob.glob(os.path.join(save_dir, f".*{TMP_SUFFIX}")):
        try:
            os.unlink(p)
            removed.append(p)
        except OSError:
            pass
    if removed:
        logger.info("removed %d temporary file(s) of an interrupted checkpoint save: %s", len(removed),
                    ", ".join(os.path.basename(p) for p in removed))
    return removed


def recover_last_checkpoint(save_dir: str, suffix: str = "") -> Optional[str]:
    """Before training: clean temporaries; when checkpoint_last is unreadable, move it to
    ``checkpoint_last.pt.unreadable`` and put the newest readable checkpoint in its place. Returns the
    checkpoint put in place, or None when nothing had to be done (or nothing readable is left: training then
    starts afresh, and the log says so)."""
    if not os.path.isdir(save_dir):
        return None
    remove_stale_temporaries(save_dir)
    last = os.path.join(save_dir, f"checkpoint_last{suffix}.pt")
    if not os.path.exists(last) or readable(last):
        return None
    aside = last + ".unreadable"
    os.replace(last, aside)
    for cand in candidates(save_dir, suffix):
        if readable(cand):
            atomic_copy(cand, last)
            logger.warning("%s is unreadable (an interrupted save?): set aside as %s; resuming from %s, the newest "
                           "readable checkpoint in %s", os.path.basename(last), os.path.basename(aside),
                           os.path.basename(cand), save_dir)
            return cand
    logger.warning("%s is unreadable (set aside as %s) and %s holds no other readable checkpoint: training starts "
                   "from the beginning", os.path.basename(last), os.path.basename(aside), save_dir)
    return None


# ----------------------------------------------------------------------------- checks when a checkpoint is read
class CheckpointFileError(InputError):
    """A checkpoint file that cannot be loaded: the message names the file and what is wrong."""


def check_checkpoint_file(path: str) -> None:
    """Raise :class:`CheckpointFileError` when the local file ``path`` is missing, empty, truncated or not a
    checkpoint (remote paths, with ``://``, are left to fairseq)."""
    if "://" in str(path):
        return
    problem = checkpoint_problem(str(path))
    if problem is not None:
        raise CheckpointFileError(f"checkpoint {path} {problem}")


# what torch.load raises on a file whose bytes are not a loadable checkpoint
_LOAD_ERRORS = (EOFError, pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, UnicodeDecodeError)


def load_state_checked(path: str, load, *args, **kwargs):
    """``load(path, *args, **kwargs)`` (a checkpoint reader) with :func:`check_checkpoint_file` before it and
    its unpickling errors, and a result without fairseq's "model" entry, as :class:`CheckpointFileError`."""
    check_checkpoint_file(path)
    try:
        state = load(path, *args, **kwargs)
    except _LOAD_ERRORS as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointFileError(f"checkpoint {path} cannot be read, it is damaged or not a checkpoint "
                                  f"({type(e).__name__}: {first})") from e
    except KeyError as e:  # fairseq's upgrade of the state found an entry missing
        raise CheckpointFileError(f"checkpoint {path} is not a fairseq checkpoint (it holds no {e} entry)") from e
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointFileError(f"checkpoint {path} is not a fairseq checkpoint (it holds no 'model' entry)")
    return state


def _checked_load_checkpoint_to_cpu(inner):
    def load_checkpoint_to_cpu(path, *args, **kwargs):
        return load_state_checked(path, inner, *args, **kwargs)

    load_checkpoint_to_cpu.ls_checked = True
    return load_checkpoint_to_cpu


def _checked_load_model_ensemble_and_task(inner):
    def load_model_ensemble_and_task(filenames, arg_overrides=None, task=None, strict=True, suffix="",
                                     num_shards=1, state=None):
        if state is None:  # fairseq's own names of the files it is going to read
            from fairseq.checkpoint_utils import get_maybe_sharded_checkpoint_filename

            for name in filenames:
                for shard in range(max(int(num_shards), 1)):
                    check_checkpoint_file(get_maybe_sharded_checkpoint_filename(name, suffix, shard, num_shards))
        return inner(filenames, arg_overrides, task, strict, suffix, num_shards, state)

    load_model_ensemble_and_task.ls_checked = True
    return load_model_ensemble_and_task


def install_checkpoint_checks() -> None:
    """Every checkpoint fairseq loads (fairseq-generate / -interactive / -validate / -train --restore-file,
    ensembles, the hub) is checked first: a missing, empty, truncated or random-bytes file raises
    :class:`CheckpointFileError` naming it, which the commands print as one line with exit status 1
    (:func:`ls_fairseq.fairseq_ext.data_checks.install_error_hook`, installed here too). Idempotent."""
    from fairseq import checkpoint_utils

    if not getattr(checkpoint_utils.load_checkpoint_to_cpu, "ls_checked", False):
        checkpoint_utils.load_checkpoint_to_cpu = _checked_load_checkpoint_to_cpu(
            checkpoint_utils.load_checkpoint_to_cpu)
    if not getattr(checkpoint_utils.load_model_ensemble_and_task, "ls_checked", False):
        checkpoint_utils.load_model_ensemble_and_task = _checked_load_model_ensemble_and_task(
            checkpoint_utils.load_model_ensemble_and_task)
    install_error_hook()
