"""A decode step of a few calls on the CPU: each Llama decoder layer of a decode-only step runs as
one C++ operator (kernels/cpu_decode_layer.h, in the GGUF kernel's library): norm, qkv, rotary,
KV store, paged attention over each row's blocks, output projection, residual, norm and MLP,
where the torch path makes about thirty calls per layer (each a dispatch, many an OpenMP region).

Used on the gguf path for decode-only steps: on the blocks for fewer rows than
kernels.cpu_gguf.PREFILL_ROWS (the same dot products as the torch path's GGUFLinear), or of any
number on the dense copies where --quantization auto made them (engine/model/cpu_weights.py) and the
step has enough rows; a step with prefill chunks, padding rows or LoRA takes the layers' own path.
`install_fused_decode` gives every layer that qualifies (`why_not_fused`) its FusedDecode.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from llmserve.engine.model.attention_context import AttentionContext
from llmserve.engine.model.cpu_weights import WeightPath
from llmserve.engine.model.gguf_linear import GGUFLinear
from llmserve.engine.model.layers import MLP, Attention, DecoderLayer, RMSNorm
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.kernels import cpu_gguf

# Off: every layer takes its torch path (the tests compare the two).
ENABLED = True


def why_not_fused(layer: nn.Module) -> str | None:
    """Why decode_layer cannot run this layer (None: it can)."""
    if type(layer) is not DecoderLayer:
        return f"{type(layer).__name__} is not a plain DecoderLayer"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not Attention or type(mlp) is not MLP or mlp.gelu:
        return "attention or MLP of another kind"
    if attn.qk_norm or attn.window is not None or attn.softcap is not None or attn.tp.size > 1:
        return "q/k norms, a window, soft-capped scores or tensor parallelism"
    if attn.rotary_emb.rotary_dim != attn.head_dim:
        return "partial rotary"
    for norm in (layer.input_layernorm, layer.post_attention_layernorm):
        if not isinstance(norm, RMSNorm) or norm.weight.dtype != torch.float32:
            return "a norm of another kind or dtype"
    for proj in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if not isinstance(proj, GGUFLinear) or proj.dense is not None or proj.bias is not None:
            return "a projection not on GGUF blocks through the kernel, or with a bias"
    return None


class FusedDecode:
    """One layer's decode_layer call: its weights gathered once; `__call__` as
    DecoderLayer.forward for the rows of a decode-only step."""

    def __init__(self, layer: DecoderLayer):
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(attn, Attention) and isinstance(mlp, MLP)
        self.layer = layer
        self.attn = attn
        projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        self.blocks = [p.blocks for p in projections if isinstance(p, GGUFLinear)]
        self.fmts = [p.ggml_type for p in projections if isinstance(p, GGUFLinear)]
        # the dense copies (engine/model/cpu_weights.py), where every projection has one
        fast = [p.fast for p in projections if isinstance(p, GGUFLinear)]
        self.fast = fast if all(f is not None for f in fast) else None
        self.eps = layer.input_layernorm.eps
        # what each call reads, held here: every nn.Module attribute lookup is a __getattr__
        # call, three or more a layer and thirty layers a step (the loaded weights: this runs
        # once they are final, as the blocks above)
        self.norm_w = layer.input_layernorm.weight
        self.post_norm_w = layer.post_attention_layernorm.weight
        self.cos_sin = attn.rotary_emb.cos_sin_cache
        self.layer_idx, self.num_heads, self.scale = attn.layer_idx, attn.num_heads, attn.scale

    def __call__(
        self,
        positions: Tensor,
        hidden: Tensor,
        residual: Tensor | None,
        ctx: AttentionContext,
        rows: DecodeRows,
    ) -> tuple[Tensor, Tensor]:
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        return cpu_gguf.decode_layer(  # type: ignore[no-any-return]
            hidden, residual, self.norm_w, self.post_norm_w,
            self.eps, self.fast if rows.dense and self.fast else self.blocks, self.fmts,
            self.cos_sin, positions if positions.dtype is torch.int64 else positions.long(),
            k_cache, v_cache, rows.slots, rows.block_tables, rows.seq_lens,
            self.num_heads, self.scale,
        )  # fmt: skip


class DecodeRows:
    """A decode-only step's metadata as decode_layer reads it (int64, one entry per row), made
    once per step by `decode_rows`."""

    def __init__(self, slots: Tensor, block_tables: Tensor, seq_lens: Tensor, dense: bool):
        self.dense = dense  # the layers' dense copies, not their blocks
        self.slots = slots
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        # each layer's FusedDecode by index, None where it has none (StepRows sets it)
        self.layers: list[FusedDecode | None] = []


class StepRows:
    """The model's `fused_rows`: asked once per step, it counts the step on the weight path
    (engine/model/cpu_weights.py) and gives decode_rows' answer."""

    def __init__(self, path: WeightPath | None, layers: list[FusedDecode | None]):
        self.path = path
        self.layers = layers

    def __call__(self, ctx: AttentionContext, num_rows: int) -> DecodeRows | None:
        dense = self.path is not None and self.path.count(num_rows)
        rows = decode_rows(ctx, num_rows, dense)
        if rows is not None:
            rows.layers = self.layers
        return rows


def decode_rows(ctx: AttentionContext, num_rows: int, dense: bool = False) -> DecodeRows | None:
    """The step's DecodeRows where the fused layers can run it: every request one query, no
    padding rows, no adapters, a float32 KV pool, and on the blocks (not `dense`) fewer rows
    than the products widen at; else None."""
    if not ENABLED or ctx.lora is not None or (num_rows >= cpu_gguf.PREFILL_ROWS and not dense):
        return None
    if not ctx.kv_caches or ctx.kv_caches[0][0].dtype != torch.float32:
        return None
    if list(ctx.cu_seqlens_q) != list(range(num_rows + 1)):
        return None
    slots = ctx.slot_mapping.long()
    if num_rows == 0 or bool((slots < 0).any()):
        return None
    return DecodeRows(
        slots.contiguous(),
        ctx.block_tables[:num_rows].long().contiguous(),
        torch.tensor(ctx.seq_lens, dtype=torch.int64),
        dense,
    )


def install_fused_decode(model: LlamaForCausalLM) -> int:
    """Give every layer of `model` that qualifies its FusedDecode (DecoderLayer.fused_decode)
    and the model `decode_rows`, which its forward asks once per step; the number of layers
    fused. Where the kernel cannot run, none."""
    if cpu_gguf.unavailable() is not None:
        return 0
    fused = 0
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and why_not_fused(layer) is None:
            layer.fused_decode = FusedDecode(layer)
            fused += 1
    by_index = [getattr(layer, "fused_decode", None) for layer in model.layers]
    path = getattr(model, "weight_path", None)
    model.fused_rows = StepRows(path, by_index) if fused else None
    return fused
