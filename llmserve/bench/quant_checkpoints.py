"""Quantized checkpoints written by the tests from a float HF directory, in each format's own
documented layout, and the same model dequantized back to float32 (the reference a served
quantized model must match). Nothing is downloaded.

FP8 block-scaled (DeepSeek-V3 / Qwen3 FP8, transformers' FineGrainedFP8Config): every linear
weight [N, K] of the decoder layers is stored as float8_e4m3fn with a float32
`weight_scale_inv` [ceil(N / bn), ceil(K / bk)], w = q * scale_inv; embeddings, norms, routers
and the LM head stay float, and config.json gains
`quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [bn, bk]}`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

FP8_MAX = 448.0


def is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    """The decoder layers' projection weights (experts included); routers (Qwen2-MoE's shared
    expert gate too, a [1, H] router) stay float."""
    routers = ("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and "norm" not in name
        and not name.endswith(routers)
    )


def fp8_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn q [N, K], float32 scale_inv [ceil(N / bn), ceil(K / bk)]): each block's
    absolute maximum maps to 448, as DeepSeek's and llm-compressor's block quantizers do."""
    n, k = weight.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(rows * bn, cols * bk)
    padded[:n, :k] = weight.float()
    blocks = padded.view(rows, bn, cols, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(rows * bn, cols * bk)[:n, :k].contiguous(), scale


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = q.shape
    expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.float() * expanded[:n, :k]


def _copy_dir(source: Path, target: Path) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.is_file():
            shutil.copy(item, target / item.name)


def write_fp8_block(
    float_dir: Path, fp8_dir: Path, dequantized_dir: Path, block: tuple[int, int]
) -> None:
    """fp8_dir: float_dir's model in the FP8 block-scaled layout; dequantized_dir: that model's
    weights dequantized to float32, as a plain float checkpoint."""
    from safetensors.torch import load_file, save_file

    source = load_file(str(float_dir / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in source.items():
        if is_quantized_linear(name, tensor):
            q, scale = fp8_block(tensor, block)
            quantized[name] = q
            quantized[name.removesuffix("weight") + "weight_scale_inv"] = scale
            dequantized[name] = dequantize_block(q, scale, block)
        else:
            quantized[name] = tensor
            dequantized[name] = tensor.float()
    _copy_dir(float_dir, fp8_dir)
    _copy_dir(float_dir, dequantized_dir)
    save_file(quantized, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))


def edit_config(directory: Path, **fields: object) -> None:
    """Set (or, for a None value, remove) top-level config.json fields."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config, indent=2))


# ---- compressed-tensors, written by the compressed-tensors library itself --------------------


def _observe(weight: torch.Tensor, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The (min, max) an observer would hand compressed-tensors' calculate_qparams for `args`'
    strategy: the whole tensor, each output row, each group of a row, or each block."""
    if args.strategy == "tensor":
        return weight.amin().reshape(1), weight.amax().reshape(1)
    if args.strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    if args.strategy == "group":
        groups = weight.reshape(weight.shape[0], -1, args.group_size)
        return groups.amin(-1), groups.amax(-1)
    bn, bk = args.block_structure
    blocks = weight.reshape(weight.shape[0] // bn, bn, weight.shape[1] // bk, bk)
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


def write_compressed_tensors(
    float_dir: Path,
    ct_dir: Path,
    dequantized_dir: Path,
    weights: dict[str, Any],
    input_activations: dict[str, Any] | None = None,
    fmt: str | None = None,
) -> None:
    """ct_dir: float_dir's model quantized by compressed-tensors (apply_quantization_config, the
    qparams of each weight's min and max, ModelCompressor's compress and update_config, as
    llm-compressor saves); dequantized_dir: the library's own decompression of it, saved as a
    float32 checkpoint. Linear layers are targeted, lm_head ignored; static input scales get a
    fixed value (read and recorded by the loader, not emulated)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=QuantizationArgs(**input_activations) if input_activations else None,
    )
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            args = module.quantization_scheme.weights
            scale, zero_point = calculate_qparams(*_observe(module.weight.data, args), args)
            module.weight_scale.data = scale.to(module.weight_scale.dtype)
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data = zero_point.to(module.weight_zero_point.dtype)
            if hasattr(module, "input_scale"):
                module.input_scale.data = torch.full_like(module.input_scale, 0.05)
    compressor = ModelCompressor.from_pretrained_model(model, fmt)
    compressor.compress_model(model)
    model.save_pretrained(ct_dir)
    compressor.update_config(str(ct_dir))
    compressor.decompress_model(model)
    dequantized = {
        n: t.float().contiguous()
        for n, t in model.state_dict().items()
        if not n.endswith(("_scale", "_zero_point", "_shape", "_packed", "_g_idx"))
        and not (n == "lm_head.weight" and model.config.tie_word_embeddings)
    }
    _copy_dir(float_dir, dequantized_dir)
    from safetensors.torch import save_file

    save_file(dequantized, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})


# ---- GPTQ and AWQ, packed by their documented layouts ------------------------------------------


def int_groups(
    weight_t: torch.Tensor, bits: int, g_idx: torch.Tensor, num_groups: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unsigned q [K, N], zeros [G, N], float16 scales [G, N]) of w^T [K, N] with input row k in
    group g_idx[k], as GPTQ's and AWQ's quantizers make them: q = clamp(round(w / s) + z, 0,
    2^bits - 1), symmetric z = 2^(bits - 1)."""
    maxq = (1 << bits) - 1
    n = weight_t.shape[1]
    low = torch.zeros(num_groups, n)
    high = torch.zeros(num_groups, n)
    for g in range(num_groups):
        rows = weight_t[g_idx == g]
        low[g], high[g] = rows.amin(0).clamp(max=0), rows.amax(0).clamp(min=0)
    if symmetric:
        scale = torch.maximum(low.abs(), high) * 2 / maxq
        zeros = torch.full_like(scale, (maxq + 1) // 2)
    else:
        scale = (high - low) / maxq
        zeros = (-low / scale).round().clamp(1, maxq)  # >= 1: GPTQ v1 stores zero - 1
    scale = scale.clamp(min=1e-8).half()
    q = (weight_t / scale.float()[g_idx] + zeros[g_idx]).round().clamp(0, maxq)
    return q.to(torch.int64), zeros.to(torch.int64), scale


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R * bits / 32, C]: values [R, C] packed along R, row r in word r // (32 / bits) at
    bits (r % (32 / bits)) * bits (GPTQ's qweight), written with numpy."""
    import numpy as np

    per = 32 // bits
    v = values.numpy().astype(np.uint32)
    out = np.zeros((v.shape[0] // per, v.shape[1]), dtype=np.uint32)
    for j in range(per):
        out |= v[j::per] << np.uint32(bits * j)
    return torch.from_numpy(out.view(np.int32))


def dequantized_int(
    q: torch.Tensor, zeros: torch.Tensor, scale: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """float32 [N, K] = (q - z) * s, from the unpacked values (the test's reference)."""
    return ((q - zeros[g_idx]).float() * scale.float()[g_idx]).t().contiguous()


def write_gptq(
    float_dir: Path, gptq_dir: Path, dequantized_dir: Path, *, bits: int, group_size: int,
    desc_act: bool, symmetric: bool = True, version: str = "gptq",
) -> None:  # fmt: skip
    """gptq_dir: every quantized linear as GPTQ's qweight [K * bits / 32, N], qzeros [G, N *
    bits / 32] (zero - 1 for the original `gptq` format), float16 scales [G, N] and g_idx [K]
    (with desc_act, groups follow a seeded column order, as act-order's Hessian order does)."""
    generator = torch.Generator().manual_seed(bits * 100 + group_size)

    def convert(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        stem = name.removesuffix(".weight")
        k = tensor.shape[1]
        size = k if group_size == -1 else group_size
        order = torch.randperm(k, generator=generator) if desc_act else torch.arange(k)
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[order] = torch.arange(k) // size
        q, zeros, scale = int_groups(tensor.t().float(), bits, g_idx, -(-k // size), symmetric)
        stored_zeros = zeros - (1 if version == "gptq" else 0)
        tensors = {
            f"{stem}.qweight": pack_rows(q, bits),
            f"{stem}.qzeros": pack_rows(stored_zeros.t().contiguous(), bits).t().contiguous(),
            f"{stem}.scales": scale,
            f"{stem}.g_idx": g_idx.to(torch.int32),
        }
        return tensors, dequantized_int(q, zeros, scale, g_idx)

    config = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
              "desc_act": desc_act, "sym": symmetric, "checkpoint_format": version}  # fmt: skip
    _write_converted(float_dir, gptq_dir, dequantized_dir, convert, config)


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i holds column ORDER[i]


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8]: 4-bit values [R, C] packed along C, 8 columns a word, column c * 8 +
    AWQ_ORDER[i] in nibble i (AutoAWQ's WQLinear_GEMM.from_linear), written with numpy."""
    import numpy as np

    v = values.numpy().astype(np.uint32)
    out = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for i, column in enumerate(AWQ_ORDER):
        out |= v[:, column::8] << np.uint32(4 * i)
    return torch.from_numpy(out.view(np.int32))


def write_awq(float_dir: Path, awq_dir: Path, dequantized_dir: Path, group_size: int) -> None:
    """awq_dir: every quantized linear as AWQ GEMM's qweight [K, N / 8], qzeros [K / g, N / 8]
    and float16 scales [K / g, N] (4 bits, zero points)."""

    def convert(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        stem = name.removesuffix(".weight")
        k = tensor.shape[1]
        g_idx = torch.arange(k) // group_size
        q, zeros, scale = int_groups(tensor.t().float(), 4, g_idx, k // group_size, False)
        tensors = {
            f"{stem}.qweight": pack_awq(q),
            f"{stem}.qzeros": pack_awq(zeros),
            f"{stem}.scales": scale,
        }
        return tensors, dequantized_int(q, zeros, scale, g_idx)

    config = {"quant_method": "awq", "bits": 4, "group_size": group_size,
              "zero_point": True, "version": "gemm"}  # fmt: skip
    _write_converted(float_dir, awq_dir, dequantized_dir, convert, config)


def _write_converted(
    float_dir: Path,
    quantized_dir: Path,
    dequantized_dir: Path,
    convert: Any,
    quantization_config: dict[str, Any],
) -> None:
    from safetensors.torch import load_file, save_file

    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(float_dir / "model.safetensors")).items():
        if is_quantized_linear(name, tensor):
            tensors, dequantized[name] = convert(name, tensor)
            quantized.update(tensors)
        else:
            quantized[name] = tensor
            dequantized[name] = tensor.float()
    _copy_dir(float_dir, quantized_dir)
    _copy_dir(float_dir, dequantized_dir)
    save_file(quantized, str(quantized_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})
    edit_config(quantized_dir, quantization_config=quantization_config)


def write_compressed_tensors_per_tensor(
    float_dir: Path, ct_dir: Path, dequantized_dir: Path, weights: dict[str, Any], fmt: str
) -> None:
    """As write_compressed_tensors, tensor by tensor through the library's compressor for
    `fmt` (its compress and decompress), for checkpoints whose experts transformers holds
    fused (not as the Linear modules the model-level path targets): every expert's projections
    are quantized, the routers and lm_head are not."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    compressor = BaseCompressor.get_value_from_registry(fmt)

    def convert(name: str, tensor: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        stem = name.removesuffix(".weight")
        args = scheme.weights
        scale, zero_point = calculate_qparams(*_observe(tensor.float(), args), args)
        state = {"weight": tensor.float(), "weight_scale": scale, "weight_zero_point": zero_point}
        compressed = compressor.compress(state, scheme)
        dequantized = compressor.decompress(compressed, scheme)["weight"].float()
        return {f"{stem}.{k}": v.contiguous() for k, v in compressed.items()}, dequantized

    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format=fmt,
        quantization_status="compressed",
        ignore=["lm_head", "re:.*\\.gate$"],
    ).model_dump()
    _write_converted(float_dir, ct_dir, dequantized_dir, convert,
                     {**config, "quant_method": "compressed-tensors"})  # fmt: skip


def mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX FP4 of weight [..., N, K] (K a multiple of 32), as gpt-oss stores its experts:
    (blocks uint8 [..., N, K / 32, 16], two e2m1 codes a byte, low nibble first; scales uint8
    [..., N, K / 32], e8m0 = 127 + the block's shared exponent). The shared exponent is the OCP
    spec's floor(log2(amax)) - 2 (e2m1's largest value, 6, is 1.5 x 2^2); each value rounds to
    the nearest e2m1 value of value / 2^exponent, clamped to +-6."""
    from llmserve.engine.model.checkpoint_dequant import FP4_VALUES

    groups = weight.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=2.0**-126)
    exponent = (torch.floor(torch.log2(amax)) - 2).clamp(-127, 127)
    scaled = (groups / torch.exp2(exponent)).clamp(-6.0, 6.0)
    grid = torch.tensor(FP4_VALUES[:8])
    codes = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)
    codes = (codes | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = (exponent.squeeze(-1) + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


def write_mxfp4(float_dir: Path, mxfp4_dir: Path, dequantized_dir: Path) -> None:
    """A gpt-oss directory's experts as gpt-oss ships them (`quant_method: mxfp4`): each
    `mlp.experts.gate_up_proj` [E, H, 2 I] and `down_proj` [E, I, H] (transformers' fused
    layout, x @ W) stored transposed, [E, 2 I, H] and [E, H, I], as `X_blocks` and `X_scales`
    along the input dimension (mxfp4 above); biases, routers, attention and the LM head stay
    float. dequantized_dir: the same model with those experts dequantized, float32."""
    from safetensors.torch import load_file, save_file

    from llmserve.engine.model.checkpoint_dequant import dequantize_mxfp4

    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(float_dir / "model.safetensors")).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            quantized[name], dequantized[name] = tensor, tensor.float()
            continue
        blocks, scales = mxfp4(tensor.transpose(-1, -2))
        quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(-1, -2).contiguous()
    _copy_dir(float_dir, mxfp4_dir)
    _copy_dir(float_dir, dequantized_dir)
    save_file(quantized, str(mxfp4_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})
    edit_config(mxfp4_dir, quantization_config={"quant_method": "mxfp4"})
