"""LS_FAIRSEQ_CPU_AFFINITY: how the CPUs are split between the training processes of a machine."""

import os

import pytest

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


def test_apply_only_when_asked_and_shared(monkeypatch):
    monkeypatch.delenv("LS_FAIRSEQ_CPU_AFFINITY", raising=False)
    assert affinity.apply(0, 2) is None
    monkeypatch.setenv("LS_FAIRSEQ_CPU_AFFINITY", "1")
    assert affinity.apply(0, 1) is None  # alone on the machine: nothing to split
    monkeypatch.setenv("LS_FAIRSEQ_CPU_AFFINITY", "maybe")
    with pytest.raises(ValueError, match="expected 0 or 1"):
        affinity.requested()


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
