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
from typing import List

import numpy as np


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
