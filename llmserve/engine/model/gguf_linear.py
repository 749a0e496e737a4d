"""--quantization gguf: linear layers whose weights stay in the blocks the GGUF file stores them in
(Q4_0, Q4_1, Q8_0, Q4_K), multiplied by kernels/cpu_gguf.cpp on the CPU. A Q4_1 projection
reads 0.625 bytes per weight where the int8 form (engine/model/quant.py) reads 1.25.

`keep_gguf_blocks` swaps them into a model before its load (so no float32 copy of them is ever
made): each Linear takes the file's blocks of the HF tensors it stacks (q, k and v; gate and up),
the LM head those of the output tensor or, tied, of the embeddings, which stay in their blocks
too (GGUFEmbedding). A layer whose tensors are stored otherwise (float, another block type, or
parts of different types) loads as float and becomes an Int8Linear after (`quantize_rest`).
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Mapping

import torch
from torch import nn

from llmserve.common.log import get_logger
from llmserve.engine.model.layers import Linear
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.quant import Int8Linear
from llmserve.kernels import cpu_gguf


@functools.cache
def gguf_kernel_missing() -> str | None:
    """Why kernels/cpu_gguf.cpp cannot run here (said once, in the log), or None."""
    why = cpu_gguf.unavailable()
    if why is not None:
        get_logger("engine").warning("GGUF linears run in plain torch (slow)", why=why)
    return why


class GGUFLinear(nn.Module):
    """y = x W^T + b with W as GGUF blocks `blocks` uint8 [N, row_bytes] of `ggml_type`. Where the
    kernel cannot run, W is widened to float32 once and multiplied by torch."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None):
        super().__init__()
        if ggml_type not in cpu_gguf.FORMATS:
            raise ValueError(f"GGUFLinear: ggml type {ggml_type} is not one of {cpu_gguf.FORMATS}")
        self.blocks = blocks.contiguous()
        self.ggml_type = ggml_type
        self.in_features = cpu_gguf.in_features(blocks, ggml_type)
        self.bias = None if bias is None else bias.detach().float().clone()
        self.dense: torch.Tensor | None = None
        # engine/model/cpu_weights.py: a oneDNN-packed dense copy that steps of fast_rows rows or
        # more multiply instead of the blocks (--quantization auto, within its memory budget)
        self.fast: torch.Tensor | None = None
        self.fast_rows = 0
        if gguf_kernel_missing():
            self.dense = cpu_gguf.dequantize_reference(self.blocks, ggml_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.fast is not None and rows.shape[0] >= self.fast_rows:
            out = cpu_gguf.dense_linear(rows, self.fast, self.bias)
        elif self.dense is None:
            out = cpu_gguf.gguf_linear(rows, self.blocks, self.ggml_type, self.bias)
        else:
            out = nn.functional.linear(rows, self.dense, self.bias)
        return out.to(x.dtype).view(*x.shape[:-1], -1)


class GGUFEmbedding(nn.Module):
    """Token embeddings kept in GGUF blocks `blocks` uint8 [vocab, row_bytes]: a lookup widens
    only the rows of the tokens asked for (a Q8_0 table of SmolLM2's 49152 x 576 is 30 MB where
    float32 is 113; tied, the LM head reads the same blocks)."""

    def __init__(self, blocks: torch.Tensor, ggml_type: int):
        super().__init__()
        self.blocks = blocks.contiguous()
        self.ggml_type = ggml_type
        self.num_rows = blocks.shape[0]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, input_ids.reshape(-1))
        if gguf_kernel_missing():
            out = cpu_gguf.dequantize_reference(rows, self.ggml_type)
        else:
            out = cpu_gguf.dequantize(rows, self.ggml_type)
        return out.view(*input_ids.shape, -1)


class GGUFBlocks(abc.ABC):
    """What keep_gguf_blocks reads: a GGUF tensor's blocks by HF name, (ggml type, uint8
    [rows, row_bytes]) in the model's row order, or None where it is stored unquantized or in a
    block type the kernel lacks (engine/model/weights.py's GGUF loader is one)."""

    @abc.abstractmethod
    def holds(self, name: str) -> bool:
        """Whether the file holds this HF tensor (Phi-3's holds qkv_proj, not q_proj)."""

    @abc.abstractmethod
    def blocks(self, name: str) -> tuple[int, torch.Tensor] | None:
        raise NotImplementedError


def _gguf_linear(
    source: GGUFBlocks, weights: Mapping[str, torch.Tensor], names: dict[str, list[str]]
) -> GGUFLinear | None:
    """A GGUFLinear on the file's blocks of the HF tensors `names["weight"]` stacks (with the
    float biases `names["bias"]`), or None where they are not all blocks of one type."""
    parts = [source.blocks(name) for name in names["weight"]]
    types = {part[0] for part in parts if part is not None}
    if None in parts or len(types) != 1 or not all(n in weights for n in names["bias"]):
        return None
    blocks = torch.cat([part[1] for part in parts if part is not None])
    bias = torch.cat([weights[n] for n in names["bias"]]) if names["bias"] else None
    return GGUFLinear(blocks, types.pop(), bias)


def keep_gguf_blocks(
    model: LlamaForCausalLM, source: GGUFBlocks, weights: Mapping[str, torch.Tensor]
) -> None:
    """Before the load: swap every Linear whose tensors the file stores in the kernel's blocks
    for a GGUFLinear on them, and embeddings so stored for a GGUFEmbedding (a tied LM head: a
    GGUFLinear on the same blocks), so that the load never widens them to float32 (the model
    would hold 4 bytes per weight at its peak). The Linears left load as float; then
    `quantize_rest`. A whole model only: a tensor-parallel rank's slice of K would cut
    blocks."""
    assert model.shard.tp.size == 1, "GGUF blocks are not split across tensor-parallel ranks"
    names: dict[int, dict[str, list[str]]] = {}  # id(Linear) -> its weight's, its bias's tensors
    for name, module, param, _ in model.hf_tensors():
        if isinstance(module, Linear):
            kind = "weight" if param is module.weight else "bias"
            names.setdefault(id(module), {"weight": [], "bias": []})[kind].append(name)
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear) and id(module) in names:
            parts = names[id(module)]
            if not all(source.holds(part) for part in parts["weight"]):  # stored fused (Phi-3)
                parts = {**parts, "weight": [f"model.{name}.weight"]}
            layer = _gguf_linear(source, weights, parts)
            if layer is not None:
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, layer)
    embed = None if model.embed_tokens is None else source.blocks("model.embed_tokens.weight")
    if embed is not None:
        if model.lm_head is None and model.norm is not None:  # tied: the embeddings' blocks
            model.lm_head = GGUFLinear(embed[1], embed[0], None)
        model.embed_tokens = GGUFEmbedding(embed[1], embed[0])  # type: ignore[assignment]


def quantize_rest(model: LlamaForCausalLM) -> None:
    """After the load: every Linear keep_gguf_blocks left (stored as float or in another block
    type) becomes an Int8Linear, and a tied LM head over float embeddings one too."""
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, Int8Linear(module.weight, module.bias))
    if model.lm_head is None and model.norm is not None:
        model.lm_head = Int8Linear(model.embed_tokens.weight, None)
