"""Quantized linear layers, made from a loaded Linear's weights (they replace it, as PackedLinear
does), and `quantize_linears`, which swaps them into a model. Both keep the float bias and
return the input's dtype; docs/quantization.md has the formats and figures.

- `Int8Linear` (--quantization int8), weight-only. On a CPU: a scale and an offset per 32 weights
  (GGUF's Q8_0 / Q4_0 / Q4_1 exactly) and kernels/cpu_int8.cpp; torch's `_weight_int8pack_mm` ran
  3-8x slower than packed float32 here, and fbgemm's dynamic int8 kept 54% of SmolLM2's top-1.
  On a GPU: a scale per output channel and kernels/int8_gemm.cu, checked against
  kernels/reference.py when the first layer is built (no silent fallback).
- `Fp8Linear` (--quantization fp8): W8A8 float8 e4m3 through `torch._scaled_mm` (Hopper, sm_89+).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from llmserve.common.log import get_logger
from llmserve.kernels import cpu as cpu_kernels
from llmserve.kernels import int8 as gpu_int8
from llmserve.kernels import reference

FP8_MAX = 448.0  # largest finite float8 e4m3fn


def per_channel_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], float32 scales [N]) with weight ~= q * scale[:, None]."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def int8_group(k: int) -> int:
    """Weights per scale along K on the CPU: 32, as GGUF's Q8_0 blocks, where K allows."""
    return 32 if k % 32 == 0 else k


def grouped_int8(
    weight: torch.Tensor, group: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 q [N, K], float32 scale and offset [N, K / group]): weight ~= q * scale + offset,
    one scale and offset per `group` weights along K.

    symmetric: offset 0, |q| <= 127; a Q8_0 GGUF tensor, dequantized, comes back as exactly its
    own blocks. Otherwise the group's [min, max] spans all 256 levels, which holds a Q4_0 or Q4_1
    block (16 evenly spaced values) exactly: level i lands on q = 17 i - 128."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    if symmetric:
        scale = (w.abs().amax(dim=2, keepdim=True) / 127.0).clamp(min=1e-12)
        offset = torch.zeros_like(scale)
        q = (w / scale).round().clamp(-127, 127)
    else:
        low, high = w.amin(dim=2, keepdim=True), w.amax(dim=2, keepdim=True)
        scale = ((high - low) / 255.0).clamp(min=1e-12)
        offset = low + 128.0 * scale
        q = ((w - low) / scale).round().clamp(0, 255) - 128.0
    return q.to(torch.int8).view(n, k), scale.view(n, -1), offset.view(n, -1)


def _closest_cpu_form(
    weight: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The symmetric or the asymmetric form, whichever is closer to `weight` (the symmetric on a
    tie). The asymmetric one is made first: where it holds the weight to float32 rounding (a
    dequantized Q4_0 / Q4_1 tensor, most of a 4-bit GGUF) the other cannot be closer by more
    than rounding, and is not made (half the work of an int8 load)."""
    asymmetric = grouped_int8(weight, group, False)
    asymmetric_error = _error(weight, *asymmetric)
    if asymmetric_error <= float(weight.abs().max()) * 2.0**-20:
        return asymmetric
    symmetric = grouped_int8(weight, group, True)
    return symmetric if _error(weight, *symmetric) <= asymmetric_error else asymmetric


def _error(
    weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
) -> float:
    n, k = q.shape
    approx = q.view(n, scale.shape[1], -1).float() * scale[..., None] + offset[..., None]
    return float((approx.view(n, k) - weight.float()).abs().max())


class Int8Linear(nn.Module):
    """Weight-only int8. CPU: scales per 32 weights along K, kernels/cpu_int8.cpp (or its torch
    twin where it cannot build); GPU: per-channel scales, kernels/int8_gemm.cu (K a multiple of
    16, fp16 / bf16; a ValueError at build time otherwise, or when its self-check fails)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.bias = None if bias is None else bias.detach().clone()
        self.on_cpu = weight.device.type == "cpu"
        self.group = int8_group(weight.shape[1]) if self.on_cpu else weight.shape[1]
        if self.on_cpu:  # whichever form holds this weight more closely (exactly: Q8_0, Q4_x)
            self.qweight, scale, self.offset = _closest_cpu_form(weight, self.group)
        else:  # the GPU kernel has no offsets
            _require_gpu_int8(weight)
            self.qweight, scale, self.offset = grouped_int8(weight, self.group, True)
            self.qweight = gpu_int8.pack_weight(self.qweight)
        self.scale = scale if self.on_cpu else scale.view(-1).contiguous()
        self.symmetric = bool((self.offset == 0).all())
        self.packed: cpu_kernels.PackedInt8 | None = None
        if self.on_cpu:
            self.bias = None if bias is None else self.bias.float()
            if not cpu_kernel_missing():  # the kernel's layout replaces the plain one
                self.packed = cpu_kernels.pack_int8(
                    self.qweight, self.scale, self.offset, self.group
                )
                del self.qweight, self.scale, self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.packed is not None:
            out = cpu_kernels.int8_linear(rows.float(), self.packed, self.bias)
        elif self.on_cpu:
            out = cpu_kernels.int8_linear_reference(
                rows.float(), self.qweight, self.scale, self.offset, self.group, self.bias
            )
        else:
            out = gpu_int8.int8_linear(rows.contiguous(), self.qweight, self.scale)
            if self.bias is not None:
                out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], -1)


class Fp8Linear(nn.Module):
    """W8A8 float8 e4m3. On a GPU through `torch._scaled_mm`. On a CPU the same arithmetic (the
    e4m3 weight and activation values, the same scales) through a float32 GEMM over the weight
    widened once: torch's CPU `_scaled_mm` took 57 ms for a 1 x 576 x 1536 product that the
    float32 GEMM does in 0.2 ms (2-core AVX2 VM), and the outputs agree to within the last bit of
    bfloat16 (tests/engine/model/test_quantization.py: test_fp8_cpu_path_is_scaled_mm)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        q, scale = per_channel_fp8(weight)
        self.on_cpu = weight.device.type == "cpu"
        if self.on_cpu:  # e4m3 values times their scale, exact in float32
            self.widened = q.float() * scale[:, None]
        else:
            self.qweight_t = q.t()  # column-major [K, N], as _scaled_mm wants its second operand
            self.scale = scale[None, :]
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        x_scale = (rows.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
        xq = (rows / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out_dtype = torch.bfloat16 if x.dtype == torch.float32 else x.dtype
        if self.on_cpu:
            out = torch.nn.functional.linear(xq.float() * x_scale, self.widened).to(out_dtype)
        else:
            out = torch._scaled_mm(
                xq, self.qweight_t, scale_a=x_scale, scale_b=self.scale, out_dtype=out_dtype
            )
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], -1)


@functools.cache
def cpu_kernel_missing() -> bool:
    """Whether kernels/cpu_int8.cpp cannot run here (built on first use; said once, in the log)."""
    why = cpu_kernels.unavailable()
    if why is not None:
        get_logger("engine").warning("int8 linears run in plain torch (slow)", why=why)
    return why is not None


def _require_gpu_int8(weight: torch.Tensor) -> None:
    """Raise ValueError unless kernels/int8_gemm.cu can serve this weight on its GPU."""
    n, k = weight.shape
    if k % gpu_int8.K_MULTIPLE:
        raise ValueError(
            f"--quantization int8 on {weight.device}: a linear layer of shape [{n}, {k}] has "
            f"K={k}; kernels/int8_gemm.cu needs a multiple of {gpu_int8.K_MULTIPLE}"
        )
    why = gpu_int8_self_check(weight.device, weight.dtype)
    if why is not None:
        raise ValueError(f"--quantization int8 on {weight.device}: {why}")


@functools.cache
def gpu_int8_self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """Run kernels/int8_gemm.cu on both its paths (1 and 5 rows: the GEMV; 80: the GEMM) beside
    kernels/reference.py on seeded data; why it cannot serve (None: it agrees, to a relative L2
    error of 1e-2 per row). Once per device and dtype; said in the log either way."""
    why = _gpu_int8_problem(device, dtype)
    log = get_logger("engine")
    if why is None:
        log.info("int8 linears run kernels/int8_gemm.cu, self-check passed", device=str(device))
    else:
        log.error("int8 linears cannot run kernels/int8_gemm.cu", device=str(device), why=why)
    return why


def _gpu_int8_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype not in (torch.float16, torch.bfloat16):
        return f"kernels/int8_gemm.cu takes float16 or bfloat16 activations, not {dtype}"
    gen = torch.Generator().manual_seed(0)
    try:
        q, scales = reference.quantize_int8_per_channel(torch.randn(72, 256, generator=gen))
        packed = gpu_int8.pack_weight(q).to(device)
        for rows in (1, 5, 80):
            x = torch.randn(rows, 256, generator=gen).to(dtype)
            got = gpu_int8.int8_linear(x.to(device), packed, scales.to(device)).cpu().double()
            want = reference.int8_linear(x.double(), q, scales.double())
            error = float(((got - want).norm(dim=1) / want.norm(dim=1)).max())
            if not error <= 1e-2:
                return (
                    f"self-check: int8_linear on {rows} rows differs from "
                    f"kernels/reference.py by {error:.3g}"
                )
    except Exception as err:  # a kernel that fails to compile or launch on this card
        return f"self-check: {type(err).__name__}: {err}"
    return None


QUANTIZED_LINEARS: dict[str, type[nn.Module]] = {"int8": Int8Linear, "fp8": Fp8Linear}


def quantization_limits(method: str, device: torch.device) -> str | None:
    """Why `method` cannot run on `device` (None when it can)."""
    if method == "int8" and device.type == "cuda":
        import llmserve.kernels.cuda as kc

        if not kc.is_available():
            return (
                "--quantization int8 on a GPU runs kernels/int8_gemm.cu, and "
                "kernels.cuda.is_available() is False (needs CuPy and an sm_80+ GPU)"
            )
    if method == "fp8" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            return f"--quantization fp8 needs an sm_89+ GPU (Ada, Hopper), not sm_{major}{minor}"
    return None
