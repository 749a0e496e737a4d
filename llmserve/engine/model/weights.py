"""Weights: the loaders of HF directories (*.safetensors) and GGUF files, both to HF tensor names,
and `build_model`, which puts them (or engine/model/dummy.py's seeded values) into a model;
`load_model` does both for the engine's target and draft models alike.

GGUF tensors are dequantized to float32. llama.cpp's converter permutes the rows of attn_q and
attn_k (it pairs rotary dimensions as (2i, 2i+1), HF pairs (i, i + d/2)); that permutation is undone
here so both sources feed the same model code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import numpy as np
import torch

from llmserve.common.families import FAMILIES
from llmserve.common.gguf_file import TensorInfo, open_gguf
from llmserve.common.model_config import ModelConfig, ModelSourceError
from llmserve.engine.config import EngineConfig
from llmserve.engine.model.checkpoint_blocks import CheckpointBlocks, can_keep
from llmserve.engine.model.checkpoint_formats import (
    CheckpointView,
    checkpoint_weights,
    read_format,
)
from llmserve.engine.model.checkpoint_linear import keep_checkpoint_weights
from llmserve.engine.model.checkpoint_linear_cuda import keep_on_gpu
from llmserve.engine.model.cpu_fused import install_fused_decode
from llmserve.engine.model.cpu_weights import plan_weight_path
from llmserve.engine.model.dummy import DummyWeights, init_dummy_weights
from llmserve.engine.model.families import model_class
from llmserve.engine.model.gguf_linear import (
    GGUFBlocks,
    gguf_kernel_missing,
    keep_gguf_blocks,
    quantize_rest,
)
from llmserve.engine.model.kept_experts import keep_expert_weights
from llmserve.engine.model.layers import PackedLinear, can_pack_cpu_linears
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.ops import LayerOps, select_ops
from llmserve.engine.model.quant import QUANTIZED_LINEARS, quantization_limits
from llmserve.engine.parallel.groups import ModelShard, shard_config
from llmserve.engine.step.cuda_graphs import graph_batch_sizes
from llmserve.kernels import cpu_gguf

_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "rope_freqs",
}


class LazyWeights(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by HF name, each read (and for a GGUF, dequantized) when looked up
    and not kept: a rank takes its slice of each and drops the rest, so no process ever holds
    the whole model beside its own shard."""

    def __init__(self, names: list[str], read: Callable[[str], torch.Tensor]):
        self.names = dict.fromkeys(names)
        self.read = read

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        return self.read(name)

    def __contains__(self, name: object) -> bool:
        # Mapping's own asks __getitem__: every tensor was read (a GGUF's dequantized) once more
        # by load_weights' check for missing ones, doubling the load
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_weights(path: Path, config: ModelConfig) -> Mapping[str, torch.Tensor]:
    """All tensors of the checkpoint under HF names, on the CPU, in their stored dtype (GGUF:
    float32), each read when looked up. A llama3 GGUF's rope frequency divisors come back as
    "rope_freqs"."""
    if path.is_dir():
        return _load_safetensors_dir(path)
    return _load_gguf(path, config)


def _load_safetensors_dir(path: Path) -> CheckpointView:
    """The directory's tensors through the format its config.json declares
    (engine/model/checkpoint_formats.py: refused at start where a tensor would go unread)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelSourceError(
            f"{path}: no *.safetensors files (other formats are not supported; "
            "--load-format dummy gives seeded random weights for its config.json)"
        )
    where: dict[str, Path] = {}
    dtypes: dict[str, str] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            where.update(dict.fromkeys(f.keys(), file))
            dtypes.update((name, f.get_slice(name).get_dtype()) for name in f.keys())  # noqa: SIM118 (not a dict)

    def read(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), framework="pt") as f:
            return f.get_tensor(name)

    return checkpoint_weights(path, LazyWeights(list(where), read), dtypes)


def gguf_name_to_hf(name: str, layer_names: Mapping[str, str] | None = None) -> str | None:
    """HF name for a GGUF tensor name, or None for tensors the model does not use. layer_names:
    a family's names that differ from Llama's (common/families: gguf_layer_names)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    table = {**_GGUF_LAYER_NAMES, **(layer_names or {})}
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a q or k projection ([heads * head_dim, ...]).

    llama.cpp stores each head's rows as (0, d/2, 1, d/2+1, ...); HF wants (0, 1, ..., d-1).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (
        weight.reshape(num_heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


_PERMUTED = ("llama", "smollm3", "granitehybrid", "nemotron_h", "nemotron_h_moe")


class GGUFWeights(LazyWeights, GGUFBlocks):
    """A GGUF file's tensors by HF name, dequantized to float32 when looked up; `blocks` gives a
    quantized one's blocks as stored (for --quantization gguf), q and k rows unpermuted alike.
    llama.cpp permutes q and k rows for the Llama architecture (Mixtral's too) and SmolLM3 (the
    others use NeoX-style rotary, as HF does); a family whose converter stores norms as 1 + w
    (Gemma) gets w back."""

    def __init__(self, path: Path, config: ModelConfig):
        family = FAMILIES[config.family]
        self.file = open_gguf(path)
        self.config = config
        self.norms_plus_one = family.gguf_norms_plus_one
        # SmolLM3's converter is Llama's, permutation included; so are the attention layers'
        # of Granite 4.0-H and Nemotron-H (GraniteHybridModel's undo_permute).
        self.permuted = self.file.fields.get("general.architecture") in _PERMUTED
        self.infos: dict[str, TensorInfo] = {}
        for tensor in self.file.tensors:
            name = gguf_name_to_hf(tensor.name, family.gguf_layer_names)
            if name is not None:
                self.infos[name] = tensor
        super().__init__(list(self.infos), self._read)

    def _hf_rows(self, name: str, data: np.ndarray) -> torch.Tensor:
        if self.permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = unpermute_qk(data, self.config.num_heads)
        elif self.permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = unpermute_qk(data, self.config.num_kv_heads)
        return torch.from_numpy(np.ascontiguousarray(data))

    def _read(self, name: str) -> torch.Tensor:
        data = self.file.tensor_array(self.infos[name])
        if self.norms_plus_one and name.endswith("norm.weight"):
            data = data - 1.0
        return self._hf_rows(name, data)

    def holds(self, name: str) -> bool:
        return name in self.infos

    def blocks(self, name: str) -> tuple[int, torch.Tensor] | None:
        """(ggml type, the HF tensor's rows of blocks as stored); None where the file does not
        hold it in blocks the CPU kernel reads."""
        info = self.infos.get(name)
        if info is None or info.ggml_type not in cpu_gguf.FORMATS or len(info.shape) != 2:
            return None
        _, elems, nbytes = cpu_gguf.FORMATS[info.ggml_type]
        rows, row_bytes = info.shape[1], info.shape[0] // elems * nbytes
        raw = self.file.tensor_bytes(info, rows * row_bytes).reshape(rows, row_bytes)
        blocks = self._hf_rows(name, raw.copy())
        # the file's pages read so far, out of this process's resident memory (the load would
        # otherwise peak at the blocks twice: the mapping's and the copies')
        self.file.drop_resident_pages()
        return info.ggml_type, blocks


def _load_gguf(path: Path, config: ModelConfig) -> LazyWeights:
    weights = GGUFWeights(path, config)
    if config.family in ("qwen3_next", "qwen3_5"):  # the converter rewrote tensors: undone there
        from llmserve.engine.model.families.qwen3_next_gguf import (
            qwen3_5_gguf_tensors,
            qwen3_next_gguf_tensors,
        )

        undo = qwen3_5_gguf_tensors if config.family == "qwen3_5" else qwen3_next_gguf_tensors
        return LazyWeights(*undo(weights, weights.file, config))
    if config.family in ("granite_hybrid", "nemotron_h", "falcon_h1"):  # Mamba-2 rewrites
        from llmserve.engine.model.families.mamba2_gguf import mamba2_gguf_tensors

        return LazyWeights(*mamba2_gguf_tensors(weights, weights.file, config))
    return weights


# ggml type ids of the GGUF blocks the CPU's int8 form holds exactly (engine.quant.grouped_int8)
INT8_EXACT = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}


def resolve_quantization(
    name: str, path: Path, device: torch.device, *, whole: bool = True, dummy: bool = False
) -> str:
    """--quantization auto on a CPU, for a GGUF whose projections are stored as:
    - Q4_0, Q4_1, Q8_0 or Q4_K: gguf (the blocks kept as stored, kernels/cpu_gguf.cpp), where
      the kernel builds and the model is whole (`whole`: no tensor-parallel split) and loaded
      from the file (not `dummy`);
    - otherwise Q4_0, Q4_1 or Q8_0: int8 (its form holds those blocks exactly);
    else none."""
    if name != "auto":
        return name
    if path.is_dir() or device.type != "cpu":
        return "none"
    # The query projection's type (Phi-3's is fused with k and v: attn_qkv).
    query = ("attn_q.weight", "attn_qkv.weight")
    types = {t.ggml_type for t in open_gguf(path).tensors if t.name.endswith(query)}
    if not types:
        return "none"
    if whole and not dummy and types <= cpu_gguf.FORMATS.keys() and not gguf_kernel_missing():
        return "gguf"
    return "int8" if types <= INT8_EXACT.keys() else "none"


def gguf_limits(path: Path, device: torch.device, whole: bool, dummy: bool) -> str | None:
    """Why --quantization gguf cannot serve `path` on `device` (None when it can)."""
    if device.type != "cpu":
        return f"--quantization gguf runs on a CPU, not {device}"
    if dummy or (path.is_dir() and not can_keep(read_format(path))):
        return (
            "--quantization gguf keeps a GGUF file's blocks or a W4A16 / W8A16 checkpoint's "
            "(GPTQ, AWQ, compressed-tensors int): it needs such a --model loaded"
        )
    if not whole:
        return "--quantization gguf does not split blocks across tensor-parallel ranks"
    return None


def _keep_quantized(
    model: LlamaForCausalLM, weights: CheckpointView, device: torch.device, dtype: torch.dtype
) -> None:
    """Before the load: a quantized checkpoint's linears kept as stored, on the CPU
    (engine/model/checkpoint_linear.py; MoE experts: kept_experts.py) or a GPU
    (checkpoint_linear_cuda.py)."""
    if device.type == "cpu":
        keep_checkpoint_weights(model, weights)
        keep_expert_weights(model, weights)  # and MoE experts (MXFP4 too)
    else:
        keep_on_gpu(model, weights, device, dtype)


def build_model(
    config: ModelConfig,
    weights: Mapping[str, torch.Tensor] | None,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    *,
    dummy_seed: int = 0,
    ops: LayerOps | None = None,
    quantization: str = "none",
    shard: ModelShard | None = None,
    dense_budget_mib: int = 0,
    dense_rows: int = 0,
) -> LlamaForCausalLM:
    """Allocate (on a CPU in place; elsewhere on the meta device, materialized on `device`
    directly in `dtype`, never a float32 copy first), then load `weights`, or, when it is
    None, fill in engine.dummy's seeded values.
    `ops`: the layer ops backend (default: kernels/reference.py). `quantization` (int8, fp8)
    replaces every linear layer, the LM head included, by engine/model/quant.py's (gguf: by
    engine/model/gguf_linear.py's on `weights`' blocks, swapped in before the load, which then never
    widens them to float32). `shard`: the part
    this rank holds (default: the whole model); a sharded model takes its slice of each tensor,
    the dummy ones included (the same values as the whole model's). `dense_budget_mib` (gguf):
    memory for a dense copy of the layers that steps of `dense_rows` rows or more (0: measured)
    multiply instead (engine/model/cpu_weights.py)."""
    cls = model_class(config)
    if device.type == "cpu":  # torch.empty touches no memory; the meta device's first use costs
        # 1.5 s of CPU importing what its decompositions need (sympy), at every start
        with device:
            model = cls(config, max_positions, ops, shard).to(dtype)
    else:
        with torch.device("meta"):
            model = cls(config, max_positions, ops, shard)
        model = model.to(dtype).to_empty(device=device)
    model.reset_rotary()
    if quantization == "gguf":
        weights = _keep_blocks(model, weights)
    if quantization == "none" and isinstance(weights, CheckpointView):
        _keep_quantized(model, weights, device, dtype)  # W4A16 / W8A16 / FP8 kept as stored
    if weights is None and model.shard.is_whole:
        init_dummy_weights(model, dummy_seed)
    elif weights is None:
        model.load_weights(DummyWeights(config, dummy_seed, dtype, device))
    else:
        model.load_weights(weights)
    model = model.eval().requires_grad_(False)
    if quantization == "gguf":
        if not isinstance(weights, CheckpointBlocks):
            quantize_rest(model)
        elif dtype == torch.float32 and can_pack_cpu_linears():  # the rest stays float
            model.replace_linears(PackedLinear)
        plan_weight_path(model, dense_budget_mib, dense_rows)
        install_fused_decode(model)
    elif quantization != "none":
        model.replace_linears(QUANTIZED_LINEARS[quantization])
    elif device.type == "cpu" and dtype == torch.float32 and can_pack_cpu_linears():
        model.replace_linears(PackedLinear)
    return model


def _keep_blocks(model: LlamaForCausalLM, weights: Mapping[str, torch.Tensor] | None) -> GGUFBlocks:
    """--quantization gguf, before the load: a GGUF file's blocks or a W4A16 / W8A16 checkpoint's
    integer weights (engine/model/checkpoint_blocks.py) swapped in as GGUFLinears."""
    if isinstance(weights, CheckpointView):
        weights = CheckpointBlocks(weights)
    assert isinstance(weights, GGUFBlocks), "--quantization gguf needs blocks to keep"
    keep_gguf_blocks(model, weights, weights)
    return weights


def checked_quantization(
    name: str,
    path: Path,
    device: torch.device,
    what: str = "",
    *,
    whole: bool = True,
    dummy: bool = False,
) -> str:
    """resolve_quantization's answer, or ValueError (prefixed by `what`) when `device` cannot
    run it."""
    quantization = resolve_quantization(name, path, device, whole=whole, dummy=dummy)
    if quantization == "gguf":
        why_not = gguf_limits(path, device, whole, dummy)
    else:
        why_not = quantization_limits(quantization, device)
    if why_not:
        raise ValueError(f"{what}{why_not}")
    return quantization


def load_model(
    config: EngineConfig,
    path: Path,
    model_config: ModelConfig,
    quantization: str,
    max_positions: int,
    dtype: torch.dtype,
    device: torch.device,
    shard: ModelShard | None = None,
) -> tuple[LlamaForCausalLM, str]:
    """The model at `path` (its part `shard`, default the whole), built as --load-format says
    (dummy: seeded by --seed), through the layer ops --attention-backend picks for its shape on
    this rank; (model, why those ops)."""
    local_config = model_config if shard is None else shard_config(model_config, shard)
    ops, ops_reason = select_ops(
        config.attention_backend, device, dtype, local_config, config.block_size
    )
    # Graph and eager decode split alike (engine.ops.DecodeSplits): fixed here, per model shape.
    ops.fix_decode_splits(local_config, max_positions, graph_batch_sizes(config.max_num_seqs))
    weights = None if config.load_format == "dummy" else load_weights(path, model_config)
    model = build_model(
        model_config, weights, max_positions, dtype, device,
        dummy_seed=config.seed or 0, ops=ops, quantization=quantization, shard=shard,
        # the dense copy is --quantization auto's choice; gguf asked for keeps the blocks only
        dense_budget_mib=config.cpu_dense_weights_mib if config.quantization == "auto" else 0,
        dense_rows=config.cpu_dense_rows,
    )  # fmt: skip
    if isinstance(weights, GGUFWeights):  # every tensor is copied out of the mapping by now
        weights.file.drop_resident_pages()
    whole = shard is None or (shard.first and shard.last and shard.tp.size == 1)
    if isinstance(weights, CheckpointView) and whole:
        # A pipeline stage leaves the other stages' layers unread, on purpose, and a tensor-
        # parallel rank of a mixture of experts the other ranks' experts: the one-rank load
        # checks every tensor.
        skip_mtp_layers(weights, model_config)
        weights.check_all_read(path, model_config.tie_word_embeddings)
    return model, ops_reason


# Stored parts not served, on purpose: Qwen3-Next's and Qwen3.5's multi-token prediction head
# (`mtp.`), the vision tower of a multimodal checkpoint whose text model is served (Qwen3.5).
UNSERVED_STEMS = ("mtp.", "model.visual.")


def skip_mtp_layers(weights: CheckpointView, config: ModelConfig) -> None:
    """Count the multi-token prediction layers' tensors (`model.layers.{L}.` .. after the
    model's L layers: DeepSeek-V3's and GLM-4.5's releases store one; UNSERVED_STEMS) as read:
    not served, on purpose, so the after-load check does not refuse the checkpoint for them."""
    first = config.num_layers
    stems = tuple(f"model.layers.{i}." for i in range(first, first + config.num_mtp_layers))
    stems += UNSERVED_STEMS
    weights.read_names.update(n for n in weights if n.startswith(stems))
