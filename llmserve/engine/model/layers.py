"""The modules engine/model/model.py is built from. Each owns its weights; those that run a hot op
(RMSNorm, rotary, attention, SiLU-and-mul) hold the model's ops backend (engine/model/ops.py), given
at build time. Only the per-step AttentionContext travels with the forward call.

Linear layers share one interface, so that tensor-parallel or quantized linears can be other
classes: `weight_loader(param, loaded, shard)` puts one HF tensor in place (shard k of a fused
weight: q/k/v, gate/up) and `forward(x)` computes x W^T + b. On a CPU in float32, PackedLinear
replaces Linear once the weights are loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.engine.features.lora import LoraBatch
from llmserve.engine.model.ops import AttentionContext, LayerOps, OpsModule
from llmserve.engine.model.rotary import (  # noqa: F401 (the layers' names, as before)
    RotaryEmbedding,
    rope_cos_sin_cache,
    rope_inv_freq,
)
from llmserve.engine.parallel.groups import TPGroup


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


class UnitOffsetRMSNorm(RMSNorm):
    """Gemma's RMSNorm, which scales by (1 + w): the checkpoint's w is loaded as 1 + w, so the
    forward is RMSNorm's (and runs through the same kernels)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        default_weight_loader(param, loaded.float() + 1.0, shard)


NormClass = type[RMSNorm]


class Attention(OpsModule):
    """GQA self-attention of layer `layer_idx`: fused q/k/v projection, rotary, this step's K/V
    stored and attended to in the layer's view of the paged KV pool, output projection.

    Per family (config): biases on q/k/v and o (attention_bias) or q/k/v alone (qkv_bias), the
    softmax scale (attention_scale), soft-capped scores (attn_logit_softcap); per layer: a
    sliding window (`window`) and an RMSNorm over each head's q and k before the rotary
    (`qk_norm`: its class, Qwen3 and Gemma 3); attention sinks (config.attention_sinks,
    gpt-oss)."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        ops: LayerOps,
        tp: TPGroup | None = None,
        *,
        window: int | None = None,
        qk_norm: NormClass | None = None,
    ):
        """layer_idx: the layer's index in this rank's KV pool. tp: the heads split T ways."""
        super().__init__(ops)
        self.tp = tp = tp or TPGroup()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = config.num_kv_heads // tp.size
        self.head_dim = config.head_dim
        self.scale = config.attention_scale or config.head_dim**-0.5
        self.window, self.softcap = window, config.attn_logit_softcap
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        sizes = [self.q_size, self.kv_size, self.kv_size]
        bias = config.attention_bias
        self.qkv_proj = Linear(config.hidden_size, sizes, bias or config.qkv_bias, tp, "output")
        self.o_proj = Linear(self.q_size, [config.hidden_size], bias, tp, "input")
        self.rotary_emb = rotary
        if qk_norm is not None:
            self.q_norm = qk_norm(config.head_dim, config.rms_norm_eps, ops)
            self.k_norm = qk_norm(config.head_dim, config.rms_norm_eps, ops)
        self.qk_norm = qk_norm is not None
        # gpt-oss: one logit per head in the softmax's denominator (loaded as `sinks`)
        self.sinks: nn.Parameter | None = None
        if config.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(self.num_heads))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: int = 0) -> None:
        """The sinks (the one parameter of its own): this rank's heads'."""
        n = self.num_heads
        default_weight_loader(param, loaded.narrow(0, self.tp.rank * n, n), shard)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        num_tokens, dim = hidden.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden)
        if ctx.lora is not None:
            self.ops.lora_add(ctx.lora, self.layer_idx, "qkv_proj", hidden, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(num_tokens, self.num_heads, dim), k.reshape(num_tokens, -1, dim)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, dim))[0].view(num_tokens, self.num_heads, dim)
            k = self.k_norm(k.reshape(-1, dim))[0].view(num_tokens, self.num_kv_heads, dim)
        q, k = self.rotary_emb(positions, q, k)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        attn = self.ops.attention(
            q, k, v, k_cache, v_cache, ctx, self.scale, window=self.window, softcap=self.softcap,
            sinks=self.sinks,
        )  # fmt: skip
        attn = attn.reshape(num_tokens, self.q_size)
        out = self.o_proj(attn)
        if ctx.lora is not None:  # before the all-reduce: a row-parallel update is partial too
            self.ops.lora_add(ctx.lora, self.layer_idx, "o_proj", attn, out)
        return self.tp.all_reduce(out)


class MLP(OpsModule):
    """A gated MLP: down(act(gate(x)) * up(x)), gate and up as one fused projection; act is
    config.hidden_act, SiLU (SwiGLU) or tanh-approximated GELU (Gemma)."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TPGroup | None = None):
        super().__init__(ops)
        self.tp = tp = tp or TPGroup()
        self.layer_idx = 0  # its layer's index in the KV pool, set by DecoderLayer (LoRA's key)
        inter, bias = config.intermediate_size // tp.size, config.mlp_bias
        self.gate_up_proj = Linear(config.hidden_size, [inter, inter], bias, tp, "output")
        self.down_proj = Linear(inter, [config.hidden_size], bias, tp, "input")
        if config.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"hidden_act={config.hidden_act!r}: silu or gelu_pytorch_tanh")
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """lora: the step's adapters (engine.lora), whose updates the two projections add."""
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            self.ops.lora_add(lora, self.layer_idx, "gate_up_proj", x, gate_up)
        act = self.ops.gelu_tanh_and_mul(gate_up) if self.gelu else self.ops.silu_and_mul(gate_up)
        out = self.down_proj(act)
        if lora is not None:
            self.ops.lora_add(lora, self.layer_idx, "down_proj", act, out)
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual adds (Llama's layer). A family passes its own
    `attention` and `mlp` modules (default: Attention and MLP for config) and norm class."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        rotary: RotaryEmbedding,
        ops: LayerOps,
        tp: TPGroup | None = None,
        *,
        attention: nn.Module | None = None,
        mlp: nn.Module | None = None,
        norm: NormClass = RMSNorm,
    ):
        """layer_idx: the layer's index in this rank's KV pool (its stage's layers only)."""
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = norm(config.hidden_size, eps, ops)
        self.self_attn = attention or Attention(config, layer_idx, rotary, ops, tp)
        self.post_attention_layernorm = norm(config.hidden_size, eps, ops)
        self.mlp = mlp or MLP(config, ops, tp)
        if isinstance(self.mlp, MLP):  # LoRA finds the layer's adapter weights by this index
            self.mlp.layer_idx = layer_idx
        self.fused_decode: Any = None  # engine.cpu_fused.FusedDecode, where it runs this layer

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
        return self.run_mlp(hidden, ctx), residual

    def run_mlp(self, hidden: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """The MLP, with the step's LoRA updates where it is the dense MLP (an MoE block takes
        none: adapters for its experts are refused at load)."""
        if ctx.lora is not None and isinstance(self.mlp, MLP):
            return self.mlp(hidden, ctx.lora)
        return self.mlp(hidden)


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2 / 3: norms before and after both attention and MLP, the residual added after
    the post-norms:

        r = h + r;  h = post_attn_norm(attn(input_norm(r)))
        r = h + r;  h = post_ff_norm(mlp(pre_ff_norm(r)))
    """

    def __init__(self, config: ModelConfig, *args: object, **kwargs: object) -> None:
        super().__init__(config, *args, **kwargs)  # type: ignore[arg-type]
        norm = type(self.input_layernorm)
        ops, eps = self.input_layernorm.ops, config.rms_norm_eps
        self.pre_feedforward_layernorm = norm(config.hidden_size, eps, ops)
        self.post_feedforward_layernorm = norm(config.hidden_size, eps, ops)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: AttentionContext,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden, ctx))[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.run_mlp(hidden, ctx))[0], residual
