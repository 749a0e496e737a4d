"""The shape of a Mamba-2 mixer layer (Granite 4.0-H, Nemotron-H, Falcon-H1), read from an HF
config.json without torch, and what one request keeps per Mamba layer: the conv's last
`conv_kernel - 1` inputs [conv_dim, conv_kernel - 1] and the SSM state [heads, head_dim,
state_size] (engine/model/mamba2.py computes the layer)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from llmserve.common.state_layout import StateLayout


@dataclass(frozen=True)
class Mamba2Config:
    """num_heads heads of head_dim channels (intermediate_size = their product); B and C in
    num_groups groups of state_size; a depthwise conv of conv_kernel taps over x, B and C;
    the scan in chunks of chunk_size; dt clamped to time_step_limit after its softplus.
    Falcon-H1's extras: the input times in_multiplier, in_proj's five parts (gate, x, B, C,
    dt) times proj_multipliers (its mup vector); the gated RMSNorm optional (gated_norm; without
    it y * silu(gate)) and normalizing before the gate where norm_before_gate."""

    num_heads: int
    head_dim: int
    num_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int = 256
    conv_bias: bool = True
    proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    in_multiplier: float = 1.0
    proj_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    gated_norm: bool = True
    norm_before_gate: bool = False
    out_bias: bool | None = None  # out_proj's bias (None: proj_bias; Falcon-H1: projectors_bias)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_groups:
            raise ValueError(
                f"mamba_n_groups={self.num_groups} must divide mamba_n_heads={self.num_heads}"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"mamba_d_conv={self.conv_kernel} must be >= 2")
        if self.chunk_size < 1:
            raise ValueError(f"mamba_chunk_size={self.chunk_size} must be >= 1")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def group_size(self) -> int:
        """B's (and C's) width: num_groups * state_size."""
        return self.num_groups * self.state_size

    @property
    def conv_dim(self) -> int:
        """The conv's channels: x, B and C side by side."""
        return self.intermediate_size + 2 * self.group_size

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    def split(self, size: int) -> Mamba2Config:
        """One of `size` tensor-parallel ranks' share: H / T heads, and G / T groups of B and C
        (each rank's heads read only its groups); with one group every rank keeps it whole (and
        the gated norm, over all heads then, sums its squares across the ranks). Other group
        counts that do not divide by T are refused, naming them."""
        if size == 1:
            return self
        if self.num_heads % size:
            raise ValueError(
                f"mamba_n_heads={self.num_heads} does not split over tensor_parallel_size={size}"
            )
        if self.num_groups % size and self.num_groups != 1:
            raise ValueError(
                f"mamba_n_groups={self.num_groups} does not split over tensor_parallel_size="
                f"{size} (a rank's heads would read groups it does not hold)"
            )
        groups = 1 if self.num_groups == 1 else self.num_groups // size
        return replace(self, num_heads=self.num_heads // size, num_groups=groups)

    def layout(self) -> StateLayout:
        """What the state pool keeps per slot and Mamba layer (common/state_layout.py)."""
        return StateLayout(conv_shape=self.conv_shape, recurrent_shape=self.ssm_shape)

    def elements_per_request(self) -> int:
        """One request's state in one Mamba layer, in elements (conv + SSM)."""
        return math.prod(self.conv_shape) + math.prod(self.ssm_shape)


def json_float(value: Any) -> float:
    """A float of config.json; transformers 5 writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, Mapping):
        value = value.get("__float__")
    return float(value)


def _shared_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The Mamba2Config fields every Mamba-2 hybrid's config.json names alike (mamba_n_groups,
    mamba_d_state, ...), with transformers' defaults where one is left out."""
    limit = cfg.get("time_step_limit") or (0.0, float("inf"))
    return dict(
        num_groups=int(cfg.get("mamba_n_groups") or 1),
        state_size=int(cfg.get("mamba_d_state") or 256),
        conv_kernel=int(cfg.get("mamba_d_conv") or 4),
        chunk_size=int(cfg.get("mamba_chunk_size") or 256),
        conv_bias=bool(cfg.get("mamba_conv_bias", True)),
        proj_bias=bool(cfg.get("mamba_proj_bias", False)),
        time_step_limit=(json_float(limit[0]), json_float(limit[1])),
    )


def mamba2_from_granite(cfg: Mapping[str, Any]) -> Mamba2Config:
    """GraniteMoeHybridConfig's mamba_* fields (its defaults where config.json leaves one out;
    mamba_d_head "auto": mamba_expand * hidden_size / mamba_n_heads)."""
    heads = int(cfg.get("mamba_n_heads") or 128)
    inner = int(cfg.get("mamba_expand") or 2) * int(cfg["hidden_size"])
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != inner:
        raise ValueError(
            f"mamba_n_heads={heads} x mamba_d_head={head_dim} must equal mamba_expand x "
            f"hidden_size={inner}"
        )
    return Mamba2Config(
        num_heads=heads,
        head_dim=head_dim,
        **_shared_fields(cfg),
    )


def mamba2_from_falcon_h1(cfg: Mapping[str, Any]) -> Mamba2Config:
    """FalconH1Config's mamba_* fields (its defaults where config.json leaves one out): the
    mixer's width mamba_d_ssm (or mamba_expand x hidden_size), its multipliers and norm."""
    inner = cfg.get("mamba_d_ssm", 1024)
    inner = int(cfg.get("mamba_expand") or 2) * int(cfg["hidden_size"]) if inner is None else inner
    heads = int(cfg.get("mamba_n_heads") or 128)
    head_dim = cfg.get("mamba_d_head", "auto")
    head_dim = int(inner) // heads if head_dim in (None, "auto") else int(head_dim)
    if head_dim * heads != int(inner):
        raise ValueError(
            f"mamba_n_heads={heads} x mamba_d_head={head_dim} must equal mamba_d_ssm={inner}"
        )
    mup = tuple(float(m) for m in cfg.get("ssm_multipliers") or (1.0,) * 5)
    if len(mup) != 5:
        raise ValueError(f"ssm_multipliers has {len(mup)} entries, not 5 (gate, x, B, C, dt)")
    return Mamba2Config(
        num_heads=heads,
        head_dim=head_dim,
        **_shared_fields(cfg),
        in_multiplier=float(cfg.get("ssm_in_multiplier") or 1.0),
        proj_multipliers=mup,
        gated_norm=bool(cfg.get("mamba_rms_norm", False)),
        norm_before_gate=bool(cfg.get("mamba_norm_before_gate", True)),
        out_bias=bool(cfg.get("projectors_bias", False)),
    )


@dataclass(frozen=True)
class FalconMultipliers:
    """Falcon-H1's per-layer muP multipliers (the mixer's own are Mamba2Config's): the attention
    input and output, the Mamba-2 mixer's output, the MLP's gate (before its activation) and
    down projection; the LM head's logits."""

    attention_in: float = 1.0
    attention_out: float = 1.0
    ssm_out: float = 1.0
    mlp_gate: float = 1.0
    mlp_down: float = 1.0
    lm_head: float = 1.0


def mamba2_gguf_shape(fields: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """A Mamba-2 hybrid GGUF's mixer shape from llama.cpp's `ssm.*` keys (its converter writes
    time_step_rank: the heads, inner_size: heads x head_dim, group_count, state_size,
    conv_kernel) and which biases its first Mamba layer's tensors carry: heads, head_dim,
    groups, state_size, conv_kernel, conv_bias, proj_bias, out_bias, gated_norm."""
    heads = int(fields[f"{arch}.ssm.time_step_rank"])
    inner = int(fields[f"{arch}.ssm.inner_size"])
    if heads <= 0 or inner % heads:
        raise ValueError(
            f"{arch}.ssm.inner_size={inner} is not a multiple of {arch}.ssm.time_step_rank={heads}"
        )
    names = fields["tensor_names"]
    first = min((int(n.split(".")[1]) for n in names if n.endswith(".ssm_in.weight")), default=0)
    return dict(
        heads=heads,
        head_dim=inner // heads,
        groups=int(fields[f"{arch}.ssm.group_count"]),
        state_size=int(fields[f"{arch}.ssm.state_size"]),
        conv_kernel=int(fields[f"{arch}.ssm.conv_kernel"]),
        conv_bias=f"blk.{first}.ssm_conv1d.bias" in names,
        proj_bias=f"blk.{first}.ssm_in.bias" in names,
        out_bias=f"blk.{first}.ssm_out.bias" in names,
        gated_norm=f"blk.{first}.ssm_norm.weight" in names,
    )
