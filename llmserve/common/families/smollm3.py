"""SmolLM3: Llama's layers, some without rotary (NoPE: every `no_rope_layer_interval`-th layer,
4, unless config.json lists `no_rope_layers`, 1 = rotate, 0 = not)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmserve.common.families.qwen import qwen_window
from llmserve.common.families.registry import Family, ModelSourceError, register


def nope_layers(num_layers: int, flags: list[int] | None, interval: int) -> tuple[int, ...]:
    """The indices of the layers without rotary, from transformers' per-layer flags (1 =
    rotate) or, without them, every interval-th layer (the 4th, 8th, ...)."""
    if flags is None:
        return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
    if len(flags) != num_layers:
        raise ModelSourceError(f"no_rope_layers has {len(flags)} entries for {num_layers} layers")
    return tuple(i for i, rotate in enumerate(flags) if not rotate)


def read_smollm3(cfg: Mapping[str, Any]) -> dict[str, Any]:
    num_layers = int(cfg["num_hidden_layers"])
    interval = int(cfg.get("no_rope_layer_interval") or 4)
    # transformers windows only with use_sliding_window (off in the released models), and then
    # the NoPE layers unless layer_types says otherwise.
    window = qwen_window({**cfg, "max_window_layers": 0})
    nope = nope_layers(num_layers, cfg.get("no_rope_layers"), interval)
    if window["sliding_window"] and not cfg.get("layer_types"):
        types = ["sliding_attention" if i in nope else "full_attention" for i in range(num_layers)]
        window["layer_types"] = tuple(types)
    return {"nope_layers": nope, **window}


SMOLLM3 = register(
    Family(
        name="smollm3",
        hf_architectures=("SmolLM3ForCausalLM",),
        hf_model_types=("smollm3",),
        model="llmserve.engine.model.families.smollm3:SmolLM3ForCausalLM",
        read_hf=read_smollm3,
        # llama.cpp writes no NoPE key: its smollm3 graph skips rotary on every 4th layer.
        gguf_architecture="smollm3",
        read_gguf=lambda fields, arch: {
            "nope_layers": nope_layers(int(fields[f"{arch}.block_count"]), None, 4),
            "attention_bias": "blk.0.attn_q.bias" in fields["tensor_names"],
        },
    )
)
