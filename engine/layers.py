"""The modules engine/model.py is built from. Each owns its weights; those that run a hot op
(RMSNorm, rotary, attention, SiLU-and-mul) hold the model's ops backend (engine/ops.py), given at
build time. Only the per-step AttentionContext travels with the forward call.

Linear layers share one interface, so that tensor-parallel or quantized linears can be other
classes: `weight_loader(param, loaded, shard)` puts one HF tensor in place (shard k of a fused
weight: q/k/v, gate/up) and `forward(x)` computes x W^T + b. On a CPU in float32, PackedLinear
replaces Linear once the weights are loaded.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from common.model_config import ModelConfig
from engine.lora import LoraBatch
from engine.ops import AttentionContext, LayerOps
from engine.parallel import TPGroup


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard: int = 0) -> None:
    """Copy a whole HF tensor into `param` (an unfused parameter: shard 0 only)."""
    assert shard == 0, f"an unfused parameter has no shard {shard}"
    if param.shape != loaded.shape:  # copy_ would broadcast some wrong shapes silently
        raise ValueError(f"a tensor of shape {tuple(loaded.shape)} for one of {tuple(param.shape)}")
    param.copy_(loaded)


class Linear(nn.Module):
    """y = x W^T + b. W (and b) stack one HF tensor per entry of output_sizes, in rows.

    Tensor-parallel (tp.size > 1), the sizes are this rank's and the loader takes its slice of
    each HF tensor: split="output" (column-parallel: rank r holds rows r*n .. (r+1)*n of each;
    beyond the end, as in a padded vocabulary, zeros) or split="input" (row-parallel: columns
    r*k .. (r+1)*k; the caller all-reduces the output, and the bias is rank 0's alone).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        tp: TPGroup | None = None,
        split: str | None = None,
    ):
        super().__init__()
        self.output_sizes = output_sizes
        self.tp = tp or TPGroup()
        self.split = split if self.tp.size > 1 else None
        self.weight = nn.Parameter(torch.empty(sum(output_sizes), input_size))
        self.bias = nn.Parameter(torch.empty(sum(output_sizes))) if bias else None

    def shard(self, param: torch.Tensor, shard: int) -> torch.Tensor:
        """The rows of `param` (weight or bias) that HF tensor number `shard` fills."""
        start = sum(self.output_sizes[:shard])
        return param.narrow(0, start, self.output_sizes[shard])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        if self.split == "output":
            loaded = rank_rows(loaded, self.tp.rank, self.output_sizes[shard])
        elif self.split == "input" and loaded.dim() == 2:
            width = param.shape[1]
            loaded = loaded.narrow(1, self.tp.rank * width, width)
        elif self.split == "input" and self.tp.rank > 0:  # the bias, added once after the sum
            loaded = torch.zeros_like(loaded)
        default_weight_loader(self.shard(param, shard), loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


def rank_rows(loaded: torch.Tensor, rank: int, rows: int) -> torch.Tensor:
    """Rows rank*rows .. (rank+1)*rows of loaded, zero-padded past its end."""
    start = rank * rows
    part = loaded[start : start + rows]
    if part.shape[0] == rows:
        return part
    padded = loaded.new_zeros(rows, *loaded.shape[1:])
    padded[: part.shape[0]] = part
    return padded


class VocabEmbedding(nn.Module):
    """Token embeddings; tensor-parallel, each rank holds ceil(vocab / T) rows (the last one
    zero-padded), looks up the tokens in its range and the ranks' rows are summed."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or TPGroup()
        self.num_rows = -(-vocab_size // self.tp.size)
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        default_weight_loader(param, rank_rows(loaded, self.tp.rank, self.num_rows), shard)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.tp.rank * self.num_rows
        mine = (local >= 0) & (local < self.num_rows)
        rows = nn.functional.embedding(local.clamp(0, self.num_rows - 1), self.weight)
        return self.tp.all_reduce(rows * mine.unsqueeze(-1).to(rows.dtype))


class PackedLinear(nn.Module):
    """A float32 CPU linear layer on oneDNN's pre-packed weight layout, made from loaded weights
    (it copies them) to replace a Linear.

    Plain `F.linear` repacks the weight on every call; for a decode step's few rows that costs as
    much as the product (measured here: 0.55 vs 1.1 ms for a [16, 576] x [576, 3072] layer).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16)
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def can_pack_cpu_linears() -> bool:
    """Whether this torch build has oneDNN's packed linear ops (CPU builds usually do)."""
    try:
        w = torch.ones(4, 4)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), packed, None, "none", [], "")
        return bool(torch.equal(out, torch.full((2, 4), 4.0)))
    except (AttributeError, RuntimeError):
        return False


class OpsModule(nn.Module):
    """A module whose forward runs through `self.ops` (LlamaForCausalLM.set_ops swaps it)."""

    def __init__(self, ops: LayerOps):
        super().__init__()
        self.ops = ops


class RMSNorm(OpsModule):
    def __init__(self, hidden_size: int, eps: float, ops: LayerOps):
        super().__init__(ops)
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual) * weight, x + residual); without a residual, x is the residual."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(config: ModelConfig, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
    """Per-pair rotary frequencies, computed as HF does (float32), with llama3 / linear scaling."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    scaling = config.rope_scaling or {}
    if rope_freqs is not None:  # llama3 GGUF: the divisors are stored as a tensor
        return inv_freq / rope_freqs.float()
    if scaling.get("rope_type") == "linear":
        return inv_freq / float(scaling["factor"])
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


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim]: cat(cos, sin) of position * inv_freq, float32."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class RotaryEmbedding(OpsModule):
    """Rotates q and k by their positions through a cos/sin cache it owns: computed, never
    loaded, float32 whatever the model's dtype. One instance serves every layer."""

    cos_sin_cache: torch.Tensor  # [max_positions, head_dim]: cat(cos, sin)

    def __init__(self, config: ModelConfig, max_positions: int, ops: LayerOps):
        super().__init__(ops)
        self.config = config
        self.max_positions = max_positions
        cache = rope_cos_sin_cache(rope_inv_freq(config), max_positions)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def reset(self, rope_freqs: torch.Tensor | None = None) -> None:
        """Recompute the cache on its device: after materializing the model (to_empty leaves it
        garbage, .to(dtype) rounds it), or from a llama3 GGUF's `rope_freqs` divisors."""
        cache = rope_cos_sin_cache(rope_inv_freq(self.config, rope_freqs), self.max_positions)
        self.cos_sin_cache = cache.to(self.cos_sin_cache.device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] rotated (KernelOps:
        in place)."""
        return self.ops.rotary(positions, q, k, self.cos_sin_cache)


class Attention(OpsModule):
    """GQA self-attention of layer `layer_idx`: fused q/k/v projection, rotary, this step's K/V
    stored and attended to in the layer's view of the paged KV pool, output projection."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        ops: LayerOps,
        tp: TPGroup | None = None,
    ):
        """layer_idx: the layer's index in this rank's KV pool. tp: the heads split T ways."""
        super().__init__(ops)
        self.tp = tp = tp or TPGroup()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = config.num_kv_heads // tp.size
        self.head_dim, self.scale = config.head_dim, config.head_dim**-0.5
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        sizes = [self.q_size, self.kv_size, self.kv_size]
        bias = config.attention_bias
        self.qkv_proj = Linear(config.hidden_size, sizes, bias, tp, "output")
        self.o_proj = Linear(self.q_size, [config.hidden_size], bias, tp, "input")
        self.rotary_emb = rotary

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if ctx.lora is not None:
            ctx.lora.add(self.layer_idx, "qkv_proj", hidden, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(
            positions,
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
        )
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        attn = self.ops.attention(q, k, v, k_cache, v_cache, ctx, self.scale)
        attn = attn.view(num_tokens, self.q_size)
        out = self.o_proj(attn)
        if ctx.lora is not None:  # before the all-reduce: a row-parallel update is partial too
            ctx.lora.add(self.layer_idx, "o_proj", attn, out)
        return self.tp.all_reduce(out)


class MLP(OpsModule):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one fused projection."""

    def __init__(
        self, config: ModelConfig, ops: LayerOps, tp: TPGroup | None = None, layer_idx: int = 0
    ):
        super().__init__(ops)
        self.tp = tp = tp or TPGroup()
        self.layer_idx = layer_idx
        inter, bias = config.intermediate_size // tp.size, config.mlp_bias
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], bias, tp, "output")
        self.down_proj = Linear(inter, [config.hidden_size], bias, tp, "input")

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """lora: the step's adapters (engine.lora), whose updates the two projections add."""
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.add(self.layer_idx, "gate_up_proj", x, gate_up)
        hidden = self.ops.silu_and_mul(gate_up)
        out = self.down_proj(hidden)
        if lora is not None:
            lora.add(self.layer_idx, "down_proj", hidden, out)
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        ops: LayerOps,
        tp: TPGroup | None = None,
    ):
        """layer_idx: the layer's index in this rank's KV pool (its stage's layers only)."""
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.self_attn = Attention(config, layer_idx, rotary, ops, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, ops)
        self.mlp = MLP(config, ops, tp, layer_idx)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) -> (hidden, residual), the residual adds fused into the norms:
        this layer's input is hidden + residual (residual None: the first layer's is hidden)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, ctx)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, ctx.lora), residual
