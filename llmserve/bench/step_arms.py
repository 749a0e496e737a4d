"""The arms `llmserve bench step` can time, by spec (llmserve/bench/step.py times them):

    mode:NAME       the built-in model as one of the CPU engine's configurations (MODES)
    family:NAME     a dummy-weight model of a served family at SmolLM2-135M's shape (FAMILIES;
                    --shape DIR: another config.json's)
    lora:SHAPExK    the built-in model with K rank-16 adapters over SHAPE's projections (qv or
                    all), request i under adapter i mod K; lora:base is the model without any
    model:DIR@Q     the checkpoint directory DIR with --quantization Q (default auto): e.g. a
                    W4A16 one kept in GGUF blocks (@gguf) against dequantized to float (@none)
    tp:MODELxT      an engine group of T ranks on this machine (gloo), MODEL builtin or wide
                    (a 12-head Llama that T = 1, 2 and 3 split evenly); timed alone, with the
                    driver's time inside all-reduces (T = 1: one engine, timed with the rest)

An arm holds its engine (or, for tp, the recipe of its group) and the settings it needs while
it runs (`active`: a mode's kernel switches). Everything is made here: no weights are fetched.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from llmserve.common.model_config import builtin_model_path, load_model_config
from llmserve.common.step_plan import LoraLoad
from llmserve.engine.config import EngineConfig
from llmserve.engine.step.engine import Engine

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"

# mode name: (engine config fields, reference ops, on a worker thread, GGUF activation bits or
# None, fused decode layers). The issue-14/30/42 steps of the CPU engine, in the order they came.
MODES: dict[str, tuple[dict[str, Any], bool, bool, int | None, bool]] = {
    "reference-thread": ({"quantization": "none"}, True, True, None, True),
    "reference": ({"quantization": "none"}, True, False, None, True),
    "cpu": ({"quantization": "none"}, False, False, None, True),
    "int8": ({"quantization": "int8"}, False, False, None, True),
    "int8-bf16kv": ({"quantization": "int8", "kv_cache_dtype": "bf16"}, False, False, None, True),
    "gguf-unfused": ({"quantization": "gguf"}, False, False, None, False),
    "gguf": ({"quantization": "gguf"}, False, False, None, True),
    "gguf-int8act": ({"quantization": "gguf"}, False, False, 8, True),
    "auto": ({"quantization": "auto"}, False, False, None, True),
    # the fused layers with a region per phase, not one per layer (cpu_gguf.ONE_REGION off)
    "auto-regions": ({"quantization": "auto"}, False, False, None, True),
    "gguf-regions": ({"quantization": "gguf"}, False, False, None, True),
    # the one-region layer with its barriers' longest spin set to N us (cpu_gguf.SPIN_US)
    "auto-spin0": ({"quantization": "auto"}, False, False, None, True),
    "auto-spin50": ({"quantization": "auto"}, False, False, None, True),
    "auto-spin100": ({"quantization": "auto"}, False, False, None, True),
}

WINDOW = 64
GEMMA = {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": WINDOW,
         "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192}
DEEPSEEK_MOE = {
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192, "n_group": 4,
    "topk_group": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}  # fmt: skip
MAMBA2 = {"mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_chunk_size": 256}
NEMOTRON = {
    "head_dim": 64,
    "mamba_num_heads": 18,
    "mamba_head_dim": 64,
    "n_groups": 1,
    "ssm_state_size": 128,
    "conv_kernel": 4,
    "chunk_size": 256,
}
# Each family in its own layout at SmolLM2-135M's shape (configs/smollm2-135m): windows of 64
# (shorter than 128-token prompts, so the windowed decode path runs); every MoE MLP 8 experts of
# 192, top-2 (the dense MLP's parameters, a quarter active); DeepSeek-V3 as DeepSeek-V2-Lite
# lays out its latent (192 + 32 rotary values a token a layer, against Llama's 2 x 3 x 64);
# Qwen3-Next as Qwen3-Next-80B-A3B lays out its layers (three gated DeltaNet to one gated
# attention: 23 + 7 of the 30; 4 key heads serving 8 value heads of 64) with Qwen2-MoE's experts.
# The Mamba-2 hybrids' mixers 18 heads of 64 (expand 2), one group, state 128, conv 4: Granite
# 4.0-H dense (Micro-H's layout: Mamba layers with one attention layer in ten, 3 of the 30, the
# shared MLP of 1536 in every layer); Nemotron-H as Nemotron-H-8B interleaves its blocks (per
# ten-block unit nine Mamba, one attention, ten squared-ReLU MLPs of 1536: 60 blocks for the 30
# layers) and nemotron_h_moe with Nemotron 3's MoE blocks in the MLPs' places (8 experts of 192,
# top-2, grouped router, a shared expert of 384); Falcon-H1: every one of the 30 layers
# attention and a Mamba-2 mixer side by side, then the SwiGLU MLP.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64},
    "mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": WINDOW},
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, **GEMMA},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **GEMMA},
    "phi3": {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
             "partial_rotary_factor": 0.75, "sliding_window": WINDOW,
             "tie_word_embeddings": False},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 192},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                  "head_dim": 64, "norm_topk_prob": True, **MOE},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                  "shared_expert_intermediate_size": 384, **MOE},
    "smollm3": {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3"},
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
                 "head_dim": 64, "partial_rotary_factor": 0.5, **DEEPSEEK_MOE},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                    "q_lora_rank": None, "kv_lora_rank": 192, "qk_nope_head_dim": 64,
                    "qk_rope_head_dim": 32, "v_head_dim": 64, **DEEPSEEK_MOE},
    "qwen3_next": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                   "head_dim": 64, "partial_rotary_factor": 0.25, "norm_topk_prob": True,
                   "shared_expert_intermediate_size": 384, "linear_num_key_heads": 4,
                   "linear_num_value_heads": 8, "linear_key_head_dim": 64,
                   "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, **MOE},
    "granite_hybrid": {"architectures": ["GraniteMoeHybridForCausalLM"],
                       "model_type": "granitemoehybrid", "num_local_experts": 0,
                       "shared_intermediate_size": 1536, "position_embedding_type": None,
                       "layer_types": (["mamba"] * 9 + ["attention"]) * 3,
                       "mamba_n_heads": 18, "mamba_expand": 2, **MAMBA2},
    "nemotron_h": {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                   "num_hidden_layers": 60, "hybrid_override_pattern": ("M-" * 9 + "*-") * 3,
                   **NEMOTRON},
    "nemotron_h_moe": {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                       "num_hidden_layers": 60, "hybrid_override_pattern": ("ME" * 9 + "*E") * 3,
                       "n_routed_experts": 8, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 192, "moe_shared_expert_intermediate_size": 384,
                       "n_group": 1, "topk_group": 1, **NEMOTRON},
    "falcon_h1": {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1",
                  "mamba_d_ssm": 1152, "mamba_n_heads": 18, "mamba_rms_norm": False, **MAMBA2},
    "gpt_oss": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": 64,
                "sliding_window": WINDOW, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 192, "swiglu_limit": 7.0, "attention_bias": True},
}  # fmt: skip

LORA_RANK = 16
LORA_TARGETS = {
    "qv": ["q_proj", "v_proj"],
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
WIDE = {  # a Llama shape that T = 1, 2 and 3 all split evenly
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_key_value_heads": 6, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "torch_dtype": "float32",
}  # fmt: skip


@dataclass
class Arm:
    """One configuration to time. engine: None for a tp arm (its group runs in processes made
    for it: `group`); lora_slots: each request's adapter slot, i mod len (empty: the base)."""

    spec: str
    config: EngineConfig
    engine: Engine | None = None
    active: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    worker_thread: bool = False
    lora_slots: list[int] = field(default_factory=list)
    lora_loads: list[LoraLoad] = field(default_factory=list)

    @property
    def group(self) -> bool:
        return self.engine is None

    def slots_for(self, batch: int) -> list[int] | None:
        if not self.lora_slots:
            return None
        return [self.lora_slots[i % len(self.lora_slots)] for i in range(batch)]


def make_arm(spec: str, base: EngineConfig, workdir: Path) -> Arm:
    """The arm spec names (see the module's docstring), its engine built from base's settings
    (device, threads, KV blocks, seed; base.model: the family arms' shape, a config.json's
    directory, or None for SmolLM2-135M's)."""
    kind, _, name = spec.partition(":")
    makers = {
        "mode": _mode_arm, "family": _family_arm, "lora": _lora_arm, "tp": _tp_arm,
        "model": _model_arm,
    }  # fmt: skip
    if kind not in makers:
        raise ValueError(f"arm {spec!r}: the kind is one of {sorted(makers)} (kind:name)")
    return makers[kind](spec, name, base, workdir)


def _mode_arm(spec: str, name: str, base: EngineConfig, workdir: Path) -> Arm:
    if name not in MODES:
        raise ValueError(f"arm {spec!r}: modes are {list(MODES)}")
    fields, reference, thread, act_bits, fused = MODES[name]
    config = _replace(base, model=None, **fields)
    engine = Engine(config)
    if reference:
        from llmserve.engine.model.ops import ReferenceOps

        engine.model.set_ops(ReferenceOps())

    @contextlib.contextmanager
    def active() -> Iterator[None]:
        from llmserve.engine.model import cpu_fused
        from llmserve.kernels import cpu_gguf

        bits, one_region = cpu_gguf.ACT_BITS, cpu_gguf.ONE_REGION
        cpu_gguf.ACT_BITS = act_bits or bits
        cpu_fused.ENABLED = fused
        cpu_gguf.ONE_REGION = not name.endswith("-regions")
        spin = cpu_gguf.SPIN_US
        if "-spin" in name:
            cpu_gguf.SPIN_US = int(name.split("-spin")[1])
        try:
            yield
        finally:
            cpu_gguf.ACT_BITS, cpu_fused.ENABLED = bits, True
            cpu_gguf.ONE_REGION = one_region
            cpu_gguf.SPIN_US = spin

    return Arm(spec, config, engine, active, thread)


def _family_arm(spec: str, name: str, base: EngineConfig, workdir: Path) -> Arm:
    if name not in FAMILIES:
        raise ValueError(f"arm {spec!r}: families are {list(FAMILIES)}")
    cfg = json.loads((Path(base.model or CONFIGS / "smollm2-135m") / "config.json").read_text())
    directory = _config_dir(workdir / f"family-{name}", {**cfg, **FAMILIES[name]})
    config = _replace(base, model=str(directory), load_format="dummy", quantization="none")
    return Arm(spec, config, Engine(config))


def _model_arm(spec: str, name: str, base: EngineConfig, workdir: Path) -> Arm:
    directory, _, quantization = name.partition("@")
    if not (Path(directory) / "config.json").is_file():
        raise ValueError(f"arm {spec!r}: {directory} holds no config.json")
    config = _replace(base, model=directory, quantization=quantization or "auto")
    return Arm(spec, config, Engine(config))


def _lora_arm(spec: str, name: str, base: EngineConfig, workdir: Path) -> Arm:
    shape, _, count = name.partition("x")
    if name == "base":
        shape, count = "qv", "0"
    if shape not in LORA_TARGETS or not count.isdigit():
        raise ValueError(f"arm {spec!r}: lora:base or lora:SHAPExK, SHAPE of {list(LORA_TARGETS)}")
    k = int(count)
    config = _replace(
        base, model=None, max_loras=max(k, 1), max_lora_rank=LORA_RANK, max_cpu_loras=max(k, 1)
    )
    engine = Engine(config)
    for i in range(k):
        path = write_lora_adapter(workdir / f"{spec}-{i}", LORA_TARGETS[shape], seed=i)
        engine.add_lora(f"{shape}-{i}", str(path))
    loads = [LoraLoad(i + 1, f"{shape}-{i}") for i in range(k)]
    return Arm(spec, config, engine, lora_slots=[i + 1 for i in range(k)], lora_loads=loads)


def _tp_arm(spec: str, name: str, base: EngineConfig, workdir: Path) -> Arm:
    model, _, size = name.partition("x")
    if model not in ("builtin", "wide") or not size.isdigit():
        raise ValueError(f"arm {spec!r}: tp:builtinxT or tp:widexT")
    fields: dict[str, Any] = {"tensor_parallel_size": int(size), "model": None}
    if model == "wide":
        fields.update(model=str(_config_dir(workdir / "wide", WIDE)), load_format="dummy")
        fields["quantization"] = "none"
    config = _replace(base, **fields)
    return Arm(spec, config, Engine(config) if size == "1" else None)  # T = 1: one engine


def write_lora_adapter(directory: Path, targets: list[str], seed: int) -> Path:
    """A rank-16 PEFT adapter of the built-in model's shape: random A, small random B."""
    from llmserve.engine.features.lora_files import module_shapes

    config = load_model_config(builtin_model_path())
    shapes = module_shapes(config)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module in targets:
            out_features, in_features = shapes[module]
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{module}"
            a = torch.randn(LORA_RANK, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, LORA_RANK, generator=generator) * 0.01
            tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = a, b
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": LORA_RANK, "lora_alpha": 2 * LORA_RANK}
    settings["target_modules"] = targets
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory


def prompts(batch: int, prompt_len: int, vocab_size: int = 40000) -> list[list[int]]:
    """batch prompts of prompt_len tokens, each its own (a prefix-free, repeatable batch), of
    ids below vocab_size (and 40000), above the special tokens where the vocabulary allows."""
    rng = random.Random(0)
    low, high = min(100, vocab_size // 2), min(40000, vocab_size)
    return [[rng.randrange(low, high) for _ in range(prompt_len)] for _ in range(batch)]


def _config_dir(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _replace(base: EngineConfig, **fields: Any) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(base, **fields)
