"""GGUF-quantized linear layers on the CPU (kernels/cpu_gguf.cpp, built at first use and cached,
keyed by its text: kernels/cpu_build.py): the weight stays in the blocks the GGUF file stores
(Q4_0, Q4_1, Q8_0, Q4_K), one row of W after another as uint8 [N, row_bytes].

`gguf_linear` quantizes x per block of 32 to int16 (or int8) and sums integer dot products
(AVX2, or AVX-512 VNNI where the CPU has it); from PREFILL_ROWS rows on it widens W to float32
once and runs torch's GEMM. `gguf_linear_reference` is its plain-torch twin (the gguf package's
dequantizer and a float32 matmul): the tests' ground truth and the path where the kernel cannot
run.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmserve.kernels import cpu_build

SOURCES = [
    Path(__file__).with_name(n)
    for n in ("cpu_gguf.cpp", "cpu_gguf_dot.h", "cpu_decode_layer.h", "cpu_decode_team.h")
]
CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")

# ggml type id -> (name, values per block, bytes per block)
FORMATS: dict[int, tuple[str, int, int]] = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
}


@functools.cache
def _module() -> Any:
    return cpu_build.load_extension("llmserve_cpu_gguf", SOURCES, CFLAGS)


@functools.cache
def unavailable() -> str | None:
    """Why the kernel cannot run here (None: it can; built on the first call)."""
    return cpu_build.why_unavailable("GGUF kernel", _module)


@functools.cache
def has_vnni() -> bool:
    """Whether the kernel's AVX-512 VNNI loops can run on this CPU."""
    return bool(_module().has_vnni())


def in_features(blocks: torch.Tensor, ggml_type: int) -> int:
    """K of a weight of `blocks` uint8 [N, row_bytes] in `ggml_type`."""
    _, elems, nbytes = FORMATS[ggml_type]
    if blocks.shape[1] % nbytes:
        raise ValueError(f"a {FORMATS[ggml_type][0]} row of {blocks.shape[1]} bytes")
    return blocks.shape[1] // nbytes * elems


# Activations per block of 32 as int16 by default: int8 (as llama.cpp) is faster but moved
# SmolLM2-135M's greedy tokens away from HF transformers' float32 ones (top-1 97% teacher-forced
# over llmserve/bench/quality.py's passages, against 100% for int16; docs/quantization.md).
ACT_BITS = 16

# From this many rows on (a prefill chunk), W is widened to float32 once and multiplied by torch's
# GEMM. Below, the dot products were as fast or faster on this 2-core AVX-512 VM (one thread, a
# [3072, 576] Q4_1 layer: 1.2 against 21.6 ms at 16 rows, 21 against 24 at 64; a heavily shared
# machine, so the cut is rough), as kernels/cpu.py's WIDEN_ROWS for int8.
PREFILL_ROWS = 128

# decode_layer on the blocks as one OpenMP region, its threads meeting at barriers that spin at
# most this many microseconds (a budget learned from the waits), then sleep
# (kernels/cpu_decode_team.h); off (LLMSERVE_CPU_ONE_REGION=0): a region per phase, five a layer,
# issue 42's before (`llmserve bench step --arms mode:auto mode:auto-regions`).
ONE_REGION = os.environ.get("LLMSERVE_CPU_ONE_REGION", "1") != "0"
SPIN_US = int(os.environ.get("LLMSERVE_CPU_SPIN_US", "20"))
_scratch: dict[tuple[int, int], torch.Tensor] = {}  # one per weight shape, shared by layers
# Weights larger (an LM head: SmolLM2's is 28M) always take the dot products: their float32
# scratch would stay resident (113 MB), and their few rows per step (sampled ones) rarely reach
# PREFILL_ROWS anyway.
MAX_WIDENED = 1 << 23
# The batch size oneDNN packs a dense weight for (pack_dense): its layout served 1 to 128 rows
# as fast as one packed for each (a [3072, 576] weight on this project's AMD EPYC VM).
DENSE_PACK_ROWS = 64


def gguf_linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: int,
    bias: torch.Tensor | None = None,
    vnni: bool | None = None,
    act_bits: int | None = None,
) -> torch.Tensor:
    """x [M, K] float32 times W^T (+ bias [N]), W in GGUF blocks `blocks` uint8 [N, row_bytes].
    vnni: the AVX-512 VNNI loops (default: where the CPU has them); act_bits: x quantized per
    block of 32 to int16 or int8 (default ACT_BITS)."""
    x = x.contiguous()
    shape = (blocks.shape[0], x.shape[1])
    if x.shape[0] >= PREFILL_ROWS and shape[0] * shape[1] <= MAX_WIDENED:
        if shape not in _scratch:
            _scratch[shape] = torch.empty(shape)
        _module().gguf_dequantize(blocks, ggml_type, _scratch[shape])
        return torch.nn.functional.linear(x, _scratch[shape], bias)
    vnni = has_vnni() if vnni is None else vnni
    y = _module().gguf_linear(x, blocks, ggml_type, vnni, act_bits or ACT_BITS)
    return y if bias is None else y + bias


def pack_dense(weight: torch.Tensor) -> torch.Tensor:
    """A dense weight [N, K] (float32 or bfloat16) prepacked for oneDNN's blocked GEMM, in the
    layout `dense_linear` and decode_layer's dense products read."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), DENSE_PACK_ROWS)


def dense_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] float32 times the `pack_dense` weight's transpose (+ bias), float32 out."""
    x = x.contiguous().to(packed.dtype)
    y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "").float()
    return y if bias is None else y + bias


def dequantize(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float32 [N, K] from the kernel's own widening (kernels/cpu_gguf.cpp)."""
    out = torch.empty(blocks.shape[0], in_features(blocks, ggml_type))
    _module().gguf_dequantize(blocks.contiguous(), ggml_type, out)
    return out


def dequantize_reference(blocks: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """float32 [N, K] through the gguf package's dequantizer."""
    import gguf

    data = gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.asarray(data, dtype=np.float32))


def gguf_linear_reference(
    x: torch.Tensor, blocks: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The same product in plain torch: the gguf package's dequantizer, then float32 matmul."""
    return torch.nn.functional.linear(x.float(), dequantize_reference(blocks, ggml_type), bias)


def decode_layer(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_w: torch.Tensor,
    post_norm_w: torch.Tensor,
    eps: float,
    blocks: list[torch.Tensor],
    fmts: list[int],
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One Llama decoder layer over B decode rows (kernels/cpu_decode_layer.h): (hidden,
    residual) for the next layer, the row's K and V stored at `slots`. The products are
    gguf_linear's dot products (VNNI where the CPU has it, ACT_BITS activations)."""
    out, new_residual = _module().decode_layer(
        x.contiguous(), residual, norm_w, post_norm_w, eps, blocks, fmts, cos_sin, positions,
        k_cache, v_cache, slots, block_tables, seq_lens, num_heads, scale, has_vnni(), ACT_BITS,
        ONE_REGION, SPIN_US,
    )  # fmt: skip
    return out, new_residual
