"""kernels/cpu_features.cpp: the features CPUID reports and the OS enabled agree with the flags
Linux shows in /proc/cpuinfo (which also hides a feature whose register state the OS leaves
off); AMX is only claimed where the kernel grants its tiles, never merely where CPUID says so."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest

from llmserve.kernels import cpu_features

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").exists(),
    reason="x86-64 Linux only (CPUID, xgetbv, /proc/cpuinfo)",
)
AMX = {"amx_tile", "amx_bf16", "amx_int8"}


def cpuinfo_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    pytest.skip("/proc/cpuinfo has no flags line")


def test_detection_agrees_with_proc_cpuinfo() -> None:
    if cpu_features.unavailable() is not None:
        pytest.skip(cpu_features.unavailable() or "")
    flags = cpuinfo_flags()
    found = cpu_features.features()
    assert found <= flags, f"claimed but not in /proc/cpuinfo: {sorted(found - flags)}"
    # Every feature Linux shows is usable, except AMX: a VM may show it with the tiles off.
    shown = (set(cpu_features.NAMES) & flags) - AMX
    assert shown <= found, f"in /proc/cpuinfo but not detected: {sorted(shown - found)}"
    xcr0 = cpu_features.xcr0()
    assert xcr0 & 0x6 == 0x6 or "avx2" not in found  # AVX claimed only with ymm state on
    assert xcr0 & 0xE0 == 0xE0 or "avx512f" not in found
    assert xcr0 & 0x60000 == 0x60000 or not AMX & found


def test_bfloat16_gemm_only_where_the_cpu_computes_it() -> None:
    dtypes = [str(d) for d in cpu_features.gemm_dtypes()]
    assert dtypes[0] == "torch.float32"
    native_bf16 = {"avx512_bf16", "amx_bf16"} & cpu_features.features()
    assert ("torch.bfloat16" in dtypes) == bool(native_bf16)
