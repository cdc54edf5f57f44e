"""Checks of the data fairseq reads, naming the file, line or flag at fault, and the one-line error hook.

* :func:`check_translation_data` (lightseq-train, before training): an empty train split (fairseq: "cannot
  mmap an empty file") or token ids beyond the dictionary (an IndexError of the embedding, or training on the
  wrong tokens). Reads each train file once, memory-mapped.
* :func:`check_max_tokens` / :func:`install_max_tokens_check`: a --max-tokens no sentence fits (fairseq: an
  IndexError on an empty batch list) or smaller than a sentence it keeps (an assertion in its batching).
* :func:`install_raw_text_check`: bytes that are not UTF-8 in a --dataset-impl raw file: the file and line.
* :class:`InputError` (what the user can fix) and :func:`install_error_hook`, which prints it as one line.
"""

import glob
import os
import re
import sys
from typing import List, Optional

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


class DataError(InputError):
    """Data that fairseq cannot batch or read: the message names the flag, or the file and line."""


# ----------------------------------------------------------------------------- --max-tokens
def _num_tokens(dataset, indices):
    try:
        return np.asarray(dataset.num_tokens_vec(indices), dtype=np.int64)
    except NotImplementedError:
        return np.fromiter((dataset.num_tokens(int(i)) for i in indices), dtype=np.int64, count=len(indices))


def max_tokens_problem(dataset, max_tokens, max_positions=None, ignore_invalid_inputs: bool = False,
                       split: str = "") -> Optional[str]:
    """Why fairseq cannot batch ``dataset`` with ``max_tokens`` (None: it can). fairseq fails on it deep
    inside: an IndexError when no sentence is left (training drops the ones longer than --max-tokens), an
    assertion when one longer than --max-tokens is kept. ``max_positions`` / ``ignore_invalid_inputs``: as
    given to fairseq's get_batch_iterator (the sentences it drops first)."""
    if max_tokens is None:
        return None
    if int(max_tokens) <= 0:
        return f"--max-tokens must be a positive number of tokens per batch, got {max_tokens}"
    n_all = len(dataset)
    if n_all == 0:
        return None
    indices = np.arange(n_all, dtype=np.int64)
    tokens = _num_tokens(dataset, indices)
    where = f" of the {split} split" if split else ""
    kept = indices
    if ignore_invalid_inputs and max_positions is not None:
        kept, _ = dataset.filter_indices_by_size(indices, max_positions)
        kept = np.asarray(kept, dtype=np.int64)
        if kept.size == 0:
            shortest = int(tokens.min())
            if shortest > int(max_tokens):
                return (f"--max-tokens {max_tokens} is smaller than every sentence{where}: the shortest has "
                        f"{shortest} tokens (source or target, with its end-of-sentence); no batch can be made")
            return (f"no sentence{where} fits the maximum positions {max_positions} "
                    "(--max-source-positions / --max-target-positions)")
    too_long = kept[tokens[kept] > int(max_tokens)]
    if too_long.size:
        i = int(too_long[np.argmax(tokens[too_long])])
        hint = ("" if ignore_invalid_inputs else
                ", or leave such sentences out with --skip-invalid-size-inputs-valid-test")
        return (f"--max-tokens {max_tokens} is smaller than sentence {i}{where}, which has {int(tokens[i])} tokens "
                f"(source or target, with its end-of-sentence; {too_long.size} sentence(s) are longer than "
                f"--max-tokens): raise --max-tokens to at least {int(tokens[i])}{hint}")
    return None


def _split_name(task, dataset) -> str:
    for name, ds in (getattr(task, "datasets", None) or {}).items():
        if ds is dataset:
            return str(name)
    return ""


def check_max_tokens(cfg, task, split: str = "train") -> None:
    """Before training: raise :class:`DataError` naming --max-tokens when no sentence of ``split`` (loaded in
    ``task``) fits in a batch of ``cfg.dataset.max_tokens`` tokens (fairseq drops the longer train sentences
    and then fails on an empty list), or when it is not positive."""
    from fairseq.utils import resolve_max_positions

    max_tokens = cfg.dataset.max_tokens
    if max_tokens is None:
        return
    positions = resolve_max_positions(task.max_positions(), max_tokens) if int(max_tokens) > 0 else None
    problem = max_tokens_problem(task.dataset(split), max_tokens, positions, True, split)
    if problem is not None:
        raise DataError(problem)


def _checked_get_batch_iterator(inner):
    import inspect

    signature = inspect.signature(inner)

    def get_batch_iterator(self, *args, **kwargs):
        a = signature.bind(self, *args, **kwargs).arguments
        dataset, max_tokens = a.get("dataset"), a.get("max_tokens")
        key = (max_tokens, repr(a.get("max_positions")), bool(a.get("ignore_invalid_inputs", False)))
        if max_tokens is not None and getattr(dataset, "_ls_max_tokens_checked", None) != key:
            problem = max_tokens_problem(dataset, max_tokens, a.get("max_positions"), key[2],
                                         _split_name(self, dataset))
            if problem is not None:
                raise DataError(problem)
            try:
                dataset._ls_max_tokens_checked = key  # each epoch asks again: the answer is the same
            except AttributeError:
                pass
        return inner(self, *args, **kwargs)

    get_batch_iterator.ls_checked = True
    return get_batch_iterator


def install_max_tokens_check() -> None:
    """fairseq's batching (FairseqTask.get_batch_iterator: training, validation, generation) checks
    --max-tokens against the data first (:func:`max_tokens_problem`). Idempotent."""
    from fairseq.tasks import FairseqTask

    if not getattr(FairseqTask.get_batch_iterator, "ls_checked", False):
        FairseqTask.get_batch_iterator = _checked_get_batch_iterator(FairseqTask.get_batch_iterator)


# ----------------------------------------------------------------------------- raw text (--dataset-impl raw)
def undecodable_line(path: str):
    """(line number from 1, byte offset in the line, reason) of the first line of ``path`` that is not
    UTF-8, or None."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return number, e.start, e.reason
    return None


def _checked_read_data(inner):
    def read_data(self, path, dictionary):
        try:
            return inner(self, path, dictionary)
        except UnicodeDecodeError as e:
            where = undecodable_line(path)
            line = f", line {where[0]} (byte {where[1] + 1} of the line)" if where else ""
            raise DataError(f"{path}{line} is not UTF-8 text ({e.reason}): --dataset-impl raw reads UTF-8; "
                            "convert the file (for example iconv -f latin1 -t utf-8)") from None

    read_data.ls_checked = True
    return read_data


def install_raw_text_check() -> None:
    """fairseq's raw text datasets (--dataset-impl raw) name the file and line of bytes that are not UTF-8,
    instead of a bare UnicodeDecodeError. Costs nothing on valid files. Idempotent."""
    from fairseq.data import indexed_dataset

    cls = indexed_dataset.IndexedRawTextDataset
    if not getattr(cls.read_data, "ls_checked", False):
        cls.read_data = _checked_read_data(cls.read_data)
