"""``python -m ls_fairseq.info``: what this installation runs, and why.

Prints the versions of Python, torch, CUDA and fairseq, whether the compiled extension
``ls_fairseq._C`` is loaded (prebuilt / JIT, or why not), and for every public op the path it
takes on CUDA tensors. Importing this module touches neither CUDA nor fairseq; everything
happens in :func:`report`.
"""

import platform
import sys
from importlib import metadata
from typing import List


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _torch_lines() -> List[str]:
    try:
        import torch
    except ImportError as e:
        return [f"torch: not importable ({e})"]
    lines = [f"torch: {torch.__version__}", f"torch CUDA build: {torch.version.cuda or 'none (CPU-only build)'}"]
    if torch.version.cuda is not None:
        try:
            n = torch.cuda.device_count()
            if n == 0:
                lines.append("CUDA devices: none visible")
            for i in range(n):
                major, minor = torch.cuda.get_device_capability(i)
                lines.append(f"CUDA device {i}: {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
        except Exception as e:  # noqa: BLE001 - a broken driver is worth reporting, not raising
            lines.append(f"CUDA devices: cannot be queried ({type(e).__name__}: {e})")
    return lines


def _fairseq_line() -> str:
    version = _dist_version("fairseq-fixed")
    if version != "not installed":
        return f"fairseq: fairseq-fixed {version}"
    version = _dist_version("fairseq")
    return f"fairseq: {version}" if version != "not installed" else "fairseq: not installed"


def _extension_lines() -> List[str]:
    from ls_fairseq import _ext

    mod = _ext.get()
    if mod is None:
        return [f"ls_fairseq._C: not loaded ({_ext.reason()})"]
    where = getattr(mod, "__file__", "?")
    return [f"ls_fairseq._C: loaded ({_ext.source()}, {where})"]


def _op_lines() -> List[str]:
    from ls_fairseq.ops import _dispatch

    width = max(len(op) for op in _dispatch.KERNEL_ENTRY)
    return [f"  {op:<{width}}  {_dispatch.explain(op)}" for op in _dispatch.KERNEL_ENTRY]


def report() -> str:
    """The full report as one string."""
    import ls_fairseq

    lines = [
        f"ls_fairseq: {ls_fairseq.__version__} ({ls_fairseq.__file__})",
        f"python: {platform.python_version()} ({sys.executable})",
    ]
    lines += _torch_lines()
    lines.append(_fairseq_line())
    lines += _extension_lines()
    lines.append("ops (path on CUDA tensors; CPU tensors always run the PyTorch reference):")
    lines += _op_lines()
    from ls_fairseq.ops import _dispatch

    lines.append(f"autograd (eager, CUDA tensors): {_dispatch.explain_autograd()}")
    return "\n".join(lines)


def main() -> None:
    print(report())


if __name__ == "__main__":
    main()
