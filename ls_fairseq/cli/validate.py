"""lightseq-validate: fairseq-validate with the ls_fairseq plugin loaded.

Every fairseq-validate flag works unchanged. Differences from plain ``fairseq-validate``:

* ``--user-dir`` points at the plugin unless you give one;
* checkpoints load under torch >= 2.6 (fairseq's torch.load needs ``weights_only=False``); a missing, empty,
  truncated or random-bytes checkpoint is one line naming the file and what is wrong (exit status 1);
* ``--required-batch-size-multiple 1`` is added unless you give a value, so every sentence of
  the subset is scored;
* ``--task`` defaults to the checkpoint's task (fairseq-validate 0.12 has no default task and
  fails with ``KeyError: None`` without one);
* ``--max-tokens 4096`` unless you give ``--max-tokens`` or ``--batch-size`` (fairseq-validate
  has no default batch size and stops with an assertion).
"""

import sys
from typing import List, Optional

from ls_fairseq.cli import _common

DEFAULT_MAX_TOKENS = 4096


def build_argv(argv: Optional[List[str]] = None) -> List[str]:
    """The fairseq-validate argv lightseq-validate runs (sys.argv[1:] when None)."""
    argv = _common.with_task(_common.with_full_last_batch(_common.prepare(argv)))
    if not (_common.has_flag(argv, "--max-tokens") or _common.has_flag(argv, "--batch-size")):
        argv += ["--max-tokens", str(DEFAULT_MAX_TOKENS)]
    return argv


def cli_main(argv: Optional[List[str]] = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if _common.has_flag(argv, "--bf16") or _common.has_flag(argv, "--memory-efficient-bf16"):
        # fairseq-validate casts the model under --fp16 only: a --bf16 run would validate in fp32 and say nothing
        raise SystemExit("lightseq-validate: --bf16 is not supported (fairseq-validate would run the model in fp32); "
                         "validate with --fp16 or in fp32")
    _common.check_checkpoint_paths(argv, "lightseq-validate")
    argv = build_argv(argv)
    _common.set_argv(argv)  # fairseq-validate parses sys.argv (twice)
    from fairseq_cli import validate

    _common.run_fairseq_main("lightseq-validate", validate.cli_main)


if __name__ == "__main__":
    cli_main(sys.argv[1:])
