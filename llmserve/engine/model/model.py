"""A Llama-family decoder written for this engine: one flattened forward over all of a step's
tokens (prefill chunks and decodes together), attention through the paged KV pool.

Covers the HF `LlamaForCausalLM` layout: GQA, RoPE (rope_theta, llama3 and linear scaling), RMSNorm,
SwiGLU, tied or untied embeddings, optional attention / MLP biases. Parameters are named as HF's,
less the `model.` prefix, except that q/k/v and gate/up are fused into one projection each
(FUSED), filled shard by shard at load time.

The other families (common/families/, engine/model/families/) are this class with their own layers:
a subclass overrides `make_attention`, `make_mlp` or `make_layer` (and `norm_class`), and the
config's data (biases, windows, soft-caps, scales) does the rest. See
engine/model/families/README.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from llmserve.common.model_config import ModelConfig
from llmserve.engine.model.layers import (
    MLP,
    Attention,
    AttentionContext,
    DecoderLayer,
    Linear,
    NormClass,
    OpsModule,
    RMSNorm,
    RotaryEmbedding,
    VocabEmbedding,
    default_weight_loader,
)
from llmserve.engine.model.ops import LayerOps, ReferenceOps
from llmserve.engine.parallel.groups import ModelShard, TPGroup, whole_model

# Our fused projections and the HF tensors stacked into each, in row order.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class LlamaForCausalLM(nn.Module):
    norm_class: NormClass = RMSNorm  # every RMSNorm of the model (Gemma: (1 + w))

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        ops: LayerOps | None = None,
        shard: ModelShard | None = None,
    ):
        """ops: the layer ops backend of every module (default: kernels/reference.py). shard:
        the layers this rank holds, split across its tensor-parallel group (default: all,
        whole); layers of other stages are empty modules, so parameter names stay HF's."""
        super().__init__()
        # engine.cpu_fused.decode_rows where layers run fused on decode-only steps
        self.fused_rows: Callable[[AttentionContext, int], Any] | None = None
        self.weight_path: Any = None  # engine.cpu_weights.WeightPath on GGUF blocks
        ops = ReferenceOps() if ops is None else ops
        self.shard = shard = shard or whole_model(config.num_layers)
        tp = shard.tp
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        # a model none of whose layers rotate (Granite 4.0-H, Nemotron-H) keeps no cos/sin table:
        # llama.cpp's converter writes their context as 2^20, 512 MiB of table at head_dim 128
        rotates = len(set(config.nope_layers)) < config.num_layers
        self.rotary_emb = RotaryEmbedding(config, max_positions if rotates else 1, ops)
        # Gemma 3's sliding layers rotate with their own base.
        self.rotary_local: RotaryEmbedding | None = None
        if config.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(config, max_positions, ops, local=True)
        start = shard.layers.start
        self.layers = nn.ModuleList(
            self.make_layer(config, i, i - start, ops, tp) if i in shard.layers else nn.Module()
            for i in range(config.num_layers)
        )
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, ops)
        # Tied embeddings: no head of its own (a shared Parameter would not survive to_empty),
        # unless the embeddings live on another stage.
        self.lm_head: nn.Module | None = None
        vocab_rows = self.embed_tokens.num_rows
        if not config.tie_word_embeddings or not shard.first:
            self.lm_head = Linear(config.hidden_size, [vocab_rows], False, tp, "output")
        if not shard.first:
            del self.embed_tokens
            self.embed_tokens = None  # type: ignore[assignment]
        if not shard.last:
            del self.norm
            self.norm = None  # type: ignore[assignment]
            self.lm_head = None

    def rotary_for(self, layer: int) -> RotaryEmbedding:
        """The rotary embedding of layer `layer` (of the whole model)."""
        if self.rotary_local is not None and self.config.is_sliding(layer):
            return self.rotary_local
        return self.rotary_emb

    def make_layer(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        """Layer `layer` of the whole model, `local` in this rank's KV pool: a DecoderLayer of
        make_attention's and make_mlp's modules. A family overrides any of the three to declare
        its own layers (an MoE family: make_mlp for its sparse layers)."""
        return DecoderLayer(
            config, local, self.rotary_for(layer), ops, tp,
            attention=self.make_attention(config, layer, local, ops, tp),
            mlp=self.make_mlp(config, layer, ops, tp),
            norm=self.norm_class,
        )  # fmt: skip

    def make_attention(
        self, config: ModelConfig, layer: int, local: int, ops: LayerOps, tp: TPGroup
    ) -> nn.Module:
        """Layer `layer`'s attention (its window from config)."""
        window = config.layer_window(layer)
        return Attention(config, local, self.rotary_for(layer), ops, tp, window=window)

    def make_mlp(self, config: ModelConfig, layer: int, ops: LayerOps, tp: TPGroup) -> nn.Module:
        """Layer `layer`'s MLP (dense: MLP)."""
        return MLP(config, ops, tp)

    @property
    def ops(self) -> LayerOps:
        return self.rotary_emb.ops

    def set_ops(self, ops: LayerOps) -> None:
        """Run every module through `ops` from the next forward on."""
        for module in self.modules():
            if isinstance(module, OpsModule):
                module.ops = ops

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        carried: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's stage of a flattened batch, from input_ids (the first stage) or `carried`,
        the previous stage's output. The last stage returns the final hidden states
        [num_tokens, hidden_size]; the others stack(hidden, residual) [2, num_tokens,
        hidden_size] for the next one."""
        hidden, residual = self.run_layers(input_ids, positions, ctx, carried)
        if self.norm is None:
            return torch.stack((hidden, residual))
        return self.norm(hidden, residual)[0]

    def run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: AttentionContext,
        carried: torch.Tensor | None = None,
        layers: range | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) after `layers` (default: this rank's), before the final norm, from
        input_ids' embeddings or `carried` (see forward). A draft runs the first layers only.
        The ops backend prepares ctx once for all layers (not when every layer runs fused:
        those read the step's DecodeRows instead)."""
        # a decode-only step the fused layers take (engine/model/cpu_fused.py), or None
        rows = None if self.fused_rows is None else self.fused_rows(ctx, positions.shape[0])
        fused_layers = None if rows is None else rows.layers
        indices = self.shard.layers if layers is None else layers
        if fused_layers is None or any(fused_layers[i] is None for i in indices):
            ctx = self.ops.prepare(ctx)  # for the layers' own attention: fused ones skip it
        residual: torch.Tensor | None = None
        if carried is None:
            hidden = self.embed_tokens(input_ids)
            if self.config.embed_scale is not None:  # Gemma: rounded to the model's dtype first
                hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        else:
            hidden, residual = carried[0], carried[1]
        for i in indices:
            fused = None if fused_layers is None else fused_layers[i]
            if fused is not None:
                hidden, residual = fused(positions, hidden, residual, ctx, rows)
            else:
                hidden, residual = self.layers[i](positions, hidden, residual, ctx)
        assert residual is not None, "a stage without layers"
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [rows, vocab_size] for the given hidden rows (last stage; with tensor
        parallelism every rank of the stage computes its vocabulary slice and gets them all)."""
        if self.lm_head is None:
            logits = nn.functional.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        logits = self.shard.tp.all_gather(logits.float())[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def replace_linears(
        self, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]
    ) -> None:
        """Swap every Linear, the LM head included (a tied one reads the embedding), for
        make(weight, bias): a PackedLinear or a quantized linear (engine/model/quant.py). They copy
        the weights, so this comes after loading them."""
        for name, module in list(self.named_modules()):
            if isinstance(module, Linear):
                parent, _, leaf = name.rpartition(".")
                setattr(self.get_submodule(parent), leaf, make(module.weight, module.bias))
        if self.lm_head is None and self.norm is not None:
            self.lm_head = make(self.embed_tokens.weight, None)

    def hf_tensors(self) -> Iterator[tuple[str, nn.Module, nn.Parameter, int]]:
        """(HF name, module, parameter, shard) for every tensor of HF's checkpoint this rank
        holds, in parameter order: the tensor fills shard `shard` of the module's parameter (0
        unless fused). A tied LM head on a stage without the embeddings reads them."""
        tied = self.config.tie_word_embeddings
        for name, module in self.named_modules():
            leaf = name.rpartition(".")[2]
            stem = ("" if name == "lm_head" else "model.") + name.removesuffix(leaf)
            for kind, param in module.named_parameters(recurse=False):
                if name == "lm_head" and tied:
                    yield "model.embed_tokens.weight", module, param, 0
                    continue
                for shard, part in enumerate(FUSED.get(leaf, (leaf,))):
                    yield f"{stem}{part}.{kind}", module, param, shard

    def checkpoint_view(self, weights: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The checkpoint's tensors under the names hf_tensors asks for (a family whose
        checkpoint fuses what this model loads in parts, Phi-3, splits them here)."""
        return weights

    @torch.no_grad()
    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named tensors in through each module's weight_loader; a llama3 GGUF's
        `rope_freqs` recomputes the rotary cache. Raises, loading nothing, when one is missing;
        tensors the model does not use are ignored."""
        weights = self.checkpoint_view(weights)
        targets = list(self.hf_tensors())
        missing = [name for name, *_ in targets if name not in weights]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
        for name, module, param, shard in targets:
            getattr(module, "weight_loader", default_weight_loader)(param, weights[name], shard)
        if "rope_freqs" in weights:
            self.rotary_emb.reset(weights["rope_freqs"])

    def reset_rotary(self) -> None:
        """Recompute every rotary cache (after materializing the model)."""
        for module in self.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset()
