"""Builds our CPU torch extensions (kernels/cpu_*.cpp) at first use with torch's C++ extension
builder (g++ and ninja), cached under ~/.cache/llmserve/cpu_kernels/<key>
(LLMSERVE_KERNEL_CACHE moves it); the key hashes the sources' text, the flags, the torch install
and Python, so checkouts of the same sources share one build and an edited source gets its own."""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "llmserve"
    return Path(root) / "cpu_kernels"


def build_dir(sources: list[Path], cflags: tuple[str, ...]) -> Path:
    """Where `sources` are built. They are built from copies inside it, because torch's build
    names a source by its absolute path."""
    key = hashlib.sha256()
    for source in sources:
        key.update(source.name.encode() + b"\0" + source.read_bytes())
    # torch's headers are named by path in the compile command: one build per torch install,
    # or two virtualenvs would rebuild over each other
    key.update(" ".join((*cflags, torch.__file__, sys.version, platform.machine())).encode())
    return cache_dir() / key.hexdigest()[:16]


def load_extension(name: str, sources: list[Path], cflags: tuple[str, ...]) -> Any:
    """The operators `sources` register as torch.ops.<name> (TORCH_LIBRARY(name, m): the first
    source is compiled; the others are the headers it includes, copied beside it), building the
    library if its directory has no build yet. Operator libraries, not Python modules: they
    need no pybind11 and compile 4x faster than through torch/extension.h."""
    from torch.utils.cpp_extension import load

    build = build_dir(sources, cflags)
    build.mkdir(parents=True, exist_ok=True)
    # torch's builder waits, without end, while a file named `lock` exists in the directory:
    # one left by a process killed mid-build stops every later start. Builds here are serialized
    # by an flock instead (the kernel releases it when its holder dies), so whoever holds it may
    # remove a `lock` file: no live builder can own one.
    with open(build / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        for source in sources:
            if not (build / source.name).exists():
                shutil.copyfile(source, build / source.name)
        load(
            name=name,
            is_python_module=False,  # loaded with torch.ops.load_library
            sources=[str(build / sources[0].name)],
            # OpenMP for at::parallel_for; the libgomp.so.1 it binds to is torch's, already loaded.
            extra_cflags=list(cflags),
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            verbose=False,
        )
    return getattr(torch.ops, name)


def why_unavailable(what: str, load: Callable[[], Any]) -> str | None:
    """Why a CPU kernel (`what`, built by `load`) cannot run here, None when it can: no AVX2,
    or the build failed (no compiler, no ninja, a compile error)."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU has no AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    try:
        load()
    except Exception as err:
        return f"the {what} did not build: {type(err).__name__}: {str(err)[:300]}"
    return None
