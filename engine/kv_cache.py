"""The paged KV pool: `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`.

Block ids are the scheduler's; the engine only reads and writes the slots they name.
"""

from __future__ import annotations

import torch

from common.model_config import ModelConfig


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
    """Zeroed, so slots never written hold finite values (padding rows read them, masked)."""
    shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def layer_views(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), each [num_blocks, block_size, num_kv_heads, head_dim]."""
    return [(layer[0], layer[1]) for layer in kv_cache]
