"""--quantization gguf: linear layers whose weights stay in the blocks the GGUF file stores them in
(Q4_0, Q4_1, Q8_0, Q4_K), multiplied by kernels/cpu_gguf.cpp on the CPU. A Q4_1 projection
reads 0.625 bytes per weight where the int8 form (engine/quant.py) reads 1.25.

`replace_gguf_linears` swaps them into a loaded model: each Linear takes the file's blocks of the
HF tensors it stacks (q, k and v; gate and up), the LM head those of the output tensor or, tied,
of the embeddings, which stay in their blocks too (GGUFEmbedding). A layer whose tensors are
stored otherwise (float, another block type, or parts of different types) becomes an Int8Linear
instead.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from common.log import get_logger
from engine.layers import Linear
from engine.model import LlamaForCausalLM
from engine.quant import Int8Linear
from kernels import cpu_gguf


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
        if gguf_kernel_missing():
            self.dense = cpu_gguf.dequantize_reference(self.blocks, ggml_type)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        if self.dense is None:
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


class GGUFBlocks:
    """What replace_gguf_linears reads: a GGUF tensor's blocks by HF name, (ggml type, uint8
    [rows, row_bytes]) in the model's row order, or None where it is stored unquantized or in a
    block type the kernel lacks (engine/weights.py's GGUF loader is one)."""

    def holds(self, name: str) -> bool:
        """Whether the file holds this HF tensor (Phi-3's holds qkv_proj, not q_proj)."""
        raise NotImplementedError

    def blocks(self, name: str) -> tuple[int, torch.Tensor] | None:
        raise NotImplementedError


def _make(
    source: GGUFBlocks, names: list[str], weight: torch.Tensor, bias: torch.Tensor | None
) -> nn.Module:
    parts = [source.blocks(name) for name in names]
    types = {part[0] for part in parts if part is not None}
    if None in parts or len(types) != 1:
        return Int8Linear(weight, bias)
    blocks = torch.cat([part[1] for part in parts if part is not None])
    return GGUFLinear(blocks, types.pop(), bias)


def replace_gguf_linears(model: LlamaForCausalLM, source: GGUFBlocks) -> None:
    """Swap every Linear of the loaded model, the LM head included, for a GGUFLinear (an
    Int8Linear where the file's blocks cannot serve it), and the embeddings, where the file
    stores them in blocks, for a GGUFEmbedding. A whole model only: a tensor-parallel
    rank's slice of K would cut blocks."""
    assert model.shard.tp.size == 1, "GGUF blocks are not split across tensor-parallel ranks"
    names: dict[int, list[str]] = {}  # id(Linear) -> the HF tensors its weight stacks, in order
    for name, module, param, _ in model.hf_tensors():
        if isinstance(module, Linear) and param is module.weight:
            names.setdefault(id(module), []).append(name)
    for name, module in list(model.named_modules()):
        if isinstance(module, Linear):
            parent, _, leaf = name.rpartition(".")
            parts = names[id(module)]
            if not all(source.holds(part) for part in parts):  # stored fused (Phi-3's qkv)
                parts = [f"model.{name}.weight"]
            layer = _make(source, parts, module.weight, module.bias)
            setattr(model.get_submodule(parent), leaf, layer)
    embed = None if model.embed_tokens is None else source.blocks("model.embed_tokens.weight")
    if model.lm_head is None and model.norm is not None:  # tied: the embeddings' blocks
        model.lm_head = (
            Int8Linear(model.embed_tokens.weight, None)
            if embed is None
            else GGUFLinear(embed[1], embed[0], None)
        )
    if embed is not None:
        model.embed_tokens = GGUFEmbedding(embed[1], embed[0])  # type: ignore[assignment]
