"""``LS_FAIRSEQ_CPU_AFFINITY=1``: each training process of one machine keeps to its own CPU cores.

With one micro-batch per update, a GPU's training process is often limited by its host thread
(the Python that launches the kernels), and on the 2-GPU machines we measured the host time of a
micro-batch grew when a second training process ran beside it, with or without communication
between them (benchmarks/RESULTS.md). This option splits the CPUs the process may use into as many
disjoint slices as there are training processes on the machine, whole physical cores together
(hyperthread siblings are kept in one slice, from /sys topology where the system shows it), and
restricts the main thread of process ``local_rank`` to its slice when lightseq-train's training
function starts. The threads and processes started afterwards (the autograd and pin-memory threads,
the data-loader workers) inherit the slice; those the process group's set-up started before (NCCL's)
keep the whole machine.
"""

import logging
import os
from typing import Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

_TOPOLOGY = "/sys/devices/system/cpu/cpu{}/topology/thread_siblings_list"


def requested() -> bool:
    value = os.environ.get("LS_FAIRSEQ_CPU_AFFINITY", "0").strip().lower()
    if value not in ("", "0", "1", "false", "true", "no", "yes"):
        raise ValueError(f"LS_FAIRSEQ_CPU_AFFINITY={value!r}: expected 0 or 1")
    return value in ("1", "true", "yes")


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


def apply(local_rank: int, local_world: int) -> Optional[List[int]]:
    """Restrict this process to its slice (see the module docstring) when
    ``LS_FAIRSEQ_CPU_AFFINITY=1`` and more than one training process shares the machine. Returns
    the CPUs it kept, or None when nothing was changed."""
    if not requested() or local_world < 2:
        return None
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("LS_FAIRSEQ_CPU_AFFINITY=1: this system cannot set CPU affinity; ignored")
        return None
    cpus = slice_for(local_rank, local_world, physical_cores(sorted(os.sched_getaffinity(0))))
    os.sched_setaffinity(0, cpus)
    logger.info("LS_FAIRSEQ_CPU_AFFINITY=1: training process %d of %d on this machine keeps to CPUs %s",
                local_rank, local_world, ",".join(map(str, cpus)))
    return cpus
