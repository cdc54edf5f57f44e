"""Each training process of one machine keeps to its own CPU cores (``LS_FAIRSEQ_CPU_AFFINITY``).

With one micro-batch per update a GPU's training process is often limited by its host thread, and a second
training process beside it slows that thread (benchmarks/RESULTS.md, "Scaling"). The CPUs the process may use
are split into as many disjoint slices as there are training processes on the machine, whole physical cores
together (hyperthread siblings in one slice), and process ``local_rank`` keeps to its slice from the start of
lightseq-train's training function; threads and processes started afterwards inherit it.

``LS_FAIRSEQ_CPU_AFFINITY``: unset or ``auto``: split when two or more training processes share the machine, the
process may use every CPU (nobody restricted it already: taskset, numactl, a scheduler's cgroup) and every
slice gets at least ``AUTO_MIN_CPUS`` CPUs; ``1``: split whenever two or more training processes share the
machine, within the CPUs allowed; ``0``: never.
"""

import logging
import os
from typing import Dict, List, Optional, Sequence
from ls_fairseq import env

logger = logging.getLogger(__name__)

_TOPOLOGY = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"


AUTO_MIN_CPUS = 4  # "auto" leaves a machine alone where a slice would be smaller than this


def _parse_list(text: str) -> List[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]"""
    out = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out


def physical_cores(cpus: Sequence[int], siblings: Optional[Dict[int, List[int]]] = None) -> List[List[int]]:
    """``cpus`` grouped by physical core (each group sorted, groups in order of their first CPU).
    ``siblings``: CPU -> its hyperthread siblings; read from /sys when None; a CPU without
    topology information is a core of its own."""
    allowed = set(cpus)
    groups, seen = [], set()
    for c in sorted(allowed):
        if c in seen:
            continue
        if siblings is not None:
            sib = siblings.get(c, [c])
        else:
            try:
                with open(_TOPOLOGY.format(c)) as f:
                    sib = _parse_list(f.read())
            except (OSError, ValueError):
                sib = [c]
        group = sorted(s for s in set(sib) | {c} if s in allowed)
        seen.update(group)
        groups.append(group)
    return groups


def slice_for(local_rank: int, local_world: int, cores: List[List[int]]) -> List[int]:
    """The CPUs of process ``local_rank`` of ``local_world``: a contiguous share of ``cores`` (the
    first ``len(cores) % local_world`` processes get one core more). Every process gets at least
    one core; with fewer cores than processes, cores are shared round-robin."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"CPU affinity: local rank {local_rank} is not in [0, {local_world})")
    if not cores:
        raise ValueError("CPU affinity: no CPUs to split")
    if len(cores) < local_world:
        return list(cores[local_rank % len(cores)])
    per, extra = divmod(len(cores), local_world)
    start = local_rank * per + min(local_rank, extra)
    n = per + (1 if local_rank < extra else 0)
    return [c for core in cores[start:start + n] for c in core]


def apply(local_rank: int, local_world: int, cpu_count: Optional[int] = None) -> Optional[List[int]]:
    """Restrict this process to its slice (see the module docstring). Returns the CPUs it kept, or
    None when nothing was changed. ``cpu_count``: the machine's CPUs (os.cpu_count() when None)."""
    mode = env.cpu_affinity()
    if mode == "off" or local_world < 2:
        return None
    if not hasattr(os, "sched_setaffinity"):
        if mode == "on":
            logger.warning("LS_FAIRSEQ_CPU_AFFINITY=1: this system cannot set CPU affinity; ignored")
        return None
    allowed = sorted(os.sched_getaffinity(0))
    total = cpu_count if cpu_count is not None else (os.cpu_count() or len(allowed))
    if mode == "auto":
        if len(allowed) < total:
            logger.info("CPU affinity: this process is already restricted to %d of the machine's %d CPUs; left as "
                        "it is (LS_FAIRSEQ_CPU_AFFINITY=1 splits them between the training processes anyway)",
                        len(allowed), total)
            return None
        if len(allowed) < AUTO_MIN_CPUS * local_world:
            logger.info("CPU affinity: %d CPUs for %d training processes, fewer than %d each; not split "
                        "(LS_FAIRSEQ_CPU_AFFINITY=1 splits them anyway)", len(allowed), local_world, AUTO_MIN_CPUS)
            return None
    cpus = slice_for(local_rank, local_world, physical_cores(allowed))
    os.sched_setaffinity(0, cpus)
    logger.info("CPU affinity: training process %d of %d on this machine keeps to CPUs %s "
                "(LS_FAIRSEQ_CPU_AFFINITY=0 turns this off)", local_rank, local_world, _ranges(cpus))
    return cpus


def _ranges(cpus: Sequence[int]) -> str:
    """[0, 1, 2, 3, 8, 10, 11] -> '0-3,8,10-11'"""
    runs = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)
