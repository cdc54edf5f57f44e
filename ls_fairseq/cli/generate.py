"""lightseq-generate: fairseq-generate with the ls_fairseq plugin loaded.

Every fairseq-generate flag works unchanged. Differences from plain ``fairseq-generate``:

* ``--user-dir`` points at the plugin unless you give one;
* checkpoints load under torch >= 2.6 (fairseq's torch.load needs ``weights_only=False``); a missing, empty,
  truncated or random-bytes checkpoint is one line naming the file and what is wrong (exit status 1);
* ``--required-batch-size-multiple 1`` is added unless you give a value: with fairseq's
  default of 8 the batching can leave the last sentences of the test set untranslated.
"""

import sys
from typing import List, Optional

from ls_fairseq.cli import _common


def _int_flag(argv, flag: str, default: int) -> int:
    value = default
    for i, a in enumerate(argv):
        if a == "--":
            break
        if a == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"lightseq-generate: {flag} takes a whole number, got {value!r}") from None


def check_search_flags(argv: List[str]) -> None:
    """Clear errors for beam-search sizes fairseq fails on deep inside (--beam 0) or silently cuts
    (--nbest larger than --beam gives --beam hypotheses)."""
    beam, nbest = _int_flag(argv, "--beam", 5), _int_flag(argv, "--nbest", 1)
    if beam < 1:
        raise SystemExit(f"lightseq-generate: --beam must be >= 1, got {beam}")
    if nbest < 1:
        raise SystemExit(f"lightseq-generate: --nbest must be >= 1, got {nbest}")
    if nbest > beam:
        raise SystemExit(f"lightseq-generate: --nbest {nbest} is larger than --beam {beam}: beam search keeps {beam} "
                         f"hypotheses per sentence; use --beam {nbest} or more")


def build_argv(argv: Optional[List[str]] = None) -> List[str]:
    """The fairseq-generate argv lightseq-generate runs (sys.argv[1:] when None)."""
    argv = _common.with_full_last_batch(_common.prepare(argv))
    check_search_flags(argv)
    return argv


def cli_main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    _common.check_checkpoint_paths(argv, "lightseq-generate")
    argv = build_argv(argv)
    _common.set_argv(argv)  # fairseq-generate reads sys.argv
    from fairseq_cli import generate

    _common.run_fairseq_main("lightseq-generate", generate.cli_main)


if __name__ == "__main__":
    cli_main(sys.argv[1:])
