"""Rotary position embeddings: the frequencies as HF computes them (default, linear, llama3,
yarn, dynamic NTK and Phi-3's longrope scaling; a sliding layer's own base for Gemma 3) and the
module that rotates q and k, over all of head_dim or its first `rotary_dim` dimensions (partial
rotary, Phi-3)."""

from __future__ import annotations

import math
from typing import Any

import torch

from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.ops import LayerOps, OpsModule


def rope_settings(config: ModelConfig, local: bool = False) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) of the model's rotary, or of its sliding layers' where they have their
    own base (local, Gemma 3: unscaled)."""
    if local and config.rope_local_theta is not None:
        return config.rope_local_theta, {}
    return config.rope_theta, config.rope_scaling or {}


def rope_inv_freq(
    config: ModelConfig,
    rope_freqs: torch.Tensor | None = None,
    *,
    local: bool = False,
    max_positions: int = 0,
) -> torch.Tensor:
    """Per-pair rotary frequencies, computed as HF does (float32), with llama3 / linear / yarn /
    longrope scaling (dynamic: unscaled). longrope takes its long factors when the engine's
    max_positions exceeds the original context (HF switches per forward on the batch's longest
    position instead)."""
    dim = config.rotary_dim
    theta, scaling = rope_settings(config, local)
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (theta**exponent)
    # dynamic NTK grows the base only past max_position_embeddings, which the engine's
    # max_model_len never exceeds: its frequencies are the default ones at every served position.
    if rope_freqs is not None:  # llama3 GGUF: the divisors are stored as a tensor
        return inv_freq / rope_freqs.float()
    if scaling.get("rope_type") == "linear":
        return inv_freq / float(scaling["factor"])
    if scaling.get("rope_type") == "yarn":
        return _yarn_inv_freq(inv_freq, scaling, _yarn_factor(config, scaling), theta, dim)
    if scaling.get("rope_type") == "longrope":
        long = max_positions > int(scaling["original_max_position_embeddings"])
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"])
        return 1.0 / (factors.float() * theta**exponent)
    if scaling.get("rope_type") == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _yarn_factor(config: ModelConfig, scaling: dict[str, Any]) -> float:
    """yarn's factor; DeepSeek-V3's configs leave it out: the ratio of the two contexts."""
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return config.max_position_embeddings / int(scaling["original_max_position_embeddings"])


def _yarn_inv_freq(
    inv_freq: torch.Tensor, scaling: dict[str, Any], factor: float, theta: float, dim: int
) -> torch.Tensor:
    """YaRN: the fast-rotating pairs kept (extrapolated), the slow ones divided by the factor
    (interpolated), a linear ramp between the pairs that turn beta_fast and beta_slow times
    over the original context."""
    original = int(scaling["original_max_position_embeddings"])

    def pair(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = pair(scaling.get("beta_fast") or 32), pair(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(config: ModelConfig, local: bool = False) -> float:
    """longrope's and yarn's scale of cos and sin (1.0 for the other rope types), as HF
    defaults it."""
    _, scaling = rope_settings(config, local)
    if scaling.get("rope_type") == "yarn":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        factor = _yarn_factor(config, scaling)
        mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
        return _yarn_mscale(factor)
    if scaling.get("rope_type") != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = int(scaling["original_max_position_embeddings"])
    factor = float(scaling.get("factor") or config.max_position_embeddings / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim]: cat(cos, sin) of position * inv_freq, float32."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RotaryEmbedding(OpsModule):
    """Rotates q and k by their positions through a cos/sin cache it owns: computed, never
    loaded, float32 whatever the model's dtype. One instance serves every layer of a rope
    setting (Gemma 3: one for the sliding layers, one for the others)."""

    cos_sin_cache: torch.Tensor  # [max_positions, rotary_dim]: cat(cos, sin)

    def __init__(self, config: ModelConfig, max_positions: int, ops: LayerOps, local: bool = False):
        super().__init__(ops)
        self.config = config
        self.max_positions = max_positions
        self.local = local
        self.rotary_dim = config.rotary_dim
        self.register_buffer("cos_sin_cache", self._cache(None), persistent=False)

    def _cache(self, rope_freqs: torch.Tensor | None) -> torch.Tensor:
        inv_freq = rope_inv_freq(
            self.config, rope_freqs, local=self.local, max_positions=self.max_positions
        )
        cache = rope_cos_sin_cache(inv_freq, self.max_positions)
        factor = rope_attention_factor(self.config, self.local)
        return cache if factor == 1.0 else cache * factor

    def reset(self, rope_freqs: torch.Tensor | None = None) -> None:
        """Recompute the cache on its device: after materializing the model (to_empty leaves it
        garbage, .to(dtype) rounds it), or from a llama3 GGUF's `rope_freqs` divisors."""
        self.cos_sin_cache = self._cache(rope_freqs).to(self.cos_sin_cache.device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] rotated (KernelOps:
        in place). Partial rotary rotates the first rotary_dim dimensions of each head."""
        dim = self.rotary_dim
        if dim == q.shape[-1]:
            return self.ops.rotary(positions, q, k, self.cos_sin_cache)
        q_rot, k_rot = self.ops.rotary(
            positions, q[..., :dim].contiguous(), k[..., :dim].contiguous(), self.cos_sin_cache
        )
        return torch.cat((q_rot, q[..., dim:]), -1), torch.cat((k_rot, k[..., dim:]), -1)
