"""W4A16 and W8A16 linear on the GPU (w4a16_gemm.cu): y = x @ W^T with W held as 4- or 8-bit
integers plus a float32 scale and zero point per `group` weights along K (GPTQ 4 / 8-bit, AWQ,
compressed-tensors pack-quantized and int-quantized: engine/model/kept_weights.py's kept forms
"int4" and "int8"), x and y fp16 / bf16, float32 sums. The 8-bit weight runs the same kernels
(template parameter BITS), reading one byte per weight where the 4-bit one reads half.
kernels/quant_reference.py's `w4a16_linear_reference` is the ground truth; engine/model/
checkpoint_linear_cuda.py serves checkpoints through it on CUDA.

`pack_w4a16` lays the weight out once, at load: 8 (4-bit) or 4 (8-bit) levels a 32-bit word
along K, unsigned, with
the scales and the offsets (-zero * scale) the kernels fold into one fma per weight; act-order's
column permutation stays in the weight's order and x is gathered into it per call.

Rows of x up to GEMV_MAX_ROWS (decode) run the GEMV once: it reads each weight byte once and
dequantizes in registers. Up to GEMV_SLICED_MAX_ROWS (larger decode batches) it runs once per 8
rows, reading the weight's half byte per weight again each time: at 64 rows 4 bytes per weight
(8-bit: a byte each time, so up to 32 rows: 4 bytes). More rows (prefill) dequantize the weight into
a transient fp16 / bf16 [N, K] (wqa16_dequant_kernel: 0.5 bytes read (8-bit: 1), 2 written) and
multiply with cuBLAS (torch.matmul, 2 more read): 4.5 bytes per weight once per call, which a
prefill of a few hundred rows hides, and cuBLAS's tensor-core GEMM is the fastest kernel at hand
where the product is compute-bound. A fused tiled W4 GEMM (Marlin-style), which would read 0.5 bytes
at any row count, is not written (not run on a GPU: no figure says where it would pay).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.kernels import launch
from llmserve.kernels.cpu_wq import stored_values
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

K_MULTIPLE = 32  # one 16-byte weight chunk
GROUP_MULTIPLE = 32  # a chunk lies in one group
GEMV_MAX_ROWS = 8
# Up to this many rows the GEMV runs once per 8 rows (M / 8 x 0.5 bytes read per weight, against
# dequantize + cuBLAS's 4.5: the module's docstring); above, dequantize + cuBLAS.
GEMV_SLICED_MAX_ROWS = 64
SLICED_MAX_ROWS = {4: GEMV_SLICED_MAX_ROWS, 8: 32}  # 8-bit: a byte a weight each slice
GEMV_CONFIGS: dict[int, int] = {1: 2, 2: 2, 4: 4, 8: 4}  # rows of x (M) -> channels per warp (R)
GEMV_WARPS = 4
BITS = (4, 8)
DEQUANT_THREADS = 256
PATHS = ("auto", "gemv", "dequant")


@dataclass(frozen=True)
class W4A16Weight:
    """The kernels' layout: qweight int32 [N, K / P], P = 32 / bits levels a word (word j:
    k = Pj .. Pj + P - 1, field i = k Pj + i, levels 0 .. 2^bits - 1), scales and offsets float32
    [N, ceil(K / group)] (W = level * scale + offset), perm int64 [K] or None (column j of the
    weight reads x[:, perm[j]]); bits 4 (W4A16) or 8 (W8A16)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    group: int
    perm: torch.Tensor | None = None
    bits: int = 4

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * self.per_word

    @property
    def nbytes(self) -> int:
        held = [self.qweight, self.scales, self.offsets]
        return sum(t.numel() * t.element_size() for t in held)

    def to(self, device: torch.device) -> W4A16Weight:
        perm = None if self.perm is None else self.perm.to(device)
        qweight, scales, offsets = (t.to(device) for t in (self.qweight, self.scales, self.offsets))
        return W4A16Weight(qweight, scales, offsets, self.group, perm, self.bits)


def gemv_expr(ctype: str, bits: int, m: int) -> str:
    return f"wqa16_gemv_kernel<{ctype}, {bits}, {m}, {GEMV_CONFIGS[m]}>"


def dequant_expr(ctype: str, bits: int) -> str:
    return f"wqa16_dequant_kernel<{ctype}, {bits}>"


def w4a16_spec(ctype: str) -> ModuleSpec:
    """Both widths' instances in one module a dtype."""
    exprs = [gemv_expr(ctype, bits, m) for bits in BITS for m in GEMV_CONFIGS]
    return ModuleSpec("w4a16_gemm.cu", (*exprs, *(dequant_expr(ctype, bits) for bits in BITS)))


def module_specs() -> list[ModuleSpec]:
    return [w4a16_spec(ctype) for ctype in _CTYPES.values()]


def unsupported(k: int, group: int) -> str | None:
    """Why the kernels cannot hold a [N, K] weight in groups of `group` (None: they can)."""
    return launch.grouped_weight_unsupported(k, group, K_MULTIPLE, GROUP_MULTIPLE)


def pack_w4a16(
    q: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    group: int,
    perm: torch.Tensor | None = None,
    bits: int = 4,
) -> W4A16Weight:
    """q [N, K] integer levels with scale and zero [N, ceil(K / group)] (W = (q - zero) * scale;
    zero None: 0) -> the kernels' layout, on q's device. bits 4: levels [0, 15], or [-8, 7]
    shifted here by 8 with the zero point; bits 8: [0, 255] or [-128, 127] (shifted by 128)."""
    n, k = q.shape
    why = unsupported(k, group) or (None if bits in BITS else f"bits={bits} is not 4 or 8")
    if why is not None or tuple(scale.shape) != (n, -(-k // group)):
        raise ValueError(f"pack_w4a16: q [{n}, {k}], scale {list(scale.shape)}, group {group}: "
                         f"{why or 'scale must be [N, ceil(K / group)]'}")  # fmt: skip
    levels, zero = stored_values(f"int{bits}", q, zero, scale)
    if bits == 8:  # stored_values' signed int8 range, made unsigned for the kernels
        zero = (torch.zeros(scale.shape) if zero is None else zero.float()) + 128
        levels = levels.to(torch.int64) + 128
    scale = scale.float()
    offsets = torch.zeros_like(scale) if zero is None else -zero.float().to(scale.device) * scale
    per_word = 32 // bits
    shifts = bits * torch.arange(per_word, device=q.device)
    fields = levels.to(torch.int64).reshape(n, k // per_word, per_word) << shifts
    words = fields.sum(dim=2)  # < 2^32: the fields never overlap
    qweight = (words - (words >= 2**31).long() * 2**32).to(torch.int32)
    perm = None if perm is None else perm.long()
    return W4A16Weight(
        qweight.contiguous(), scale.contiguous(), offsets.contiguous(), group, perm, bits
    )


def unpack_levels(weight: W4A16Weight) -> torch.Tensor:
    """The inverse of pack_w4a16's packing: int32 levels [N, K] (0 .. 2^bits - 1)."""
    words = weight.qweight.long() & 0xFFFFFFFF
    shifts = weight.bits * torch.arange(weight.per_word, device=words.device)
    mask = (1 << weight.bits) - 1
    return ((words[:, :, None] >> shifts) & mask).flatten(1).to(torch.int32)


def _check_w4_args(op: str, x: torch.Tensor, weight: W4A16Weight) -> tuple[int, int, int]:
    _check(op, "x", x, ndim=2, dtypes=tuple(_CTYPES))
    _check_rows16(op, "x", x)
    num_rows, k = x.shape
    if k == 0 or k % K_MULTIPLE:
        _fail(op, f"x.shape[1]={k} (K) must be a positive multiple of {K_MULTIPLE}")
    qw = weight.qweight
    if weight.bits not in BITS:
        _fail(op, f"bits={weight.bits} must be one of {BITS}")
    shape = (None, k // weight.per_word)
    _check(op, "qweight", qw, ndim=2, dtypes=(torch.int32,), device=x.device, shape=shape)
    _check_contiguous(op, "qweight", qw)
    _check_rows16(op, "qweight", qw)
    n, groups = qw.shape[0], -(-k // weight.group)
    if weight.group <= 0 or weight.group % GROUP_MULTIPLE:
        _fail(op, f"group={weight.group} must be a positive multiple of {GROUP_MULTIPLE}")
    for name in ("scales", "offsets"):
        t = getattr(weight, name)
        _check(op, name, t, ndim=2, dtypes=(torch.float32,), device=x.device, shape=(n, groups))
        _check_contiguous(op, name, t)
    if weight.perm is not None:
        _check(op, "perm", weight.perm, ndim=1, dtypes=(torch.int64,), device=x.device, shape=(k,))
    return num_rows, n, k


def w4a16_dequantize(weight: W4A16Weight, dtype: torch.dtype) -> torch.Tensor:
    """W [N, K] in `dtype` (fp16 / bf16), in the weight's (gathered) column order."""
    n, k = weight.shape
    out = torch.empty((n, k), dtype=dtype, device=weight.qweight.device)
    if n == 0:
        return out
    args = (
        _ptr(weight.qweight), _ptr(weight.scales), _ptr(weight.offsets), _ptr(out),
        _i32(n), _i32(k), _i32(weight.group),
    )  # fmt: skip
    spec = w4a16_spec(_CTYPES[dtype])
    blocks = -(-n * k // weight.per_word // DEQUANT_THREADS)
    expr = dequant_expr(_CTYPES[dtype], weight.bits)
    launch._launch(spec, expr, (blocks,), (DEQUANT_THREADS,), args, 0, out.device)
    return out


def _launch_gemv(x: torch.Tensor, weight: W4A16Weight, out: torch.Tensor) -> None:
    """wqa16_gemv_kernel over up to GEMV_MAX_ROWS rows of x."""
    num_rows, k = x.shape
    n = out.shape[1]
    args = (
        _ptr(x), _i64(x.stride(0)), _ptr(weight.qweight), _ptr(weight.scales),
        _ptr(weight.offsets), _ptr(out), _i64(out.stride(0)), _i32(num_rows), _i32(n), _i32(k),
        _i32(weight.group),
    )  # fmt: skip
    m = min(r for r in GEMV_CONFIGS if r >= num_rows)
    per_cta = GEMV_WARPS * GEMV_CONFIGS[m]
    expr = gemv_expr(_CTYPES[x.dtype], weight.bits, m)
    spec = w4a16_spec(_CTYPES[x.dtype])
    launch._launch(spec, expr, (-(-n // per_cta),), (32 * GEMV_WARPS,), args, 0, x.device)


def w4a16_linear(
    x: torch.Tensor, weight: W4A16Weight, *, out: torch.Tensor | None = None, path: str = "auto"
) -> torch.Tensor:
    """w4a16_linear_reference on the GPU: [M, N] in x's dtype.

    x: [M, K] fp16 / bf16, contiguous rows, 16-byte aligned; weight from pack_w4a16 on x's
    device. path: "auto" ("gemv" up to SLICED_MAX_ROWS[bits] rows, else "dequant"), "gemv" (the
    GEMV once per GEMV_MAX_ROWS rows: each slice reads the weight again) or "dequant" (W
    dequantized, then torch.matmul)."""
    op = "w4a16_linear"
    num_rows, n, _ = _check_w4_args(op, x, weight)
    if path not in PATHS:
        _fail(op, f"path={path!r} must be one of {PATHS}")
    out = _output(op, out, (num_rows, n), x)
    if num_rows == 0 or n == 0:
        return out
    if weight.perm is not None:
        x = x.index_select(1, weight.perm)
    if path == "auto":
        path = "gemv" if num_rows <= SLICED_MAX_ROWS[weight.bits] else "dequant"
    if path == "dequant":
        return out.copy_(x @ w4a16_dequantize(weight, x.dtype).t())
    for start in range(0, num_rows, GEMV_MAX_ROWS):
        end = start + GEMV_MAX_ROWS
        _launch_gemv(x[start:end], weight, out[start:end])
    return out
