"""What a hybrid model's state layers keep per request, read without torch: the layers that
carry a fixed-size recurrent state instead of KV (their `layer_types` entry is one of
STATE_LAYER_TYPES), and one request's state in one such layer: a short causal convolution's
last `conv_kernel - 1` inputs and the recurrence's state (docs/architecture.md#state-slots).

A family fills `ModelConfig.state_layout` from its config.json; the engine allocates
`[num_state_layers, num_state_slots, *conv_shape]` and `[..., *recurrent_shape]` from the
memory budget (engine/kv/state.py), and the scheduler hands out the slots
(scheduler/state_slots.py). `GatedDeltaNetConfig` is Qwen3-Next's layer's shape.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

# layer_types entries whose layers keep a recurrent state and no KV: Qwen3-Next's gated
# DeltaNet ("linear_attention"), the Mamba-2 hybrids' mixers ("mamba").
STATE_LAYER_TYPES = ("linear_attention", "mamba")
# layer_types entries whose layers keep both a recurrent state and KV: Falcon-H1's layers run
# attention and a Mamba-2 mixer side by side ("hybrid").
BOTH_LAYER_TYPES = ("hybrid",)
# layer_types entries whose layers keep neither: Nemotron-H's MLP and MoE blocks.
STATELESS_LAYER_TYPES = ("mlp", "moe")


@dataclass(frozen=True)
class StateLayout:
    """One request's state in one state layer: conv_shape (e.g. [conv channels, conv_kernel -
    1]) and recurrent_shape (the delta rule's [value heads, key dim, value dim]; Mamba-2's
    [heads, head dim, state size])."""

    conv_shape: tuple[int, ...]
    recurrent_shape: tuple[int, ...]

    def elements_per_slot(self, num_state_layers: int) -> int:
        """Elements one slot holds over all state layers (times the dtype's size: bytes)."""
        return num_state_layers * (math.prod(self.conv_shape) + math.prod(self.recurrent_shape))


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Qwen3-Next's gated DeltaNet layer: num_k_heads query/key heads of head_k_dim, num_v_heads
    value heads of head_v_dim (a multiple of num_k_heads: each key head serves a group), and the
    depthwise conv over q, k and v of conv_kernel taps."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                f"linear_num_key_heads={self.num_k_heads}"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel} must be >= 2")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """The conv's channels: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def split(self, size: int) -> GatedDeltaNetConfig:
        """One of `size` tensor-parallel ranks' share: its key heads and their value heads."""
        if self.num_k_heads % size:
            raise ValueError(
                f"linear_num_key_heads={self.num_k_heads} does not split over {size} ranks"
            )
        return replace(
            self, num_k_heads=self.num_k_heads // size, num_v_heads=self.num_v_heads // size
        )

    def layout(self) -> StateLayout:
        return StateLayout(
            conv_shape=(self.conv_dim, self.conv_kernel - 1),
            recurrent_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )


def gated_delta_net_from_hf(cfg: Mapping[str, Any]) -> GatedDeltaNetConfig:
    """Qwen3NextConfig's linear_* fields (its defaults where config.json leaves one out)."""
    return GatedDeltaNetConfig(
        num_k_heads=int(cfg.get("linear_num_key_heads", 16)),
        num_v_heads=int(cfg.get("linear_num_value_heads", 32)),
        head_k_dim=int(cfg.get("linear_key_head_dim", 128)),
        head_v_dim=int(cfg.get("linear_value_head_dim", 128)),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )
