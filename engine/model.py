"""A Llama-family decoder written for this engine: one flattened forward over all of a step's
tokens (prefill chunks and decodes together), attention through the paged KV pool.

Covers the HF `LlamaForCausalLM` layout: GQA, RoPE (rope_theta, llama3 and linear scaling), RMSNorm,
SwiGLU, tied or untied embeddings, optional attention / MLP biases. q/k/v and gate/up projections
are fused into one matmul each at load time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from common.model_config import ModelConfig
from engine.ops import LayerOps, ReferenceOps


@dataclass
class AttentionContext:
    """Per-step attention metadata, built once by the runner and read by every layer.

    slot_mapping[t]: KV slot of token t; block_tables: [num_seqs, max_blocks]; seq_lens[b]: context
    length of request b including this step's tokens; cu_seqlens_q: B+1 offsets of each request's
    tokens in the flattened batch. kv_caches[layer] = (k_cache, v_cache).

    The CUDA kernels (engine.ops.KernelOps) read the same metadata from the device: seq_lens_t and
    cu_seqlens_q_t (int32), block_tables as int32, and the step's max_seqlen_q / max_seq_len, so
    they never synchronize. KernelOps.prepare fills these from the lists; a CUDA graph's context
    gives them as static buffers (and empty lists).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: list[int]
    cu_seqlens_q: list[int]
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    seq_lens_t: torch.Tensor | None = None
    cu_seqlens_q_t: torch.Tensor | None = None
    max_seqlen_q: int = 0
    max_seq_len: int = 0


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


class PackedLinear(nn.Module):
    """A float32 CPU linear layer on oneDNN's pre-packed weight layout.

    Plain `F.linear` repacks the weight on every call; for a decode step's few rows that costs as
    much as the product (measured here: 0.55 vs 1.1 ms for a [16, 576] x [576, 3072] layer).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = weight.shape[0]
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


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.scale = config.head_dim**-0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, config.attention_bias)
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, config.mlp_bias
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, config.mlp_bias)
        self.input_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.post_attention_norm = nn.Parameter(torch.ones(config.hidden_size))

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin_cache: torch.Tensor,
        ctx: AttentionContext,
        ops: LayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = ops.rms_norm(hidden, self.input_norm, self.eps, residual)
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = hidden.shape[0]
        q, k = ops.rotary(
            positions,
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
            cos_sin_cache,
        )
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        attn = ops.attention(q, k, v, k_cache, v_cache, ctx, self.scale)
        hidden = self.o_proj(attn.view(num_tokens, self.q_size))
        hidden, residual = ops.rms_norm(hidden, self.post_attention_norm, self.eps, residual)
        hidden = self.down_proj(ops.silu_and_mul(self.gate_up_proj(hidden)))
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.ops: LayerOps = ReferenceOps()  # build_model may swap in engine.ops.KernelOps
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self.register_buffer(
            "cos_sin_cache",
            rope_cos_sin_cache(rope_inv_freq(config), max_positions),
            persistent=False,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden_size] of a flattened batch."""
        ops = self.ops
        ctx = ops.prepare(ctx)
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, self.cos_sin_cache, ctx, ops)
        hidden, _ = ops.rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [rows, vocab_size] for the given hidden rows."""
        if isinstance(self.lm_head, PackedLinear):
            return self.lm_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return torch.nn.functional.linear(hidden, weight).float()

    def pack_cpu_linears(self) -> None:
        """Swap every projection (and the LM head) for a PackedLinear. CPU float32 only."""
        for layer in self.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                linear = getattr(layer, name)
                setattr(layer, name, PackedLinear(linear.weight, linear.bias))
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.lm_head = PackedLinear(weight, None)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Raises on missing tensors."""
        missing: list[str] = []

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                missing.append(name)
                return torch.zeros(0)
            return weights[name]

        def put(param: torch.Tensor, *names: str) -> None:
            tensors = [take(n) for n in names]
            if not missing:
                param.copy_(torch.cat(tensors, dim=0) if len(tensors) > 1 else tensors[0])

        cfg = self.config
        put(self.embed_tokens.weight, "model.embed_tokens.weight")
        put(self.norm, "model.norm.weight")
        if self.lm_head is not None:
            put(self.lm_head.weight, "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = [p + f"self_attn.{n}_proj" for n in "qkv"]
            put(layer.qkv_proj.weight, *(n + ".weight" for n in attn))
            put(layer.o_proj.weight, p + "self_attn.o_proj.weight")
            put(layer.gate_up_proj.weight, p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
            put(layer.down_proj.weight, p + "mlp.down_proj.weight")
            put(layer.input_norm, p + "input_layernorm.weight")
            put(layer.post_attention_norm, p + "post_attention_layernorm.weight")
            if cfg.attention_bias:
                put(layer.qkv_proj.bias, *(n + ".bias" for n in attn))
                put(layer.o_proj.bias, p + "self_attn.o_proj.bias")
            if cfg.mlp_bias:
                put(layer.gate_up_proj.bias, p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias")
                put(layer.down_proj.bias, p + "mlp.down_proj.bias")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        if "rope_freqs" in weights:
            inv_freq = rope_inv_freq(cfg, weights["rope_freqs"])
            self.cos_sin_cache.copy_(rope_cos_sin_cache(inv_freq, self.max_positions))


def build_model(
    config: ModelConfig,
    weights: dict[str, torch.Tensor] | None,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    dummy_seed: int = 0,
    ops: LayerOps | None = None,
) -> LlamaForCausalLM:
    """Allocate on the meta device, materialize on `device` directly in `dtype` (never a float32
    copy first), then load `weights`, or, when it is None, fill in engine.dummy's seeded values.
    `ops`: the layer ops backend (default: kernels/reference.py)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions)
    model = model.to(dtype).to_empty(device=device)
    model.cos_sin_cache = rope_cos_sin_cache(rope_inv_freq(config), max_positions).to(device)
    if weights is None:
        from engine.dummy import init_dummy_weights

        init_dummy_weights(model, dummy_seed)
    else:
        model.load_weights(weights)
    if ops is not None:
        model.ops = ops
    model = model.eval().requires_grad_(False)
    if device.type == "cpu" and dtype == torch.float32 and can_pack_cpu_linears():
        model.pack_cpu_linears()
    return model
