"""Write a tiny gpt-oss checkpoint (tests/moe_models.py) as a `gpt-oss` GGUF with the `gguf`
package's writer, as llama.cpp's converter lays out float experts: gate_up_proj [E, H, 2 I]
split into ffn_gate_exps / ffn_up_exps ([E, I, H], the even and odd columns) and their biases,
down_proj transposed to ffn_down_exps [E, H, I], the sinks as `attn_sinks.weight`, the router
`ffn_gate_inp`, yarn's betas; no q / k permutation (NeoX rotary)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from tests.family_gguf import _gguf_name, _metadata

_LAYER = {  # our HF stem -> llama.cpp's gpt-oss tensor, where Llama's name is not it
    "post_attention_layernorm": "post_attention_norm",
    "self_attn.sinks": "attn_sinks",
    "mlp.router": "ffn_gate_inp",
}


def _experts(w: gguf.GGUFWriter, layer: str, name: str, data: np.ndarray) -> None:
    """One of the fused expert tensors as the converter splits / transposes it."""
    stem = f"blk.{layer}"
    if name == "gate_up_proj":  # [E, H, 2I] -> [E, 2I, H], even rows gate, odd rows up
        rows = data.transpose(0, 2, 1)
        w.add_tensor(f"{stem}.ffn_gate_exps.weight", np.ascontiguousarray(rows[:, 0::2]))
        w.add_tensor(f"{stem}.ffn_up_exps.weight", np.ascontiguousarray(rows[:, 1::2]))
    elif name == "gate_up_proj_bias":
        w.add_tensor(f"{stem}.ffn_gate_exps.bias", np.ascontiguousarray(data[:, 0::2]))
        w.add_tensor(f"{stem}.ffn_up_exps.bias", np.ascontiguousarray(data[:, 1::2]))
    elif name == "down_proj":
        w.add_tensor(f"{stem}.ffn_down_exps.weight", np.ascontiguousarray(data.transpose(0, 2, 1)))
    else:
        assert name == "down_proj_bias", name
        w.add_tensor(f"{stem}.ffn_down_exps.bias", data)


def write_gpt_oss_gguf(hf_dir: Path, path: Path) -> Path:
    """hf_dir (a tiny gpt-oss whose swiglu_limit is llama.cpp's fixed 7.0) as a float32 GGUF."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    assert cfg["swiglu_limit"] == 7.0, "llama.cpp's gpt-oss graph fixes the limit at 7.0"
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    _metadata(w, "qwen3", cfg)
    rope = cfg["rope_parameters"]
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    for hf_name, data in load_file(str(hf_dir / "model.safetensors")).items():
        data = np.ascontiguousarray(data, dtype=np.float32)
        layer, _, rest = hf_name.removeprefix("model.layers.").partition(".")
        if rest.startswith("mlp.experts."):
            _experts(w, layer, rest.removeprefix("mlp.experts."), data)
            continue
        stem, _, kind = rest.rpartition(".") if rest != "self_attn.sinks" else (rest, "", "weight")
        if stem in _LAYER:
            w.add_tensor(f"blk.{layer}.{_LAYER[stem]}.{kind}", data)
            continue
        name = _gguf_name("qwen3", hf_name)
        assert name is not None, f"no GGUF name for {hf_name}"
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
