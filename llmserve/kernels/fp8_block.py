"""FP8 block-scaled linear on the GPU: y = x @ W^T with W held as float8 e4m3 [N, K] and a
float32 scale per (output channel, `group` weights along K) (DeepSeek-V3 / Qwen3 FP8's
`weight_scale_inv` per 128 x 128 block, repeated per row; per-channel and per-tensor scales fit
too). kernels/quant_reference.py's `fp8_block_linear_reference` is the ground truth;
engine/model/checkpoint_linear_cuda.py serves checkpoints through it on CUDA.

Paths (`path="auto"`):
- up to GEMV_MAX_ROWS rows of x (decode): fp8_block_gemm.cu's GEMV, weight-only (x stays
  fp16 / bf16; each weight byte read once, converted and scaled in registers), on sm_80 and up;
- more rows, on sm_90 (Hopper) with 128 x 128 block scales and N, K multiples of 128:
  `torch._scaled_mm` with DeepSeek's recipe (x quantized to e4m3 per token-group of 128 here,
  scale_a [M, K / 128] column-major, scale_b the blocks' [K / 128, N / 128]; M padded to a
  multiple of 4 for cuBLASLt), the path PyTorch implements for sm_90 only (its
  `_check_deepseek_support`; vLLM's BlockWiseTorchFP8ScaledMMLinearKernel gates it the same way);
- otherwise (sm_80 has no FP8 tensor cores; other block shapes): the GEMV once per 8 rows up to
  GEMV_SLICED_MAX_ROWS, then W dequantized into a transient fp16 / bf16 [N, K]
  (fp8_block_dequant_kernel), then torch.matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from llmserve.kernels.quant_reference import quantize_token_groups

K_MULTIPLE = 16
GROUP_MULTIPLE = 16
GEMV_MAX_ROWS = 8
# Off the scaled_mm path, up to this many rows the GEMV runs once per 8 rows (M / 8 bytes read
# per weight, against dequantize + cuBLAS's 5: 1 read, 2 written, 2 read again); above, dequantize.
GEMV_SLICED_MAX_ROWS = 32
GEMV_CONFIGS: dict[int, int] = {1: 2, 2: 2, 4: 4, 8: 4}
GEMV_WARPS = 4
DEQUANT_THREADS = 256
SCALED_MM_BLOCK = 128
PATHS = ("auto", "gemv", "dequant", "scaled_mm")


@dataclass(frozen=True)
class Fp8BlockWeight:
    """q uint8 [N, K] (e4m3 bits), scales float32 [N, ceil(K / group)]; block_scales float32
    [N / 128, K / 128] where the scales are 128 x 128 blocks and N, K are multiples of 128 (the
    scaled_mm path's form), else None."""

    q: torch.Tensor
    scales: torch.Tensor
    group: int
    block_scales: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales))

    def to(self, device: torch.device) -> Fp8BlockWeight:
        blocks = None if self.block_scales is None else self.block_scales.to(device)
        return Fp8BlockWeight(self.q.to(device), self.scales.to(device), self.group, blocks)


def fp8_block_spec(ctype: str) -> ModuleSpec:
    exprs = [f"fp8_block_gemv_kernel<{ctype}, {m}, {r}>" for m, r in GEMV_CONFIGS.items()]
    return ModuleSpec("fp8_block_gemm.cu", (*exprs, f"fp8_block_dequant_kernel<{ctype}>"))


def module_specs() -> list[ModuleSpec]:
    return [fp8_block_spec(ctype) for ctype in _CTYPES.values()]


def unsupported(k: int, group: int) -> str | None:
    """Why the kernels cannot hold a [N, K] weight in groups of `group` (None: they can)."""
    return launch.grouped_weight_unsupported(k, group, K_MULTIPLE, GROUP_MULTIPLE)


def pack_fp8_block(q: torch.Tensor, scale: torch.Tensor, group: int) -> Fp8BlockWeight:
    """q float8_e4m3fn [N, K] with scale [N, ceil(K / group)] (W = q * scale) -> the kernels'
    form, block_scales found where the rows' scales repeat in 128-row blocks."""
    n, k = q.shape
    why = unsupported(k, group)
    if (
        why is not None
        or q.dtype != torch.float8_e4m3fn
        or tuple(scale.shape) != (n, -(-k // group))
    ):
        why = why or "q must be e4m3 and scale [N, ceil(K / group)]"
        shapes = f"q {q.dtype} [{n}, {k}], scale {list(scale.shape)}"
        raise ValueError(f"pack_fp8_block: {shapes}: {why}")
    scale = scale.float().contiguous()
    blocks = None
    b = SCALED_MM_BLOCK
    if group == b and n % b == 0 and k % b == 0:
        rows = scale.reshape(n // b, b, k // b)
        if bool((rows == rows[:, :1]).all()):
            blocks = rows[:, 0].contiguous()
    stored = q.view(torch.uint8).contiguous()
    if stored.data_ptr() % 16:  # a view into a checkpoint's buffer: the kernel loads 16 bytes
        stored = stored.clone()
    return Fp8BlockWeight(stored, scale, group, blocks)


def scaled_mm_unsupported(weight: Fp8BlockWeight, device: torch.device) -> str | None:
    """Why torch._scaled_mm's blockwise path cannot serve `weight` on `device` (None: it can)."""
    if device.type != "cuda":
        return f"torch._scaled_mm's blockwise scaling needs a CUDA device, not {device}"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        arch = f"sm_{cap[0]}{cap[1]}"
        return f"torch._scaled_mm's 1x128 x 128x128 blockwise path is sm_90 only, not {arch}"
    if weight.block_scales is None:
        return "the weight's scales are not 128 x 128 blocks over N and K multiples of 128"
    return None


def _check_fp8_args(op: str, x: torch.Tensor, weight: Fp8BlockWeight) -> tuple[int, int, int]:
    _check(op, "x", x, ndim=2, dtypes=tuple(_CTYPES))
    _check_rows16(op, "x", x)
    num_rows, k = x.shape
    if k == 0 or k % K_MULTIPLE:
        _fail(op, f"x.shape[1]={k} (K) must be a positive multiple of {K_MULTIPLE}")
    _check(op, "q", weight.q, ndim=2, dtypes=(torch.uint8,), device=x.device, shape=(None, k))
    _check_contiguous(op, "q", weight.q)
    _check_rows16(op, "q", weight.q)
    if weight.group <= 0 or weight.group % GROUP_MULTIPLE:
        _fail(op, f"group={weight.group} must be a positive multiple of {GROUP_MULTIPLE}")
    n, groups = weight.q.shape[0], -(-k // weight.group)
    shape = (n, groups)
    _check(
        op, "scales", weight.scales, ndim=2, dtypes=(torch.float32,), device=x.device, shape=shape
    )
    _check_contiguous(op, "scales", weight.scales)
    return num_rows, n, k


def fp8_block_dequantize(weight: Fp8BlockWeight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` (fp16 / bf16)."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.q.device)
    if n == 0:
        return out
    args = (_ptr(weight.q), _ptr(weight.scales), _ptr(out), _i32(n), _i32(k), _i32(weight.group))
    spec = fp8_block_spec(_CTYPES[dtype])
    blocks = -(-n * k // 16 // DEQUANT_THREADS)
    launch._launch(spec, spec.name_expressions[-1], (blocks,), (DEQUANT_THREADS,), args, 0,
                   out.device)  # fmt: skip
    return out


def scaled_mm_linear(x: torch.Tensor, weight: Fp8BlockWeight) -> torch.Tensor:
    """torch._scaled_mm with DeepSeek's recipe: x quantized per token-group of 128 (rows padded
    to a multiple of 4), the weight's 128 x 128 block scales; [M, N] in x's dtype."""
    assert weight.block_scales is not None
    num_rows = x.shape[0]
    pad = -num_rows % 4
    xq, xs = quantize_token_groups(torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x)
    out = torch._scaled_mm(
        xq,
        weight.q.view(torch.float8_e4m3fn).t(),
        scale_a=xs.t().contiguous().t(),  # [M, K / 128], column-major
        scale_b=weight.block_scales.t(),  # [K / 128, N / 128]
        out_dtype=x.dtype,
    )
    return out[:num_rows]


def _launch_gemv(x: torch.Tensor, weight: Fp8BlockWeight, out: torch.Tensor) -> None:
    """fp8_block_gemv_kernel over up to GEMV_MAX_ROWS rows of x."""
    num_rows, k = x.shape
    n = out.shape[1]
    args = (
        _ptr(x), _i64(x.stride(0)), _ptr(weight.q), _ptr(weight.scales), _ptr(out),
        _i64(out.stride(0)), _i32(num_rows), _i32(n), _i32(k), _i32(weight.group),
    )  # fmt: skip
    m = min(r for r in GEMV_CONFIGS if r >= num_rows)
    expr = f"fp8_block_gemv_kernel<{_CTYPES[x.dtype]}, {m}, {GEMV_CONFIGS[m]}>"
    grid = (-(-n // (GEMV_WARPS * GEMV_CONFIGS[m])),)
    launch._launch(fp8_block_spec(_CTYPES[x.dtype]), expr, grid, (32 * GEMV_WARPS,), args, 0,
                   x.device)  # fmt: skip


def fp8_block_linear(
    x: torch.Tensor, weight: Fp8BlockWeight, *, out: torch.Tensor | None = None, path: str = "auto"
) -> torch.Tensor:
    """fp8_block_linear_reference on the GPU: [M, N] in x's dtype (the module's docstring lists
    the paths; "scaled_mm" quantizes x per token-group of 128, the others keep it; "gemv" runs
    once per GEMV_MAX_ROWS rows)."""
    op = "fp8_block_linear"
    num_rows, n, _ = _check_fp8_args(op, x, weight)
    if path not in PATHS:
        _fail(op, f"path={path!r} must be one of {PATHS}")
    if path == "scaled_mm" and (why := scaled_mm_unsupported(weight, x.device)) is not None:
        _fail(op, why)
    out = _output(op, out, (num_rows, n), x)
    if num_rows == 0 or n == 0:
        return out
    if path == "auto":
        path = auto_path(num_rows, weight, x.device)
    if path == "scaled_mm":
        return out.copy_(scaled_mm_linear(x, weight))
    if path == "dequant":
        return out.copy_(x @ fp8_block_dequantize(weight, x.dtype).t())
    for start in range(0, num_rows, GEMV_MAX_ROWS):
        end = start + GEMV_MAX_ROWS
        _launch_gemv(x[start:end], weight, out[start:end])
    return out


def auto_path(num_rows: int, weight: Fp8BlockWeight, device: torch.device) -> str:
    """The GEMV up to 8 rows; above, torch._scaled_mm where it takes the layout, else the GEMV
    once per 8 rows up to GEMV_SLICED_MAX_ROWS, else dequantize + cuBLAS."""
    if num_rows <= GEMV_MAX_ROWS:
        return "gemv"
    if scaled_mm_unsupported(weight, device) is None:
        return "scaled_mm"
    return "gemv" if num_rows <= GEMV_SLICED_MAX_ROWS else "dequant"
