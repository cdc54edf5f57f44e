"""Checks of a translation data-bin before training, for lightseq-train.

fairseq fails deep inside on a data-bin whose files do not fit together: an empty train split ends in
"cannot mmap an empty file", and a binarized split with token ids beyond its dictionary (a dictionary swapped
for a smaller one, or a damaged ``.bin``) in an ``IndexError`` of the embedding, or, where the ids happen to fit,
trains on the wrong tokens. These checks read each train file once (a memory-mapped maximum: well under a
second for WMT14) and name the file and the problem.
"""

import glob
import os
import re
import sys
from typing import List

import numpy as np


class InputError(ValueError):
    """Bad input the user can fix (a flag, a file, a line of data): the message names it and says what is
    wrong. Under :func:`install_error_hook` an uncaught one ends the command with that one line."""


def _one_line_hook(previous):
    def hook(exc_type, exc, tb):
        if isinstance(exc, InputError):
            prog = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "fairseq"
            sys.stderr.write(f"{prog}: error: {exc}\n")
            sys.stderr.flush()
            return
        previous(exc_type, exc, tb)

    hook.ls_one_line = True
    return hook


def install_error_hook() -> None:
    """Print an uncaught :class:`InputError` as one line ("<command>: error: <message>") instead of a
    traceback; the process still exits with status 1. Other exceptions keep the previous hook. Idempotent."""
    if not getattr(sys.excepthook, "ls_one_line", False):
        sys.excepthook = _one_line_hook(sys.excepthook)


def _dict_size(path: str) -> int:
    from fairseq.data import Dictionary

    return len(Dictionary.load(path))


def check_translation_data(data: str, split: str = "train") -> List[str]:
    """Problems of the binarized ``split`` files under the data folders ``data`` (fairseq's colon-separated
    list); each a sentence naming the file. Only mmap-format files are read (fairseq's default)."""
    from fairseq.data import indexed_dataset

    problems = []
    for folder in [p for p in str(data).split(os.pathsep) if p]:
        for bin_path in sorted(glob.glob(os.path.join(folder, f"{split}*.bin"))):
            m = re.match(r".*\.([^.]+)\.bin$", bin_path)
            if m is None:
                continue
            lang, prefix = m.group(1), bin_path[:-4]
            dict_path = os.path.join(folder, f"dict.{lang}.txt")
            if os.path.getsize(bin_path) == 0:
                problems.append(f"{bin_path} is empty: the {split} split has no sentences (check the text files "
                                "given to fairseq-preprocess)")
                continue
            if not os.path.exists(dict_path) or indexed_dataset.infer_dataset_impl(prefix) != "mmap":
                continue
            try:
                ds = indexed_dataset.MMapIndexedDataset(prefix)
                tokens = np.frombuffer(ds._bin_buffer, dtype=ds._index.dtype)
                top = int(tokens.max()) if tokens.size else -1
                del tokens, ds
            except (ValueError, OSError, IndexError) as e:
                problems.append(f"{bin_path} cannot be read as binarized data ({e})")
                continue
            size = _dict_size(dict_path)
            if top >= size:
                problems.append(f"{bin_path} holds token id {top}, but {dict_path} has only {size} entries: the "
                                "data was binarized with another dictionary, or the file is damaged")
    return problems
