"""Reading a command line the way fairseq's parsers read it (no fairseq import: the CLIs use it first)."""


def has_flag(argv, flag: str) -> bool:
    """Whether ``flag`` is given in argv, as ``--flag value`` or ``--flag=value``.

    fairseq's parsers are built with ``allow_abbrev=False``, so only exact names count.
    Everything after a bare ``--`` is a positional argument, not a flag.
    """
    for a in argv:
        if a == "--":
            return False
        if a == flag or a.startswith(flag + "="):
            return True
    return False
