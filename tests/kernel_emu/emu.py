"""Run the CUDA kernels of kernels/*.cu on the CPU, through kernels/cuda.py's real wrappers.

A test tool, not a serving path. `build()` compiles the real .cu sources with g++ against
emu_common.h (which stands in for kernels/common.cu and the CUDA runtime: CTAs run one after
another, each thread a fiber; barriers, shuffles, ldmatrix, mma.sync and cp.async are emulated)
into a shared library, cached outside the repository by a hash of everything that goes into it.
`Emulator.installed()` then points kernels.cuda's launch hook at that library, so the wrappers'
argument checks, launch shapes and kernel arguments are the ones the GPU gets, on CPU tensors.

    emulator = Emulator(build(), copies="late", schedule="low-first")
    with emulator.installed():
        kernels.cuda.paged_decode_attention(q, k_cache, v_cache, ...)  # CPU tensors

What it does not model (see emu_common.h): timing, bank conflicts, register limits, races beyond the
cp.async / barrier orderings it enforces, out-of-bounds global accesses (they crash the process),
and kernels/common.cu's inline PTX (replaced, so its bugs are out of reach). Needs g++ (C++17) and
glibc's ucontext (Linux). Slow (every warp collective is a fiber switch per lane): the cases of
tests/kernels/test_kernels_emulated.py, a few CTAs each, take up to about half a second.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve.kernels import cuda as kc
from llmserve.kernels import launch as kl

HEADER = Path(__file__).resolve().parent / "emu_common.h"
CXX_FLAGS = ("-O1", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC")
# The one form of dynamic shared memory declaration the emulator rewrites.
SHARED_DECL = "extern __shared__ __align__(16) unsigned char smem_raw[];"
# Limits of an sm_80 launch (the oldest architecture the kernels support).
MAX_DYNAMIC_SMEM = 163 * 1024
MAX_THREADS = 1024
KEEP_BUILDS = 8  # newest libraries kept in the cache directory

_COPIES = {"late": 1, "early": 0}  # emu::kLateCopies
_SCHEDULES = {"round-robin": 0, "low-first": 2, "high-first": 2 | 4}  # kGreedy, kHighFirst
_THUNK = (
    'extern "C" int emu_launch_{index}(const unsigned* dims, size_t smem, void** params, '
    "const char* codes, int nargs, int flags) {{\n"
    "  return emu_launch(&{expr}, dims, smem, params, codes, nargs, flags);\n}}\n"
)


class EmulatorError(RuntimeError):
    """The emulator could not build, or a launch failed (deadlock, divergent warp collective,
    misaligned or out-of-range shared address, argument kinds that do not match the kernel)."""


def kernel_exprs() -> list[str]:
    """Every template instance kernels/cuda.py can launch, in a fixed order."""
    return [e for spec in kc.all_module_specs() for e in spec.name_expressions]


def translation_unit() -> str:
    """emu_common.h, then each .cu file the wrappers use (with `#include "common.cu"` dropped and
    the dynamic shared memory declaration rewritten, line numbers kept), then one extern "C"
    launch thunk per template instance."""
    parts = [f'#line 1 "{HEADER}"\n{HEADER.read_text()}']
    for filename in dict.fromkeys(spec.filename for spec in kc.all_module_specs()):
        text = (kc.KERNEL_DIR / filename).read_text()
        if "extern __shared__" in text.replace(SHARED_DECL, ""):
            raise EmulatorError(
                f"{filename}: the emulator only understands dynamic shared memory declared as "
                f"`{SHARED_DECL}`"
            )
        text = text.replace('#include "common.cu"', "")
        text = text.replace(SHARED_DECL, "unsigned char* smem_raw = emu::dyn_smem();")
        parts.append(f'#line 1 "{kc.KERNEL_DIR / filename}"\n{text}')
    parts.append('extern "C" const char* emu_last_error() { return emu::g_error; }\n')
    parts += [_THUNK.format(index=i, expr=expr) for i, expr in enumerate(kernel_exprs())]
    return "\n".join(parts)


def default_cache_dir() -> Path:
    """$LLMSERVE_EMU_CACHE, else $XDG_CACHE_HOME/llmserve-emu (~/.cache/llmserve-emu)."""
    if os.environ.get("LLMSERVE_EMU_CACHE"):
        return Path(os.environ["LLMSERVE_EMU_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmserve-emu"


def build(cache_dir: Path | None = None, cxx: str = "g++") -> Path:
    """The emulator library for the current sources, compiled unless the cache has it.

    The file name is a hash of the translation unit, the compiler and its flags, so an edited
    kernel gets a new build; the KEEP_BUILDS newest builds are kept. When the cache directory
    cannot be created, a directory under the system temp dir is used instead.
    """
    source = translation_unit()
    key = "\n".join([source, cxx, *CXX_FLAGS, platform.machine()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    cache_dir = cache_dir or default_cache_dir()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError:
        cache_dir = Path(tempfile.gettempdir()) / f"llmserve-emu-{os.getuid()}"
        cache_dir.mkdir(parents=True, exist_ok=True)
    library = cache_dir / f"emu_{digest}.so"
    if library.exists():
        return library
    # Written under this process's own names, then renamed (atomic): concurrent builds of the
    # same hash never see each other's partial files. The .cpp stays for reading g++'s errors.
    cpp = cache_dir / f"emu_{digest}.cpp"
    partial_cpp = cache_dir / f"emu_{digest}.{os.getpid()}.cpp.tmp"
    partial_so = cache_dir / f"emu_{digest}.{os.getpid()}.so.tmp"
    partial_cpp.write_text(source)
    os.replace(partial_cpp, cpp)
    cmd = [cxx, *CXX_FLAGS, "-o", str(partial_so), str(cpp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        partial_so.unlink(missing_ok=True)
        raise EmulatorError(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")
    os.replace(partial_so, library)
    _prune(cache_dir)
    return library


def _prune(cache_dir: Path) -> None:
    """Best effort: another process may be pruning or building at the same time."""
    try:
        builds = sorted(cache_dir.glob("emu_*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
        for old in builds[KEEP_BUILDS:]:
            old.unlink(missing_ok=True)
            old.with_suffix(".cpp").unlink(missing_ok=True)
    except OSError:
        pass


@dataclass(frozen=True)
class Launch:
    """One kernel launch as kernels/cuda.py asked for it (grid and block padded to 3-D)."""

    expr: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int


def _kernel_arg(value: Any) -> tuple[str, Any]:
    """(kind code of emu_common.h's ArgCode, ctypes holder) for one CuPy-style argument."""
    if isinstance(value, np.uint64):
        return "Q", ctypes.c_uint64(int(value))
    if isinstance(value, np.int64):
        return "q", ctypes.c_int64(int(value))
    if isinstance(value, np.int32):
        return "i", ctypes.c_int32(int(value))
    if isinstance(value, np.float32):
        return "f", ctypes.c_float(float(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return "q", ctypes.c_int64(value)  # what CuPy makes of a Python int
    raise EmulatorError(f"kernel argument {value!r} of type {type(value).__name__} is unsupported")


def _pad3(dims: tuple[int, ...]) -> tuple[int, int, int]:
    x, y, z = (*dims, 1, 1)[:3]
    return int(x), int(y), int(z)


def _require_cpu(op: str, name: str, t: torch.Tensor, device: torch.device | None) -> None:
    """Stands in for kernels.launch._require_cuda: the emulated kernels read host memory."""
    if t.device.type != "cpu":
        kc._fail(op, f"{name} is on {t.device}; the emulator runs the kernels on CPU tensors")
    if device is not None and t.device != device:
        kc._fail(op, f"{name} is on {t.device} but the other tensors are on {device}")


class Emulator:
    """Launches kernels/cuda.py's kernels in the library from `build()`.

    copies: "late" lands each cp.async at the wait_group that retires it (a missing wait reads
    poisoned or stale shared memory); "early" at issue (a stage refilled without a __syncthreads
    is overwritten while other warps still read it). schedule: "low-first" / "high-first" let
    the lowest / highest runnable thread run until it blocks, after every completed barrier, so
    those warps run far ahead; "round-robin" keeps the threads in near lockstep.
    """

    def __init__(
        self,
        library: Path,
        *,
        copies: str = "late",
        schedule: str = "low-first",
        num_sms: int = 132,
    ) -> None:
        if copies not in _COPIES or schedule not in _SCHEDULES:
            raise ValueError(
                f"copies={copies!r} must be one of {tuple(_COPIES)} and schedule={schedule!r} "
                f"one of {tuple(_SCHEDULES)}"
            )
        self._lib = ctypes.CDLL(str(library))
        self._lib.emu_last_error.restype = ctypes.c_char_p
        self._thunks = {expr: f"emu_launch_{i}" for i, expr in enumerate(kernel_exprs())}
        self.copies = copies
        self.schedule = schedule
        self.num_sms = num_sms  # what kernels.cuda's split-K heuristic sees (132: H100 / H200)
        self.launches: list[Launch] = []

    def launch(
        self,
        spec: kc.ModuleSpec,
        expr: str,
        grid: tuple[int, ...],
        block: tuple[int, ...],
        args: tuple[Any, ...],
        smem: int,
        device: torch.device,
    ) -> None:
        """kernels.launch._launch's contract, run on the CPU before returning."""
        if expr not in spec.name_expressions or expr not in self._thunks:
            raise EmulatorError(f"{expr} is not an instance of {spec.filename} the library has")
        grid3, block3 = _pad3(grid), _pad3(block)
        threads = block3[0] * block3[1] * block3[2]
        if not 0 < threads <= MAX_THREADS:
            raise EmulatorError(f"{expr}: block {block} has {threads} threads, limit 1024")
        if not (grid3[0] < 2**31 and grid3[1] <= 65535 and grid3[2] <= 65535):
            raise EmulatorError(f"{expr}: grid {grid} exceeds (2^31 - 1, 65535, 65535)")
        if smem > MAX_DYNAMIC_SMEM:
            raise EmulatorError(
                f"{expr}: {smem} bytes of dynamic shared memory, limit {MAX_DYNAMIC_SMEM}"
            )
        self.launches.append(Launch(expr, grid3, block3, smem))
        if min(grid3) == 0:
            return
        codes, holders = zip(*(_kernel_arg(a) for a in args), strict=True)
        params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        dims = (ctypes.c_uint * 6)(*grid3, *block3)
        flags = _COPIES[self.copies] | _SCHEDULES[self.schedule]
        thunk = getattr(self._lib, self._thunks[expr])
        rc = thunk(
            dims, ctypes.c_size_t(smem), params, "".join(codes).encode(), len(holders), flags
        )
        if rc != 0:
            reason = self._lib.emu_last_error().decode()
            raise EmulatorError(f"{expr} grid {grid3} block {block3}: {reason}")

    @contextmanager
    def installed(self) -> Iterator[Emulator]:
        """Within the block, kernels.cuda launches here and accepts CPU tensors; restored after.
        (The hooks live in kernels/launch.py, where every wrapper looks them up at call time.)"""
        hooks: dict[str, Any] = {
            "_launch": self.launch,
            "_require_cuda": _require_cpu,
            "_num_sms": lambda device: self.num_sms,
        }
        saved = {name: getattr(kl, name) for name in hooks}
        for name, value in hooks.items():
            setattr(kl, name, value)
        try:
            yield self
        finally:
            for name, value in saved.items():
                setattr(kl, name, value)


@contextmanager
def installed_or_skip() -> Iterator[Emulator]:
    """The emulator of kernels/*.cu installed into kernels.launch for the with-block; the test
    skips, naming why, where it cannot be built (not Linux, no g++)."""
    import shutil
    import sys

    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip(f"the kernel emulator needs glibc's ucontext (Linux), not {sys.platform}")
    if shutil.which("g++") is None:
        pytest.skip("g++ is not on PATH: the kernel emulator compiles kernels/*.cu with it")
    emulator = Emulator(build())
    with emulator.installed():
        yield emulator
