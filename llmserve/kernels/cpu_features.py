"""The CPU's SIMD features that this process may use, detected at run time (kernels/
cpu_features.cpp: CPUID and the OS's enabled state, XCR0 and Linux's AMX permission), not
assumed from the build or from /proc/cpuinfo alone: a VM can report AMX in CPUID and leave the
tile state off, and AMX code would then die of an illegal instruction.

`features()` is the set of names (those of /proc/cpuinfo's flags) usable here; `gemm_dtypes()`
the dtypes a dense GEMM is worth trying in (engine/model/cpu_weights.py measures them at start).
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

import torch

from llmserve.kernels import cpu_build

SOURCE = Path(__file__).with_name("cpu_features.cpp")
CFLAGS = ("-O2",)  # no -mavx: the probe itself must run on any x86-64
# In cpu_features.cpp's order; the names /proc/cpuinfo gives them.
NAMES = (
    "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
    "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


@functools.cache
def _module() -> Any:
    return cpu_build.load_extension("llmserve_cpu_features", [SOURCE], CFLAGS)


@functools.cache
def _probe() -> tuple[frozenset[str], int]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return frozenset(), 0
    try:
        values = list(_module().cpu_features())
    except Exception:  # no compiler: say nothing is usable rather than guess
        return frozenset(), 0
    return frozenset(n for n, v in zip(NAMES, values, strict=False) if v), int(values[-1])


def features() -> frozenset[str]:
    """The features of NAMES that CPUID reports and the OS has enabled for this process."""
    return _probe()[0]


def xcr0() -> int:
    """The OS's XCR0 (the register state it saves), 0 where it could not be read."""
    return _probe()[1]


def gemm_dtypes() -> list[torch.dtype]:
    """The dtypes a dense oneDNN GEMM may run in here, float32 first: bfloat16 too where the CPU
    computes it natively (AVX-512 BF16 or AMX BF16; elsewhere oneDNN emulates it, 4-10x slower
    than float32 on this project's AMD EPYC VM)."""
    usable = features()
    return [torch.float32] + ([torch.bfloat16] if {"avx512_bf16", "amx_bf16"} & usable else [])


def describe() -> str:
    """The usable features, for a log line: `avx2 fma f16c` or `none detected`."""
    return " ".join(n for n in NAMES if n in features()) or "none detected"


def unavailable() -> str | None:
    """Why the probe cannot run here (None: it can; built on the first call)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    try:
        _module()
    except Exception as err:
        return f"the CPU feature probe did not build: {type(err).__name__}: {str(err)[:300]}"
    return None
