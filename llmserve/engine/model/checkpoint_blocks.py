"""W4A16 / W8A16 checkpoints (GPTQ, AWQ, compressed-tensors int) kept quantized on the CPU: each
projection's integer weight w = s * (q - z) is rewritten, once at load, into the blocks of 32 that
kernels/cpu_gguf.cpp multiplies (engine/model/gguf_linear.py's GGUFLinear):

- int4 whose q - z lies in -8..7 (symmetric) as Q4_0: d = s, nibble = q - z + 8;
- other int4 (asymmetric) as Q4_1: d = s, m = s * min(q - z) over the block, nibble = q - z - min;
- int8 whose q - z lies in -128..127 as Q8_0: d = s, value = q - z.

A group of 64 or 128 is 2 or 4 blocks with the same scale, so this is exact up to d and m being
stored as float16 (the blocks' layout, the kernel's in-memory form too): float16 scales (GPTQ's,
AWQ's) are kept exactly, bfloat16 ones too within float16's range; float32 ones and Q4_1's m round
to 11 significant bits. A projection whose scale changes inside a block of 32 (act-order g_idx
whose groups do not fall on whole blocks, a group size not a multiple of 32) or whose values do
not fit is not rewritten: it loads dequantized to float, as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from llmserve.engine.model.checkpoint_formats import CheckpointView
from llmserve.engine.model.checkpoint_schemes import Awq, CompressedTensors, Gptq, WeightScheme
from llmserve.engine.model.gguf_linear import GGUFBlocks

Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK = 32


def _half_bytes(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2]: float16 values, little-endian (as GGUF stores them)."""
    return values.half().contiguous().view(torch.uint8).view(*values.shape, 2)


def _nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 16]: a block's 32 values 0..15, value j in the low nibble of byte j and
    value j + 16 in its high nibble (ggml's Q4_0 / Q4_1 order)."""
    v = values.to(torch.uint8)
    return v[..., :16] | (v[..., 16:] << 4)


def gguf_blocks(
    weight: torch.Tensor, scale: torch.Tensor, bits: int
) -> tuple[int, torch.Tensor] | None:
    """(ggml type, uint8 [N, row_bytes]) holding `weight` float32 [N, K] = scale * integers,
    `scale` float32 [N, K] the weight's own scale per element; None where it cannot be held
    exactly (see the module's text)."""
    n, k = weight.shape
    if k % BLOCK or bits not in (4, 8):
        return None
    s = scale.reshape(n, k // BLOCK, BLOCK)
    d = s[..., 0]
    if not bool((s == d.unsqueeze(-1)).all()):
        return None
    safe = torch.where(d == 0, torch.ones_like(d), d).unsqueeze(-1)
    v = torch.round(weight.reshape(n, k // BLOCK, BLOCK) / safe)
    if not torch.allclose(v * d.unsqueeze(-1), weight.reshape(v.shape), rtol=1e-5, atol=0):
        return None  # not integers times the scale
    if bits == 8:
        if v.min() < -128 or v.max() > 127:
            return None
        parts = [_half_bytes(d), v.to(torch.int8).view(torch.uint8)]
        return Q8_0, torch.cat(parts, dim=-1).reshape(n, -1)
    if v.min() >= -8 and v.max() <= 7:
        parts = [_half_bytes(d), _nibbles(v + 8)]
        return Q4_0, torch.cat(parts, dim=-1).reshape(n, -1)
    low = v.amin(-1, keepdim=True)
    if (v.amax(-1, keepdim=True) - low).max() > 15:
        return None
    parts = [_half_bytes(d), _half_bytes(d * low.squeeze(-1)), _nibbles(v - low)]
    return Q4_1, torch.cat(parts, dim=-1).reshape(n, -1)


class CheckpointBlocks(GGUFBlocks, Mapping[str, torch.Tensor]):
    """A quantized checkpoint's tensors (`view`) as engine/model/gguf_linear.py's keep_gguf_blocks
    reads them: each projection that gguf_blocks can hold, in the kernel's blocks; the rest as the
    view gives them (dequantized to float). `kept` counts the projections held per ggml type."""

    def __init__(self, view: CheckpointView):
        self.view = view
        self.kept: dict[int, int] = {}

    def holds(self, name: str) -> bool:
        return name in self.view

    def blocks(self, name: str) -> tuple[int, torch.Tensor] | None:
        stem = self.view.quantized.get(name)
        if stem is None:
            return None
        fmt, view = self.view.fmt, self.view

        def get(suffix: str) -> torch.Tensor | None:
            return view._stored(stem + suffix)

        form = fmt.scale_form(stem, get)
        if form is None:
            return None
        held = gguf_blocks(fmt.dequantize(stem, get), *form)
        if held is not None:
            self.kept[held[0]] = self.kept.get(held[0], 0) + 1
        return held

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.view[name]

    def __contains__(self, name: object) -> bool:
        return name in self.view

    def __iter__(self) -> Iterator[str]:
        return iter(self.view)

    def __len__(self) -> int:
        return len(self.view)


def can_keep(fmt: WeightScheme) -> bool:
    """Whether a checkpoint of scheme `fmt` has integer weights gguf_blocks may hold."""
    if isinstance(fmt, Gptq):
        return fmt.bits in (4, 8)
    if isinstance(fmt, CompressedTensors):
        return any(g.type == "int" and g.strategy in ("group", "channel") for g in fmt.groups)
    return isinstance(fmt, Awq)
