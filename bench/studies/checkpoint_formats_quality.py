"""Quantized checkpoint formats on a real model: the built-in SmolLM2-135M-Instruct (its GGUF
dequantized to float32 and saved as an HF directory) written by llmserve/bench/quant_checkpoints.py
in each format's layout, loaded by the engine's loader as it serves them (dequantized at load), and
again with --quantization int8 on top. For each: the checkpoint's bytes on disk, the model's
resident weight bytes (every parameter and buffer, the int8 kernel's packed layout included), and
top-1 agreement / mean KL against the float32 model, teacher-forced over llmserve/bench/quality.py's
eight passages (363 positions). Writes bench/results/checkpoint_formats_quality.json.

    python -m bench.studies.checkpoint_formats_quality [--formats ct-w4a16-g32,...]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, fields, is_dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmserve.bench import quant_checkpoints as qc
from llmserve.bench.quality import PASSAGES, agreement, prompt_logits
from llmserve.common.model_config import builtin_model_path, load_model_config
from llmserve.engine.model.weights import build_model, load_weights
from llmserve.gateway.tokenizer import Tokenizer

INT4 = {"type": "int", "symmetric": True, "num_bits": 4, "strategy": "group"}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
Writer = Callable[[Path, Path, Path], None]
FORMATS: dict[str, Writer] = {
    "ct-w4a16-g32": lambda s, q, d: qc.write_compressed_tensors(
        s, q, d, {**INT4, "group_size": 32}
    ),
    "ct-w4a16-g64-asym": lambda s, q, d: qc.write_compressed_tensors(
        s, q, d, {**INT4, "group_size": 64, "symmetric": False}
    ),
    "ct-w8a16": lambda s, q, d: qc.write_compressed_tensors(
        s, q, d, {"type": "int", "symmetric": True, "num_bits": 8, "strategy": "channel"},
        None, "int-quantized",
    ),
    "ct-fp8-channel-dynamic": lambda s, q, d: qc.write_compressed_tensors(
        s, q, d, {**FP8, "strategy": "channel"}, {**FP8, "strategy": "token", "dynamic": True}
    ),
    "fp8-block-128": lambda s, q, d: qc.write_fp8_block(s, q, d, (128, 128)),
    "gptq-4bit-g32-act-order": lambda s, q, d: qc.write_gptq(
        s, q, d, bits=4, group_size=32, desc_act=True
    ),
    "gptq-8bit-g64": lambda s, q, d: qc.write_gptq(s, q, d, bits=8, group_size=64, desc_act=False),
    "awq-g64": lambda s, q, d: qc.write_awq(s, q, d, 64),
}  # fmt: skip


def float_checkpoint(directory: Path) -> Path:
    """The built-in model as an HF LlamaForCausalLM directory of float32 safetensors."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    source = builtin_model_path()
    config = load_model_config(source)
    weights = load_weights(source, config)
    tensors = {n: weights[n].float().contiguous() for n in weights if n != "rope_freqs"}
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings, architectures=["LlamaForCausalLM"],
    ).save_pretrained(directory)  # fmt: skip
    return directory


def _tensor_bytes(value: object, seen: set[int]) -> int:
    if isinstance(value, torch.Tensor):
        try:
            key = value.data_ptr()
        except RuntimeError:  # an opaque tensor (PackedLinear's oneDNN weight): by identity
            key = id(value)
        if key in seen:
            return 0
        seen.add(key)
        return value.numel() * value.element_size()
    if is_dataclass(value):
        return sum(_tensor_bytes(getattr(value, f.name), seen) for f in fields(value))
    if isinstance(value, (list, tuple)):  # CheckpointLinear's segments: (PackedWQ, perm)
        return sum(_tensor_bytes(v, seen) for v in value)
    return 0


def resident_weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter, buffer and tensor a layer holds (the int8 kernel's packed
    weights live in a dataclass attribute); each storage counted once."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, dict):
                total += sum(_tensor_bytes(v, seen) for v in value.values())
            else:
                total += _tensor_bytes(value, seen)
    return total


def measure(
    path: Path, quantization: str, prompts: list[list[int]], reference: list[torch.Tensor]
) -> dict[str, Any]:
    config = load_model_config(path)
    start = time.perf_counter()
    model = build_model(config, load_weights(path, config), 1024, torch.float32,
                        torch.device("cpu"), quantization=quantization)  # fmt: skip
    load_s = time.perf_counter() - start
    result = agreement(reference, [prompt_logits(model, config, p) for p in prompts])
    return {"quantization": quantization, "load_s": round(load_s, 2),
            "resident_weight_bytes": resident_weight_bytes(model), **asdict(result)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--out", default="bench/results/checkpoint_formats_quality.json")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tokenizer = Tokenizer.from_model_path(builtin_model_path())
    prompts = [tokenizer.encode(text) for text in PASSAGES]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        source = float_checkpoint(root / "float")
        config = load_model_config(source)
        reference_model = build_model(config, load_weights(source, config), 1024,
                                      torch.float32, torch.device("cpu"))  # fmt: skip
        reference = [prompt_logits(reference_model, config, p) for p in prompts]
        del reference_model
        for quantization in ("none", "int8"):
            rows.append({"format": "float32", "checkpoint_bytes": _disk(source),
                         **measure(source, quantization, prompts, reference)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
        for name in args.formats.split(","):
            quantized, dequantized = root / name, root / f"{name}-dequantized"
            FORMATS[name](source, quantized, dequantized)
            for quantization in ("none", "int8"):
                row = {"format": name, "checkpoint_bytes": _disk(quantized),
                       **measure(quantized, quantization, prompts, reference)}  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), ""
    )
    report = {"model": "SmolLM2-135M-Instruct (built-in GGUF, dequantized to float32)",
              "cpu": model_name, "machine": platform.machine(), "rows": rows}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


def _disk(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


if __name__ == "__main__":
    main()
