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
    """The decoder layers' projection weights (experts included); routers stay float."""
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and tensor.dim() == 2
        and "norm" not in name
        and not name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight"))
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
    }
    _copy_dir(float_dir, dequantized_dir)
    from safetensors.torch import save_file

    save_file(dequantized, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})
