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
