"""HF transformers as the benchmarks' baseline: its model for a model file, or for a config with
the engine's dummy weights, and one timed static-batch `generate`. Imports torch and transformers
only when called."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def load_model(model_path: Path, device: str = "cpu") -> Any:
    """HF transformers' model for a model directory or a .gguf file (dequantized), float32,
    on device, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = {} if model_path.is_dir() else {"gguf_file": model_path.name}
    directory = model_path if model_path.is_dir() else model_path.parent
    model: Any = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, **gguf)
    return model.to(device).eval()  # Any: transformers' decorated .to() is typed wrongly for mypy


def dummy_model(config_dir: Path, seed: int, dtype: Any, device: str) -> Any:
    """HF transformers' LlamaForCausalLM for config_dir/config.json holding the engine's dummy
    weights (engine/model/dummy.py, `--load-format dummy --seed seed`), made on `device` in `dtype`
    (an 8B model in bf16 never exists in float32)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmserve.engine.model.dummy import fill_hf_tensor_

    config = LlamaConfig.from_pretrained(config_dir)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, param in model.named_parameters():
            fill_hf_tensor_(param.data, seed, name)
    model.generation_config.eos_token_id = None  # generate exactly the asked length
    return model.eval()


def timed_generate(model: Any, token_ids: list[list[int]], num_new: int) -> float:
    """Seconds `generate` takes to add exactly num_new greedy tokens to each prompt of
    token_ids, as one static batch (the prompts are of one length: no padding); on a GPU,
    from an idle device to the last token computed."""
    import torch

    ids = torch.tensor(token_ids, device=model.device)
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,
            pad_token_id=0,  # never used: no prompt is padded and none stops early
        )
    if ids.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == num_new
    return seconds
