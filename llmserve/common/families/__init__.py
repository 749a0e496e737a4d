"""The served model families (common/families/registry.py explains a family's record). Each
module below registers its families when imported; a new family adds its module here."""

from llmserve.common.families import (
    deepseek,
    falcon_h1,
    gemma,
    gpt_oss,
    granite_hybrid,
    llama,
    moe,
    nemotron_h,
    phi3,
    qwen,
    qwen3_next,
    smollm3,
)
from llmserve.common.families.registry import (
    FAMILIES,
    FEATURES,
    Family,
    ModelSourceError,
    UnservedModelError,
    family_for_gguf,
    family_for_hf,
    family_refusal,
    register,
    served_architectures,
    served_gguf_architectures,
)
from llmserve.common.families.rope import ROPE_TYPES, rope_from_hf

__all__ = [
    "FAMILIES",
    "FEATURES",
    "ROPE_TYPES",
    "Family",
    "ModelSourceError",
    "UnservedModelError",
    "deepseek",
    "falcon_h1",
    "family_for_gguf",
    "family_for_hf",
    "family_refusal",
    "gemma",
    "gpt_oss",
    "granite_hybrid",
    "llama",
    "moe",
    "nemotron_h",
    "phi3",
    "qwen",
    "qwen3_next",
    "register",
    "rope_from_hf",
    "served_architectures",
    "served_gguf_architectures",
    "smollm3",
]
