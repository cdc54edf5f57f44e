"""Checkpoint files that survive an interrupted save, for lightseq-train.

fairseq writes each checkpoint once (``checkpoint_E_U.pt`` or ``checkpointE.pt``) to a temporary name and
renames it, which is atomic; it then *copies* that file to the other names of the same save
(``checkpoint_last.pt``, ``checkpoint_best.pt``) with a plain file copy. A process killed during that copy
leaves a truncated ``checkpoint_last.pt``, and the next run fails to read it (or, when the user deletes it,
silently starts again from update 0).

* :func:`install_atomic_copies` makes those copies atomic: a copy to a temporary file in the same folder,
  flushed to disk and renamed over the old one, so each name holds a complete checkpoint at every moment:
  the old one or the new one.
* :func:`recover_last_checkpoint` runs before training starts: it removes temporary files an interrupted save
  left behind and, when ``checkpoint_last.pt`` is unreadable, sets it aside and puts the newest readable
  checkpoint of the folder in its place, saying which.
"""

import glob
import logging
import os
import re
import shutil
import zipfile
from typing import List, Optional

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


def readable(path: str) -> bool:
    """Whether ``path`` is a complete checkpoint file. torch saves zip archives, whose directory sits at the
    end of the file: a truncated file has none. (Files of torch's old, pre-zip format are taken as readable.)"""
    try:
        if os.path.getsize(path) == 0:
            return False
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"PK\x03\x04":
            return magic[:1] == b"\x80"  # a legacy pickle-format checkpoint
        with zipfile.ZipFile(path) as z:
            return len(z.namelist()) > 0
    except (OSError, zipfile.BadZipFile):
        return False


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
