"""PEFT LoRA adapter directories (adapter_config.json + adapter_model.safetensors) read and
checked against the base model: what engine/features/lora.py places in its slots.

An adapter adapts some of a Llama layer's linear layers (q, k, v, o, gate, up, down; TARGETS)
with a low-rank update W x + s * B (A x), A [r, in], B [out, r], s = lora_alpha / r
(rsLoRA: lora_alpha / sqrt(r)). The scaling is folded into B here, once: the update is still
applied beside the base weight, never merged into it. Anything the engine could not apply
exactly as PEFT does is refused by name (LoraError), nothing half-loaded.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from llmserve.common.model_config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The HF module names an adapter may target, and the part of the layer each sits in.
TARGETS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# Config entries whose non-default values change what the adapter computes in ways not applied
# here: (key, the value that is fine).
_UNSUPPORTED = (
    ("use_dora", False),
    ("bias", "none"),
    ("lora_bias", False),
    ("fan_in_fan_out", False),
    ("modules_to_save", None),
    ("rank_pattern", {}),
    ("alpha_pattern", {}),
    ("layer_replication", None),
    ("trainable_token_indices", None),
    ("alora_invocation_tokens", None),
)


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter and the reason."""


@dataclass
class LoraAdapter:
    """A checked adapter in host memory. weights[(layer, module)] = (A [r, in], B [out, r]
    with the scaling folded in), float32, whole (unsharded), for the layers it adapts."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each targetable module of the whole (unsharded) model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


def read_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter at `path` for a base model of shape `config`, checked: rank <= max_rank,
    only modules the model has, shapes of this base, a readable file. Raises LoraError."""
    directory = Path(path).expanduser()
    settings = _read_config(name, directory)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraError(f"adapter {name}: {CONFIG_FILE} needs an integer r >= 1 and lora_alpha")
    if rank > max_rank:
        raise LoraError(f"adapter {name}: rank r={rank} exceeds --max-lora-rank={max_rank}")
    _check_settings(name, settings)
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors = _read_tensors(name, directory)
    weights = _checked_weights(name, tensors, config, rank)
    targets = tuple(sorted({module for _, module in weights}, key=list(TARGETS).index))
    for key, (a, b) in weights.items():
        weights[key] = (a.float().contiguous(), (b.float() * scaling).contiguous())
    return LoraAdapter(name, str(directory), rank, scaling, targets, weights)


def _read_config(name: str, directory: Path) -> dict[str, object]:
    file = directory / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"adapter {name}: {directory} has no {CONFIG_FILE}")
    try:
        settings = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise LoraError(f"adapter {name}: {file} is not readable JSON ({err})") from None
    if not isinstance(settings, dict):
        raise LoraError(f"adapter {name}: {file} is not a JSON object")
    if settings.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"adapter {name}: peft_type={settings['peft_type']!r}, not LORA")
    return settings


def _check_settings(name: str, settings: dict[str, object]) -> None:
    """Refuse what the engine does not apply: DoRA, biases, extra trained modules, per-module
    ranks, and target modules a Llama layer does not have."""
    for key, fine in _UNSUPPORTED:
        value = settings.get(key, fine)
        if value is not None and value != fine and value != [] and value != {}:
            raise LoraError(f"adapter {name}: {key}={value!r} is not supported")
    targets = settings.get("target_modules")
    if isinstance(targets, list):
        lacking = [t for t in targets if t not in TARGETS]
        if lacking:
            raise LoraError(
                f"adapter {name}: targets modules the model lacks: {', '.join(map(str, lacking))}"
                f" (a Llama layer has {', '.join(TARGETS)})"
            )


def _read_tensors(name: str, directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    file = directory / WEIGHTS_FILE
    if not file.is_file():
        raise LoraError(f"adapter {name}: {directory} has no {WEIGHTS_FILE}")
    try:
        return load_file(str(file))
    except Exception as err:  # safetensors raises several kinds for a damaged file
        raise LoraError(f"adapter {name}: {file} is corrupt ({err})") from None


def _checked_weights(
    name: str, tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A, B), every tensor accounted for and of this base's shape."""
    shapes = module_shapes(config)
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match[3] not in TARGETS or TARGETS[match[3]] != match[2]:
            raise LoraError(f"adapter {name}: weight {key} is for a module the model lacks")
        layer, module = int(match[1]), match[3]
        if layer >= config.num_layers:
            raise LoraError(
                f"adapter {name}: weight {key} is for layer {layer}; the model has "
                f"{config.num_layers} layers"
            )
        out_features, in_features = shapes[module]
        expected = (rank, in_features) if match[4] == "A" else (out_features, rank)
        if tuple(tensor.shape) != expected:
            raise LoraError(
                f"adapter {name}: weight {key} has shape {tuple(tensor.shape)}, this base model "
                f"needs {expected} (an adapter for another base model?)"
            )
        if not tensor.is_floating_point():
            raise LoraError(f"adapter {name}: weight {key} is {tensor.dtype}, not floating point")
        halves.setdefault((layer, module), {})[match[4]] = tensor
    if not halves:
        raise LoraError(f"adapter {name}: {WEIGHTS_FILE} holds no LoRA weights")
    for (layer, module), pair in halves.items():
        if len(pair) != 2:
            raise LoraError(f"adapter {name}: layer {layer} {module} lacks its lora_A or lora_B")
    return {key: (pair["A"], pair["B"]) for key, pair in halves.items()}
