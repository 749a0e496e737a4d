"""engine/step/cpu_threads.py: the engine's OpenMP wait settings and thread count (no torch)."""

from __future__ import annotations

import os

import pytest

from llmserve.engine.step.cpu_threads import (
    WAIT_SETTINGS,
    configure_openmp,
    default_threads,
    usable_cores,
)


def test_openmp_waits_are_set_unless_the_operator_set_them() -> None:
    env: dict[str, str] = {}
    assert configure_openmp(env) == WAIT_SETTINGS == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == WAIT_SETTINGS
    for given in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(given)
        assert configure_openmp(env) == {}
        assert env == given  # theirs, untouched, and nothing added beside it


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux affinity masks")
def test_threads_follow_the_affinity_mask_or_omp_num_threads() -> None:
    assert usable_cores() == len(os.sched_getaffinity(0))
    assert default_threads({}) == usable_cores()
    assert default_threads({"OMP_NUM_THREADS": "3"}) == 3
    assert default_threads({"OMP_NUM_THREADS": "0"}) == usable_cores()  # not a count: ignored
