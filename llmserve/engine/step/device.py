"""Where and in what the engine computes: the --device, --dtype and --kv-cache-dtype flags
resolved to torch's device and dtypes."""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)  # one of engine.config.DTYPES


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    return dtype if name == "auto" else KV_CACHE_DTYPES[name]
