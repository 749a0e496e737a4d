"""The model families we serve, keyed by what a checkpoint says it is: an HF config.json's
`architectures` (or, without them, its `model_type`) and a GGUF's `general.architecture`.
A family is one `Family` record, defined in its own module beside this one
(common/families/<name>.py) and listed in common/families/__init__.py; its model class lives
in engine/model/families/, imported only by the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class ModelSourceError(ValueError):
    """The model path is missing, unreadable or of an unsupported kind."""


class UnservedModelError(ModelSourceError):
    """A checkpoint of an architecture no family serves."""


HFReader = Callable[[Mapping[str, Any]], dict[str, Any]]
GGUFReader = Callable[[Mapping[str, Any], str], dict[str, Any]]


@dataclass(frozen=True)
class Family:
    """One served family, defined in its own module (common/families/<name>.py).

    - `read_hf(cfg)`: the family's own ModelConfig fields from config.json, on top of those every
      decoder has (common/model_config.py reads those); `read_gguf(fields, arch)` likewise from a
      GGUF's metadata (None: the family has no GGUF form we read; `fields` also holds
      "tensor_names" and "gguf_file", the common.gguf_file.GGUFFile).
    - `model`: "module:Class" of its model definition in engine/model/families/, imported only
      by the engine, so the scheduler, gateway and CLI can read a model's shape without torch.
      That class declares the family's layers (engine/model/families/README.md).
    - `refuses`: engine features the family cannot use, each with the reason; the engine
      refuses them by name at start.
    """

    name: str
    hf_architectures: tuple[str, ...]
    hf_model_types: tuple[str, ...]
    model: str  # "llmserve.engine.model.families.<module>:<Class>"
    read_hf: HFReader
    gguf_architecture: str | None = None
    # further GGUF architectures read alike (llama.cpp names Nemotron-H with MoE blocks
    # `nemotron_h_moe`, Qwen3.5's MoE form `qwen35moe`)
    gguf_aliases: tuple[str, ...] = ()
    read_gguf: GGUFReader | None = None
    # GGUF tensor names that differ from Llama's (engine/model/weights.py): "attn_qkv" -> our
    # "self_attn.qkv_proj", ...; norms llama.cpp stores as 1 + w (Gemma's converter adds it).
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    gguf_norms_plus_one: bool = False
    refuses: Mapping[str, str] = field(default_factory=dict)  # FEATURES entry -> why

    @property
    def gguf_architectures(self) -> tuple[str, ...]:
        """Every `general.architecture` the family reads (none: no GGUF form)."""
        first = () if self.gguf_architecture is None else (self.gguf_architecture,)
        return first + self.gguf_aliases


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family`; its architectures, model types and GGUF name must be new."""
    for other in FAMILIES.values():
        taken = (
            set(family.hf_architectures) & set(other.hf_architectures)
            or set(family.hf_model_types) & set(other.hf_model_types)
            or set(family.gguf_architectures) & set(other.gguf_architectures)
        )
        assert not taken and family.name != other.name, f"{family.name} overlaps {other.name}"
    FAMILIES[family.name] = family
    return family


def served_architectures() -> list[str]:
    return sorted(a for f in FAMILIES.values() for a in f.hf_architectures)


def served_gguf_architectures() -> list[str]:
    return sorted(a for f in FAMILIES.values() for a in f.gguf_architectures)


# Hybrid linear-attention families known by name and refused with the reason (docs/models.md,
# "Hybrid linear attention"): none today (Qwen3-Next, Granite 4.0-H, Nemotron-H and Falcon-H1,
# whose recurrent layers keep their state in the scheduler's slots, are served); an entry is
# "architecture": "what its layers need".
REFUSED_HYBRIDS: dict[str, str] = {}


def family_for_hf(cfg: Mapping[str, Any], where: str) -> Family:
    """The family of an HF config.json: the first of its `architectures` we serve, or, when it
    lists none, its `model_type` (a config without either is read as Llama's)."""
    archs = list(cfg.get("architectures") or [])
    model_type = cfg.get("model_type")
    for family in FAMILIES.values():
        if any(a in family.hf_architectures for a in archs):
            return family
    if not archs:
        for family in FAMILIES.values():
            if (model_type or "llama") in family.hf_model_types:
                return family
    what = f"architectures={archs}" if archs else f"model_type={model_type!r}"
    for arch in archs:
        if arch in REFUSED_HYBRIDS:
            raise UnservedModelError(
                f"{where}: {arch} is a hybrid linear-attention model, not served yet: its layers "
                f"need {REFUSED_HYBRIDS[arch]} (docs/models.md)"
            )
    raise UnservedModelError(
        f"{where}: {what} is not served; served architectures: " + ", ".join(served_architectures())
    )


# The engine features a family may refuse (Family.refuses' keys), as EngineConfig.features names
# them; "lora" is refused when an adapter is loaded (engine/features/adapters.py), not at start
# (every engine has adapter slots by default).
FEATURES = (
    "quantization",
    "tensor_parallel",
    "pipeline_parallel",
    "speculative_decoding",
    "cuda_graphs",
    "lora",
)


def family_refusal(family_name: str, features: list[str]) -> str | None:
    """Why the family cannot run with these features, naming the first it refuses (None: it
    can)."""
    family = FAMILIES[family_name]
    for feature in features:
        assert feature in FEATURES, feature
        if feature in family.refuses:
            return (
                f"model family {family.name} ({', '.join(family.hf_architectures)}) does not "
                f"support {feature}: {family.refuses[feature]}"
            )
    return None


def family_for_gguf(arch: object, where: str) -> Family:
    for family in FAMILIES.values():
        if arch in family.gguf_architectures:
            return family
    raise UnservedModelError(
        f"{where}: GGUF general.architecture={arch!r} is not served; served: "
        + ", ".join(served_gguf_architectures())
    )
