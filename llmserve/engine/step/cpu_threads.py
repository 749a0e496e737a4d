"""The CPU engine's OpenMP team (torch's intra-op threads): how many threads, and how they wait
between parallel regions.

libgomp reads its wait settings once, when torch loads it, so `configure_openmp` runs in the
engine process before anything imports torch (llmserve/services.py). By default libgomp's idle
threads spin for 300,000 rounds (milliseconds on this CPU) after each parallel region: between
two steps, while the engine waits for the scheduler's next plan, they spin on the cores the
scheduler and gateway need to make it. bench/studies/omp_wait.py measures the settings
(docs/quantization.md has the figures).

Not a torch import here: this module must load before torch does.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# What the engine sets where the operator set neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT.
WAIT_SETTINGS = {"OMP_WAIT_POLICY": "PASSIVE"}


def configure_openmp(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set WAIT_SETTINGS in env unless the operator set either variable (theirs win, untouched);
    returns what was set. Call before torch loads: libgomp reads them once, then."""
    if any(key in env for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
        return {}
    env.update(WAIT_SETTINGS)
    return dict(WAIT_SETTINGS)


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask (a container's cpuset, taskset),
    which os.cpu_count() and torch's own default (the host's physical cores) ignore."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def default_threads(env: MutableMapping[str, str] = os.environ) -> int:
    """The engine's torch threads when --num-threads is 0: OMP_NUM_THREADS where the operator
    set it, else every usable core."""
    given = env.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return usable_cores()


def set_torch_threads(num_threads: int, device: str) -> None:
    """torch's threads for an engine: num_threads (--num-threads) where given; else, on a CPU,
    default_threads() (torch's own default counts the host's physical cores, not the usable)."""
    import torch  # here: the module must not load torch (configure_openmp comes first)

    if num_threads:
        torch.set_num_threads(num_threads)
    elif device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        torch.set_num_threads(default_threads())
