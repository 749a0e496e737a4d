"""The paged KV pool: `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`, or,
for multi-head latent attention (config.mla), `[num_layers, 1, num_blocks, block_size, 1,
kv_lora_rank + qk_rope_head_dim]`: one latent per token per layer, read as both key and value.

Block ids are the scheduler's; the engine only reads and writes the slots they name. Everything
that moves blocks (offload tiers, KV transfers) indexes dimension 2 and keeps the rest whole, so
it moves either layout.
"""

from __future__ import annotations

import math
import mmap

import torch

from llmserve.common.model_config import ModelConfig


def kv_pool_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    if config.mla is not None:
        return (config.num_layers, 1, num_blocks, block_size, 1, config.mla.latent_dim)
    num_layers = config.num_kv_layers  # a hybrid's state layers keep no KV
    return (num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)


def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """The pool's bytes per token over all layers: 2 x layers x KV heads x head_dim x element,
    or layers x (kv_lora_rank + qk_rope_head_dim) x element with MLA."""
    element = torch.empty(0, dtype=dtype).element_size()
    return math.prod(kv_pool_shape(config, 1, 1)) * element


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return block_size * bytes_per_token(config, dtype)


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Zeroed, so slots never written hold finite values (padding rows read them, masked).

    On a CPU the pool is anonymous memory mapped for it, which the OS zeroes page by page as it
    is first touched: the process's resident memory grows with the KV actually used, not with
    the pool's size."""
    return zeroed(kv_pool_shape(config, num_blocks, block_size), dtype, device)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed pool tensor; on a CPU, pages the OS zeroes as they are first touched."""
    if device.type != "cpu" or not math.prod(shape):  # empty: a stage without such layers
        return torch.zeros(shape, dtype=dtype, device=device)
    element = torch.empty(0, dtype=dtype).element_size()
    pages = mmap.mmap(-1, math.prod(shape) * element)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def layer_views(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]; an
    MLA pool's one latent is both (the layer keeps the value part of what it reads)."""
    return [(layer[0], layer[-1]) for layer in kv_cache]
