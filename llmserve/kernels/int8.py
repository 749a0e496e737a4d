"""Weight-only int8 linear on the GPU (int8_gemm.cu): y = x @ W^T with W held as int8 plus one
float32 scale per output channel, x and y fp16 / bf16, float32 sums. kernels/reference.py's
`int8_linear` is the ground truth; engine/model/quant.py's Int8Linear serves `--quantization int8`
through it on CUDA.

The weight is packed once, at load (`pack_weight`): the plain int8 [N, K] with K's order permuted
inside every group of 16 (int8_gemm.cu's header says why), so K must be a multiple of 16.
Up to GEMV_MAX_ROWS rows of x (decode) run the bandwidth-bound GEMV, more rows the tensor-core
GEMM (64 x 128 tiles).
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.kernels import launch
from llmserve.kernels.launch import (
    _CTYPES,
    ModuleSpec,
    _check,
    _check_contiguous,
    _check_rows16,
    _fail,
    _i32,
    _i64,
    _output,
    _ptr,
)

K_MULTIPLE = 16  # the permutation's group, and 16-byte weight loads
GEMV_MAX_ROWS = 8
# int8_gemv_kernel instances: rows of x it serves (M) -> output channels per warp (R)
GEMV_CONFIGS: dict[int, int] = {1: 2, 2: 2, 4: 4, 8: 4}
GEMV_WARPS = 4
GEMM_TILE_M, GEMM_TILE_N, GEMM_TILE_K = 64, 128, 32
GEMM_THREADS = 128
# Split-K for the GEMM when its tiles cannot fill the GPU: aim at this many CTAs per SM, with at
# least GEMM_MIN_TILES_PER_SPLIT k tiles (of 32) per split and at most GEMM_MAX_SPLITS splits.
GEMM_CTAS_PER_SM = 2
GEMM_MIN_TILES_PER_SPLIT = 4
GEMM_MAX_SPLITS = 16
FINALIZE_THREADS = 256
# two stages of an x tile [64][32 + 8] T and a weight tile [128][32 + 16] bytes
GEMM_SMEM_BYTES = 2 * (GEMM_TILE_M * 40 * 2 + GEMM_TILE_N * 48)
PATHS = ("auto", "gemv", "gemm")
# Stored byte p of a group of 16 holds k = _ORDER[p]: 0 1 8 9 | 2 3 10 11 | 4 5 12 13 | 6 7 14 15
_ORDER = tuple(2 * (p // 4) + (p % 2) + 8 * ((p % 4) // 2) for p in range(16))


def int8_gemm_spec(ctype: str) -> ModuleSpec:
    exprs = [f"int8_gemv_kernel<{ctype}, {m}, {r}>" for m, r in GEMV_CONFIGS.items()]
    gemm = (f"int8_gemm_kernel<{ctype}>", f"int8_gemm_finalize_kernel<{ctype}>")
    return ModuleSpec("int8_gemm.cu", (*exprs, *gemm))


def module_specs() -> list[ModuleSpec]:
    return [int8_gemm_spec(ctype) for ctype in _CTYPES.values()]


def pack_weight(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in plain order -> the kernels' layout (a new contiguous tensor, same device).
    K must be a multiple of 16."""
    n, k = qweight.shape
    if k % K_MULTIPLE:
        raise ValueError(f"pack_weight: K={k} must be a multiple of {K_MULTIPLE}")
    order = torch.tensor(_ORDER, device=qweight.device)
    return qweight.reshape(n, k // K_MULTIPLE, K_MULTIPLE)[:, :, order].reshape(n, k).contiguous()


def unpack_weight(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_weight."""
    n, k = packed.shape
    inverse = torch.argsort(torch.tensor(_ORDER, device=packed.device))
    return packed.reshape(n, k // K_MULTIPLE, K_MULTIPLE)[:, :, inverse].reshape(n, k).contiguous()


def gemm_num_splits(num_ctas: int, k: int, num_sms: int) -> int:
    """How many pieces the GEMM cuts K into: 1 when its `num_ctas` tiles fill GEMM_CTAS_PER_SM
    per SM, else enough to (at most GEMM_MAX_SPLITS, each with at least GEMM_MIN_TILES_PER_SPLIT
    k tiles), rounded so that no split is empty."""
    num_tiles = -(-k // GEMM_TILE_K)
    wanted = -(-GEMM_CTAS_PER_SM * num_sms // num_ctas)
    splits = min(wanted, num_tiles // GEMM_MIN_TILES_PER_SPLIT, GEMM_MAX_SPLITS)
    if splits <= 1:
        return 1
    per_split = -(-num_tiles // splits)
    return -(-num_tiles // per_split)


def gemv_rows(num_rows: int) -> int:
    """The GEMV instance (its M) that serves `num_rows` <= GEMV_MAX_ROWS rows of x."""
    return min(m for m in GEMV_CONFIGS if m >= num_rows)


def _check_int8_args(
    op: str, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor
) -> tuple[int, int, int]:
    """Returns (M, N, K)."""
    _check(op, "x", x, ndim=2, dtypes=tuple(_CTYPES))
    _check_rows16(op, "x", x)
    num_rows, k = x.shape
    if k == 0 or k % K_MULTIPLE:
        _fail(op, f"x.shape[1]={k} (K) must be a positive multiple of {K_MULTIPLE}")
    _check(op, "weight", weight, ndim=2, dtypes=(torch.int8,), device=x.device, shape=(None, k))
    _check_contiguous(op, "weight", weight)
    _check_rows16(op, "weight", weight)
    n = weight.shape[0]
    if n > 65535 * GEMM_TILE_N:  # the GEMM's grid.y
        _fail(op, f"weight.shape[0]={n} (N) must be at most {65535 * GEMM_TILE_N}")
    _check(op, "scales", scales, ndim=1, dtypes=(torch.float32,), device=x.device, shape=(n,))
    _check_contiguous(op, "scales", scales)
    return num_rows, n, k


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    path: str = "auto",
) -> torch.Tensor:
    """reference.int8_linear(x, unpack_weight(weight), scales) on the GPU: [M, N] in x's dtype.

    x: [M, K] fp16 / bf16, contiguous rows, 16-byte aligned; weight: int8 [N, K] from
    pack_weight, contiguous; scales: float32 [N]; K a multiple of 16. path: "auto" (the GEMV for
    M <= GEMV_MAX_ROWS, else the GEMM), "gemv" (M <= GEMV_MAX_ROWS) or "gemm" (any M)."""
    op = "int8_linear"
    num_rows, n, k = _check_int8_args(op, x, weight, scales)
    if path not in PATHS:
        _fail(op, f"path={path!r} must be one of {PATHS}")
    if path == "gemv" and num_rows > GEMV_MAX_ROWS:
        _fail(op, f"path='gemv' serves at most {GEMV_MAX_ROWS} rows of x, got {num_rows}")
    out = _output(op, out, (num_rows, n), x)
    if num_rows == 0 or n == 0:
        return out
    if path == "gemv" or (path == "auto" and num_rows <= GEMV_MAX_ROWS):
        args = (
            _ptr(x), _i64(x.stride(0)), _ptr(weight), _ptr(scales),
            _ptr(out), _i64(out.stride(0)), _i32(num_rows), _i32(n), _i32(k),
        )  # fmt: skip
        m = gemv_rows(num_rows)
        per_cta = GEMV_WARPS * GEMV_CONFIGS[m]
        expr = f"int8_gemv_kernel<{_CTYPES[x.dtype]}, {m}, {GEMV_CONFIGS[m]}>"
        spec = int8_gemm_spec(_CTYPES[x.dtype])
        launch._launch(spec, expr, (-(-n // per_cta),), (32 * GEMV_WARPS,), args, 0, x.device)
    else:
        _launch_gemm(x, weight, scales, out)
    return out


def _launch_gemm(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, out: torch.Tensor
) -> None:
    """int8_gemm_kernel, split over K when its tiles cannot fill the GPU (then into a float32
    workspace [splits, M, N] that int8_gemm_finalize_kernel sums in order and scales)."""
    (num_rows, k), n = x.shape, weight.shape[0]
    tiles = (-(-num_rows // GEMM_TILE_M), -(-n // GEMM_TILE_N))
    splits = gemm_num_splits(tiles[0] * tiles[1], k, launch._num_sms(x.device))
    partial = None
    if splits > 1:
        partial = torch.empty((splits, num_rows, n), dtype=torch.float32, device=x.device)
    args = (
        _ptr(x), _i64(x.stride(0)), _ptr(weight), _ptr(scales),
        _ptr(out), _i64(out.stride(0)), np.uint64(0) if partial is None else _ptr(partial),
        _i32(num_rows), _i32(n), _i32(k),
    )  # fmt: skip
    spec = int8_gemm_spec(_CTYPES[x.dtype])
    gemm, finalize = spec.name_expressions[-2:]
    grid = (*tiles, splits)
    launch._launch(spec, gemm, grid, (GEMM_THREADS,), args, GEMM_SMEM_BYTES, x.device)
    if partial is not None:
        args = (
            _ptr(partial), _ptr(scales), _ptr(out), _i64(out.stride(0)),
            _i32(splits), _i32(num_rows), _i32(n),
        )  # fmt: skip
        blocks = -(-num_rows * n // FINALIZE_THREADS)
        launch._launch(spec, finalize, (blocks,), (FINALIZE_THREADS,), args, 0, x.device)
