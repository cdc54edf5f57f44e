"""LS_FAIRSEQ_CPU_AFFINITY: how the CPUs are split between the training processes of a machine."""

import os

import pytest

from ls_fairseq import env
from ls_fairseq.cli import affinity


def test_physical_cores_keep_hyperthread_siblings_together():
    siblings = {0: [0, 4], 4: [0, 4], 1: [1, 5], 5: [1, 5], 2: [2, 6], 6: [2, 6], 3: [3, 7], 7: [3, 7]}
    assert affinity.physical_cores(range(8), siblings) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # a sibling outside the allowed set is left out; a CPU without topology is a core of its own
    assert affinity.physical_cores([0, 1, 5, 9], siblings) == [[0], [1, 5], [9]]


def test_slices_are_disjoint_and_cover_every_core():
    cores = [[0, 4], [1, 5], [2, 6], [3, 7], [8], [9], [10]]
    for world in (2, 3, 4, 7):
        parts = [affinity.slice_for(r, world, cores) for r in range(world)]
        flat = [c for p in parts for c in p]
        assert sorted(flat) == sorted(c for core in cores for c in core) and len(flat) == len(set(flat))
        sizes = [sum(1 for core in cores if core[0] in p) for p in parts]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert affinity.slice_for(0, 2, cores) == [0, 4, 1, 5, 2, 6, 3, 7]
    # more processes than cores: shared round-robin, nobody gets nothing
    assert [affinity.slice_for(r, 3, [[0], [1]]) for r in range(3)] == [[0], [1], [0]]
    with pytest.raises(ValueError, match="local rank 2"):
        affinity.slice_for(2, 2, cores)


def test_setting_values(monkeypatch):
    monkeypatch.delenv("LS_FAIRSEQ_CPU_AFFINITY", raising=False)
    assert env.cpu_affinity() == "auto"
    for value, want in (("auto", "auto"), ("1", "on"), ("true", "on"), ("0", "off"), ("no", "off")):
        monkeypatch.setenv("LS_FAIRSEQ_CPU_AFFINITY", value)
        assert env.cpu_affinity() == want
    monkeypatch.setenv("LS_FAIRSEQ_CPU_AFFINITY", "maybe")
    with pytest.raises(ValueError, match="expected auto, 0 or 1"):
        env.cpu_affinity()


def test_apply_only_when_shared_and_wanted(monkeypatch):
    calls = []
    monkeypatch.setattr(affinity, "_TOPOLOGY", "/nonexistent/cpu{}")  # every CPU a core of its own
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: calls.append(sorted(cpus)), raising=False)
    monkeypatch.setenv("LS_FAIRSEQ_CPU_AFFINITY", "1")
    assert affinity.apply(0, 1, cpu_count=16) is None  # alone on the machine: nothing to split
    monkeypatch.setenv("LS_FAIRSEQ_CPU_AFFINITY", "0")
    assert affinity.apply(0, 2, cpu_count=16) is None
    assert calls == []
    # auto: the whole machine, 8 CPUs each
    monkeypatch.delenv("LS_FAIRSEQ_CPU_AFFINITY")
    assert affinity.apply(1, 2, cpu_count=16) == list(range(8, 16)) and calls == [list(range(8, 16))]
    # auto leaves a process that someone already restricted alone, and a machine too small to split
    assert affinity.apply(1, 2, cpu_count=32) is None
    assert affinity.apply(1, 8, cpu_count=16) is None
    assert len(calls) == 1
    # 1 splits in both cases
    monkeypatch.setenv("LS_FAIRSEQ_CPU_AFFINITY", "1")
    assert affinity.apply(1, 2, cpu_count=32) == list(range(8, 16))
    assert affinity.apply(7, 8, cpu_count=16) == [14, 15]
    assert len(calls) == 3


def test_ranges_text():
    assert affinity._ranges([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"
    assert affinity._ranges([5]) == "5"


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs CPU affinity and two CPUs")
def test_apply_restricts_this_process(monkeypatch):
    before = os.sched_getaffinity(0)
    monkeypatch.setenv("LS_FAIRSEQ_CPU_AFFINITY", "1")
    try:
        kept = affinity.apply(1, 2)
        assert kept and set(kept) == os.sched_getaffinity(0) and set(kept) < before
    finally:
        os.sched_setaffinity(0, before)
