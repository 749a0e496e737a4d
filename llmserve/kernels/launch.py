"""Compilation, caching and launching of kernels/*.cu, and the argument checks every wrapper
shares (kernels/attention.py, kernels/layer_ops.py, kernels/int8.py; kernels/cuda.py re-exports
them all).

Sources are compiled at run time by CuPy (NVRTC) and launched on torch tensors' memory, on
torch's current stream, without copies. Compiled modules are cached per configuration (source
file, template instances) and device; CuPy also caches the binaries on disk
(~/.cupy/kernel_cache), keyed by the source text, which is why common.cu is inlined into each
source here rather than #included through a path.

`_launch`, `_require_cuda` and `_num_sms` are looked up on this module at call time: the CPU
emulator (tests/kernel_emu) replaces them. Importing this module needs neither CuPy nor a GPU;
`is_available()` says whether the kernels can run.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch

KERNEL_DIR = Path(__file__).resolve().parent
# No --use_fast_math: exp2f / expf / rsqrtf / division keep their accurate forms.
NVRTC_OPTIONS: tuple[str, ...] = ("-std=c++17",)
DEFAULT_SMEM_LIMIT = 48 * 1024  # above this a kernel must opt in to more dynamic shared memory

_CTYPES = {torch.float16: "f16_t", torch.bfloat16: "bf16_t"}
FP8_CTYPE = "fp8e4m3_t"  # common.cu's type for a torch.float8_e4m3fn pool
_INDEX_CTYPES = {torch.int32: "int", torch.int64: "long long"}


@dataclass(frozen=True)
class ModuleSpec:
    """One compiled unit: a .cu file and the template instances taken from it."""

    filename: str
    name_expressions: tuple[str, ...]


def load_source(filename: str) -> str:
    """The text of kernels/<filename> with `#include "common.cu"` replaced by that file."""
    text = (KERNEL_DIR / filename).read_text()
    common = (KERNEL_DIR / "common.cu").read_text()
    return text.replace('#include "common.cu"', common, 1)


def is_available() -> bool:
    """True when CuPy imports and torch sees a CUDA device of compute capability 8.0 or newer."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability() >= (8, 0)


# ---------------------------------------------------------------------------------------------
# Compilation, caching and launching


@cache
def _module(spec: ModuleSpec, device_index: int) -> Any:
    import cupy  # type: ignore[import-not-found, unused-ignore]

    with cupy.cuda.Device(device_index):
        return cupy.RawModule(
            code=load_source(spec.filename),
            options=NVRTC_OPTIONS,
            name_expressions=list(spec.name_expressions),
        )


@cache
def _kernel(spec: ModuleSpec, expr: str, device_index: int) -> Any:
    """Called inside `cupy.cuda.Device(device_index)`."""
    kernel = _module(spec, device_index).get_function(expr)
    kernel.max_dynamic_shared_size_bytes = DEFAULT_SMEM_LIMIT
    return kernel


class _TorchStream:
    """A raw stream handle with the CUDA stream protocol (`__cuda_stream__` -> (version 0,
    handle)), which CuPy 14's `Stream.from_external` takes in place of a pointer."""

    def __init__(self, stream_ptr: int):
        self.stream_ptr = stream_ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.stream_ptr)


@lru_cache(maxsize=64)
def _external_stream(stream_ptr: int, device_index: int) -> Any:
    import cupy

    # CuPy 14 deprecates ExternalStream(ptr, device) for Stream.from_external(obj), obj being
    # anything with the CUDA stream protocol; older CuPy has only the former.
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(stream_ptr, device_index)
    return from_external(_TorchStream(stream_ptr))


def _launch(
    spec: ModuleSpec,
    expr: str,
    grid: tuple[int, ...],
    block: tuple[int, ...],
    args: tuple[Any, ...],
    smem: int,
    device: torch.device,
) -> None:
    """Launch `expr` of `spec` on torch's current stream of `device`. The one place that touches
    CuPy's launch API (the CPU emulation used while writing these kernels replaces it)."""
    import cupy

    stream = _external_stream(torch.cuda.current_stream(device).cuda_stream, device.index)
    with cupy.cuda.Device(device.index):
        kernel = _kernel(spec, expr, device.index)
        if smem > kernel.max_dynamic_shared_size_bytes:
            kernel.max_dynamic_shared_size_bytes = smem
        kernel(grid, block, args, shared_mem=smem, stream=stream)


@lru_cache(maxsize=16)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _i32(value: int) -> np.int32:
    return np.int32(value)


def _i64(value: int) -> np.int64:
    return np.int64(value)


def _f32(value: float) -> np.float32:
    return np.float32(value)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


# ---------------------------------------------------------------------------------------------
# Argument checks (before anything is compiled or launched)


def _fail(op: str, message: str) -> None:
    raise ValueError(f"{op}: {message}")


def _require_cuda(op: str, name: str, t: torch.Tensor, device: torch.device | None) -> None:
    if t.device.type != "cuda":
        _fail(op, f"{name} is on {t.device}; the CUDA kernels need tensors on a CUDA device")
    if device is not None and t.device != device:
        _fail(op, f"{name} is on {t.device} but the other tensors are on {device}")


def _check(
    op: str,
    name: str,
    t: torch.Tensor,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    device: torch.device | None = None,
    shape: tuple[int | None, ...] | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(op, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        _fail(op, f"{name}.dtype={t.dtype} is not supported; expected {allowed}")
    _require_cuda(op, name, t, device)
    if shape is not None:
        for dim, (got, want) in enumerate(zip(t.shape, shape, strict=True)):
            if want is not None and got != want:
                _fail(op, f"{name}.shape[{dim}]={got} must be {want} (shape {tuple(t.shape)})")


def grouped_weight_unsupported(
    k: int, group: int, k_multiple: int, group_multiple: int
) -> str | None:
    """Why a grouped-scale weight kernel (w4a16.py, fp8_block.py) cannot hold a [N, K] weight in
    groups of `group`, given the multiples its chunks need (None: it can)."""
    if k % k_multiple:
        return f"K={k} is not a multiple of {k_multiple}"
    if group % group_multiple:
        return f"group {group} is not a multiple of {group_multiple}"
    return None


def _check_rows16(op: str, name: str, t: torch.Tensor) -> None:
    """Last dim contiguous, every row start 16-byte aligned (the kernels move 16-byte vectors)."""
    if t.numel() == 0:
        return
    if t.stride(-1) != 1:
        _fail(op, f"{name} needs a contiguous last dimension, got strides {t.stride()}")
    elem = t.element_size()
    for dim in range(t.dim() - 1):
        if t.shape[dim] > 1 and (t.stride(dim) * elem) % 16:
            _fail(op, f"{name}.stride({dim})={t.stride(dim)} must be a multiple of {16 // elem}")
    if t.data_ptr() % 16:
        _fail(op, f"{name} must start on a 16-byte boundary (data_ptr % 16 = {t.data_ptr() % 16})")


def _check_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous, got shape {tuple(t.shape)} strides {t.stride()}")


def _output(
    op: str, out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    _check(op, "out", out, ndim=len(shape), dtypes=(like.dtype,), device=like.device, shape=shape)
    _check_rows16(op, "out", out)
    return out
