"""Quantized checkpoints served as stored on a GPU: `keep_checkpoint_weights_cuda` swaps, before
the load, every Linear whose checkpoint tensors engine/model/kept_weights.py holds as int4
(W4A16: GPTQ, AWQ, compressed-tensors pack-quantized), int8 (W8A16: GPTQ 8-bit,
compressed-tensors int-quantized) or float8 e4m3 (FP8: DeepSeek-V3 / Qwen3 block-scaled,
compressed-tensors float-quantized) for a `CudaCheckpointLinear` over kernels/w4a16_gemm.cu
(BITS 4 or 8) or kernels/fp8_block_gemm.cu, so the load never widens them to fp16 / bf16. MoE
experts: engine/model/kept_experts.py builds its per-expert linears from CudaCheckpointLinear.

Left dequantized at load, as before: weights whose K or group the kernels do not take
(kernels/w4a16.py, fp8_block.py: `unsupported`), tensor-parallel shards; and every linear where
the kernels cannot run here (no CuPy, an sm < 80 GPU, a float32 model, a failed self-check):
`gpu_kernels_problem` says why, and the engine's start line (`kept_description`) repeats it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from llmserve.common.log import get_logger
from llmserve.engine.model.checkpoint_formats import CheckpointView
from llmserve.engine.model.checkpoint_linear import _linear_tensors, _merged, column_runs
from llmserve.engine.model.kept_experts import KeptExperts, keep_expert_weights
from llmserve.engine.model.kept_weights import KeptWeight
from llmserve.engine.model.layers import Linear
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.kernels import fp8_block, w4a16
from llmserve.kernels import quant_reference as qref
from llmserve.kernels.cpu_wq import fp4_values

log = get_logger(__name__)

KINDS = {
    "int4": "kernels/w4a16_gemm.cu",
    "int8": "kernels/w4a16_gemm.cu",
    "fp8": "kernels/fp8_block_gemm.cu",
}
INT_BITS = {"int4": 4, "int8": 8}
# set on a model by keep_checkpoint_weights_cuda where its kept weights were dequantized instead
NOT_KEPT_ATTR = "gpu_checkpoint_kernels_why"

GpuWeight = w4a16.W4A16Weight | fp8_block.Fp8BlockWeight


def _pack(weight: KeptWeight) -> GpuWeight:
    if weight.kind in INT_BITS:
        bits = INT_BITS[weight.kind]
        return w4a16.pack_w4a16(
            weight.q, weight.scale, weight.zero, weight.group, weight.perm, bits
        )
    return fp8_block.pack_fp8_block(weight.q, weight.scale, weight.group)


def gpu_form(weight: KeptWeight) -> KeptWeight:
    """The kept form the GPU kernels take: MXFP4 (gpt-oss: e2m1 codes, an e8m0 scale per 32)
    becomes int8, exactly: twice an e2m1 value is an integer in [-12, 12] and half a power of two
    is a float32, so (2 v) * (s / 2) is the same weight. A byte a weight against MXFP4's 17 / 32
    (no e2m1 kernel: the W8A16 GEMV reads it, still half of bf16's bytes). Others: as given."""
    if weight.kind != "fp4":
        return weight
    levels = (fp4_values(weight.q) * 2).round().to(torch.int8)
    return KeptWeight("int8", levels, weight.scale.float() / 2, None, weight.group, weight.perm)


def fits(weight: KeptWeight) -> str | None:
    """Why the GPU kernels cannot hold `weight` (None: they can)."""
    if weight.kind not in KINDS:
        return f"{weight.kind} weights have no GPU kernel here"
    module = w4a16 if weight.kind in INT_BITS else fp8_block
    return module.unsupported(weight.q.shape[1], weight.group)


class CudaCheckpointLinear(nn.Module):
    """y = x W^T + b over a checkpoint's int4, int8 or FP8 weight as stored, W stacking `parts`
    in rows (fused q/k/v, gate/up). Parts that read x in one column order share one kernel call;
    GPTQ act-order parts with their own orders run one call each (x gathered into each order)."""

    def __init__(self, parts: list[KeptWeight], bias: torch.Tensor | None, device: torch.device):
        super().__init__()
        self.segments = [_pack(_merged(run)).to(device) for run in column_runs(parts)]
        self.kind = parts[0].kind
        self.in_features = parts[0].q.shape[1]
        self.bias = None if bias is None else bias.detach().to(device)

    @classmethod
    def of(cls, segment: GpuWeight, bias: torch.Tensor | None = None) -> CudaCheckpointLinear:
        """One weight already in the kernels' layout, on its device (bench/gpu/kept_decode.py
        builds random ones of a model's shapes)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.segments = [segment]
        if isinstance(segment, w4a16.W4A16Weight):
            layer.kind = f"int{segment.bits}"
        else:
            layer.kind = "fp8"
        layer.in_features = segment.shape[1]
        layer.bias = bias
        return layer

    @property
    def nbytes(self) -> int:
        return sum(segment.nbytes for segment in self.segments)

    def _one(self, rows: torch.Tensor, segment: GpuWeight) -> torch.Tensor:
        if isinstance(segment, w4a16.W4A16Weight):
            return w4a16.w4a16_linear(rows, segment)
        return fp8_block.fp8_block_linear(rows, segment)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        outs = [self._one(rows, segment) for segment in self.segments]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.view(*x.shape[:-1], -1)


@functools.cache
def gpu_kernels_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why checkpoint weights cannot be served as stored on `device` in `dtype` (None: they
    can): the kernels' availability, then a self-check of both kernels on all their paths
    against kernels/quant_reference.py (relative L2 error <= 1e-2 per row). Once per device and
    dtype; said in the log either way."""
    why = _problem(device, dtype)
    if why is None:
        log.info("checkpoint int4 / FP8 linears run kernels/w4a16_gemm.cu and fp8_block_gemm.cu, "
                 "self-check passed", device=str(device))  # fmt: skip
    else:
        log.warning("checkpoint weights dequantized at load", device=str(device), why=why)
    return why


def _problem(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda":
        return f"the checkpoint kernels run on CUDA devices, not {device.type}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"the GPU checkpoint kernels take float16 or bfloat16 activations, not {dtype}"
    import llmserve.kernels.cuda as kc

    if not kc.is_available():
        return "kernels.cuda.is_available() is False (needs CuPy and an sm_80+ GPU)"
    try:
        return self_check(device, dtype)
    except Exception as err:  # a kernel that fails to compile or launch on this card
        return f"self-check: {type(err).__name__}: {err}"


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.cpu().double() - want).norm(dim=1) / want.norm(dim=1)).max())


def self_check(device: torch.device, dtype: torch.dtype) -> str | None:
    """The kernels (int4, int8, FP8) at 1, 5, 12 and 80 rows (the GEMV, once and per 8 rows;
    the dequantized weight through cuBLAS, or torch._scaled_mm for FP8 on sm_90) on seeded data,
    against the references."""
    gen = torch.Generator().manual_seed(0)
    n, k, group = 128, 256, 128
    levels = torch.randint(0, 16, (n, k), generator=gen).int()
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 0.01
    zero = torch.randint(0, 16, (n, k // group), generator=gen).float()
    perm = torch.randperm(k, generator=gen)
    w4 = w4a16.pack_w4a16(levels, scale, zero, group, perm).to(device)
    levels8 = torch.randint(-128, 128, (n, k), generator=gen).int()
    w8 = w4a16.pack_w4a16(levels8, scale / 16, None, group, None, bits=8).to(device)
    fp8_scale = (torch.rand(n // 128, k // 128, generator=gen) * 1e-3 + 1e-4).repeat_interleave(
        128, dim=0
    )
    q8 = (torch.randn(n, k, generator=gen) * 100).to(torch.float8_e4m3fn)
    f8 = fp8_block.pack_fp8_block(q8, fp8_scale, group).to(device)
    scaled_mm = fp8_block.scaled_mm_unsupported(f8, device) is None
    for rows in (1, 5, 12, 80):
        x = torch.randn(rows, k, generator=gen).to(dtype)
        quantize_x = scaled_mm and rows > fp8_block.GEMV_MAX_ROWS
        checks = [
            ("w4a16_linear", w4a16.w4a16_linear(x.to(device), w4),
             qref.w4a16_linear_reference(x, levels, scale, zero, group, perm)),
            ("w8a16_linear", w4a16.w4a16_linear(x.to(device), w8),
             qref.w4a16_linear_reference(x, levels8, scale / 16, None, group)),
            ("fp8_block_linear", fp8_block.fp8_block_linear(x.to(device), f8),
             qref.fp8_block_linear_reference(x, q8, fp8_scale, group, quantize_x=quantize_x)),
        ]  # fmt: skip
        for op, got, want in checks:
            error = _relative_error(got, want)
            if not error <= 1e-2:
                return f"self-check: {op} on {rows} rows differs from the reference by {error:.3g}"
    return None


def keep_on_gpu(
    model: LlamaForCausalLM, weights: CheckpointView, device: torch.device, dtype: torch.dtype
) -> int:
    """build_model's step for a quantized checkpoint on a GPU: its int4 / int8 / FP8 linears kept as
    stored where the kernels pass their self-check, else the reason noted on the model for the
    start line (the weights are then dequantized at load, as before)."""
    if not weights.quantized:
        return 0
    if model.shard.tp.size != 1:
        setattr(model, NOT_KEPT_ATTR, "a tensor-parallel shard (the kept forms are whole weights)")
        return 0
    why = gpu_kernels_problem(device, dtype)
    if why is not None:
        setattr(model, NOT_KEPT_ATTR, why)
        return 0
    swapped = keep_checkpoint_weights_cuda(model, weights, device)
    return swapped + keep_experts_cuda(model, weights, device)


def cuda_expert_linear(
    parts: list[KeptWeight], bias: torch.Tensor | None, device: torch.device
) -> CudaCheckpointLinear | None:
    """kept_experts.py's linear on a GPU: the parts in the GPU kernels' forms (gpu_form), or
    None where a part's shape does not fit them (the experts then load dequantized)."""
    held = [gpu_form(part) for part in parts]
    if any(fits(part) is not None for part in held) or len({p.kind for p in held}) != 1:
        return None
    return CudaCheckpointLinear(held, bias, device)


def keep_experts_cuda(
    model: LlamaForCausalLM, weights: CheckpointView, device: torch.device
) -> int:
    """Before the load: each MoE experts module whose tensors are all kept forms becomes a
    KeptExperts of CudaCheckpointLinears on `device`; the number of expert linears. The caller
    has checked gpu_kernels_problem."""
    make = functools.partial(cuda_expert_linear, device=device)
    swapped = keep_expert_weights(model, weights, make)
    if swapped:
        log.info("MoE experts kept quantized", linears=swapped, device=str(device))
    return swapped


def keep_checkpoint_weights_cuda(
    model: LlamaForCausalLM, weights: CheckpointView, device: torch.device
) -> int:
    """Before the load: every Linear whose weight tensors `weights` holds as int4 or FP8, in a
    shape the kernels take, becomes a CudaCheckpointLinear on `device`; the number swapped. The
    caller has checked gpu_kernels_problem."""
    if not weights.quantized or model.shard.tp.size != 1:
        return 0
    names = _linear_tensors(model)
    swapped = 0
    for name, module in list(model.named_modules()):
        if not (isinstance(module, Linear) and id(module) in names):
            continue
        parts = [weights.kept(n) for n in names[id(module)]["weight"]]
        kept = [p for p in parts if p is not None and fits(p) is None]
        if len(kept) != len(parts) or len({p.kind for p in kept}) != 1:
            continue
        biases = [weights[n] for n in names[id(module)]["bias"]]
        bias = torch.cat(biases).to(module.weight.dtype) if biases else None
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, CudaCheckpointLinear(kept, bias, device))
        swapped += 1
    if swapped:
        log.info("checkpoint weights kept quantized", linears=swapped, device=str(device))
    return swapped


def gpu_kept_description(model: nn.Module) -> str:
    """For the start line: the linears served as stored on the GPU, or why none is."""
    kinds = [m.kind for m in model.modules() if isinstance(m, CudaCheckpointLinear)]
    if kinds:
        counts = ", ".join(f"{kinds.count(k)} {k} ({KINDS[k]})" for k in sorted(set(kinds)))
        experts = sum(m.num_linears for m in model.modules() if isinstance(m, KeptExperts))
        of_them = f", {experts} of them experts'" if experts else ""
        return f"{len(kinds)} linears kept quantized on the GPU: {counts}{of_them}"
    why = getattr(model, NOT_KEPT_ATTR, None)
    return f"0 linears kept quantized on the GPU ({why})" if why else ""
