"""Multi-head latent attention's shape (DeepSeek-V2/V3, Kimi K2), read from an HF config.json
without torch.

    q       = q_b(norm(q_a(x)))  or q_proj(x) without q_lora_rank   [heads, nope + rope]
    latent  = kv_a_proj_with_mqa(x) = [c (kv_lora_rank) | k_rot (qk_rope_head_dim)]
    k, v    = kv_b(norm(c)) per head                                  [heads, nope], [heads, v]

The KV pool stores the latent alone, norm(c) and the rotated k_rot: `latent_dim` values per
token per layer, one "head", instead of 2 x heads x head_dim (engine/model/families/deepseek.py
attends over it with kv_b absorbed into the query and the output).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MLAConfig:
    """One MLA layer's widths (the same in every layer). q_lora_rank None: a plain q_proj.
    rope_interleave: the checkpoint's rotary pairs are (x0, x1), (x2, x3)... (DeepSeek's
    layout; the engine permutes those rows at load to rotate-half's)."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even for RoPE")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values the KV pool holds per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def mla_from_hf(cfg: Mapping[str, Any]) -> MLAConfig:
    q_rank = cfg.get("q_lora_rank")
    return MLAConfig(
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        q_lora_rank=int(q_rank) if q_rank else None,
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def mla_softmax_scale(mla: MLAConfig, scaling: Mapping[str, Any] | None) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) squared under yarn with
    mscale_all_dim (DeepSeek's reference and transformers' yarn_apply_mscale)."""
    scale = mla.qk_head_dim**-0.5
    all_dim = (scaling or {}).get("mscale_all_dim")
    factor = float((scaling or {}).get("factor") or 1.0)
    if all_dim and factor > 1:
        mscale = 0.1 * float(all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale
