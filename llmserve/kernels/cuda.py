"""The CUDA kernels of kernels/*.cu, one import away: `import llmserve.kernels.cuda as kc;
kc.paged_attention(...)`. This module re-exports the wrappers, which live by concern:
kernels/launch.py (NVRTC compilation through CuPy, caching, launching, the shared argument
checks), attention.py (store_kv, paged decode and prefill attention), layer_ops.py (rms_norm,
rotary_embedding, silu_and_mul), int8.py, w4a16.py and fp8_block.py (quantized checkpoints'
linears), moe.py, lora.py, mla.py (MLA decode over the latent pool), gated_delta.py (Qwen3-Next's
linear attention, one decode step) and ssd_step.py (Mamba-2's, likewise).

Each public function mirrors one in kernels/reference.py and checks its arguments before
launching (ValueError naming the argument, its value and the limit). Importing this module needs
neither CuPy nor a GPU; `is_available()` says whether the kernels can run.
"""

from __future__ import annotations

from llmserve.kernels import fp8_block, int8, w4a16
from llmserve.kernels.attention import (
    DECODE_THREADS,
    DECODE_TILE,
    HEAD_DIMS,
    LOG2E,
    PREFILL_CONFIGS,
    PREFILL_DEFAULT_BLOCK_M,
    decode_ctas_per_seq,
    decode_num_splits,
    decode_slots,
    decode_smem_bytes,
    decode_spec,
    paged_attention,
    paged_decode_attention,
    paged_prefill_attention,
    prefill_expr,
    prefill_smem_bytes,
    prefill_spec,
    store_kv,
    store_kv_spec,
)
from llmserve.kernels.fp8_block import fp8_block_linear
from llmserve.kernels.gated_delta import gated_delta_spec, gated_delta_step
from llmserve.kernels.int8 import int8_gemm_spec, int8_linear
from llmserve.kernels.launch import (
    _CTYPES,
    _INDEX_CTYPES,
    DEFAULT_SMEM_LIMIT,
    FP8_CTYPE,
    KERNEL_DIR,
    NVRTC_OPTIONS,
    ModuleSpec,
    _external_stream,
    _fail,
    _kernel,
    _module,
    is_available,
    load_source,
)
from llmserve.kernels.layer_ops import layer_ops_spec, rms_norm, rotary_embedding, silu_and_mul
from llmserve.kernels.lora import lora_add, lora_spec
from llmserve.kernels.mla import mla_decode_attention, mla_spec
from llmserve.kernels.moe import moe_experts, moe_spec
from llmserve.kernels.ssd_step import ssd_step, ssd_step_spec
from llmserve.kernels.w4a16 import w4a16_linear

__all__ = [
    "DECODE_THREADS",
    "DECODE_TILE",
    "DEFAULT_SMEM_LIMIT",
    "FP8_CTYPE",
    "HEAD_DIMS",
    "KERNEL_DIR",
    "LOG2E",
    "NVRTC_OPTIONS",
    "PREFILL_CONFIGS",
    "PREFILL_DEFAULT_BLOCK_M",
    "_CTYPES",
    "_INDEX_CTYPES",
    "ModuleSpec",
    "_external_stream",
    "_fail",
    "_kernel",
    "_module",
    "all_module_specs",
    "decode_ctas_per_seq",
    "decode_num_splits",
    "decode_slots",
    "decode_smem_bytes",
    "decode_spec",
    "fp8_block_linear",
    "gated_delta_spec",
    "gated_delta_step",
    "int8_gemm_spec",
    "int8_linear",
    "is_available",
    "layer_ops_spec",
    "load_source",
    "lora_add",
    "lora_spec",
    "mla_decode_attention",
    "mla_spec",
    "moe_experts",
    "moe_spec",
    "paged_attention",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_expr",
    "prefill_smem_bytes",
    "prefill_spec",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "ssd_step",
    "ssd_step_spec",
    "store_kv",
    "store_kv_spec",
    "w4a16_linear",
]


def all_module_specs() -> list[ModuleSpec]:
    """Every configuration the wrappers can launch (the compile test and the emulator build
    each)."""
    specs = [store_kv_spec()]
    for ctype in _CTYPES.values():
        specs += [decode_spec(ctype, d) for d in HEAD_DIMS]
        specs += [prefill_spec(ctype, d) for d in HEAD_DIMS]
        specs.append(layer_ops_spec(ctype))
        specs.append(moe_spec(ctype))
        specs.append(lora_spec(ctype))
        specs.append(gated_delta_spec(ctype))
        specs.append(ssd_step_spec(ctype))
        specs.append(mla_spec(ctype))
    for ctype in _CTYPES.values():
        specs.append(store_kv_spec(ctype))
        specs += [decode_spec(ctype, d, FP8_CTYPE) for d in HEAD_DIMS]
        specs += [prefill_spec(ctype, d, FP8_CTYPE) for d in HEAD_DIMS]
    return specs + int8.module_specs() + w4a16.module_specs() + fp8_block.module_specs()
