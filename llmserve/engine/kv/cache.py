"""The paged KV pool: `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`.

Block ids are the scheduler's; the engine only reads and writes the slots they name.
"""

from __future__ import annotations

import math
import mmap

import torch

from llmserve.common.model_config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty(0, dtype=dtype).element_size()
    return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * element


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
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element = torch.empty(0, dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(1, math.prod(shape) * element))
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


def layer_views(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
    return [(layer[0], layer[1]) for layer in kv_cache]
