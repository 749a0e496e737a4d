"""GGUF loading: GGUF files written from tiny HF checkpoints the way llama.cpp's converter writes
them (q/k rows permuted), loaded through llmserve, give HF's logits. Also the name map, the
unpermutation, and common.gguf_file against the gguf package's reader."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from llmserve.common.gguf_file import GGUFFile
from llmserve.common.model_config import ModelConfig, load_model_config, read_gguf_fields
from llmserve.engine.kv.cache import allocate_kv_cache, layer_views
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.ops import AttentionContext
from llmserve.engine.model.weights import build_model, gguf_name_to_hf, load_weights, unpermute_qk
from tests.factories import EOS_TOKEN_ID, LLAMA3, TINY_VOCAB

TOLERANCE = 1e-4
Q8_0 = gguf.GGMLQuantizationType.Q8_0
PROMPT = [(i * 37 + 11) % TINY_VOCAB for i in range(44)]  # > 32 tokens: llama3 scaling matters


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_rope_factors(cfg: dict[str, Any]) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it for llama3 scaling."""
    scaling = cfg["rope_parameters"]
    head_dim = cfg["head_dim"]
    base = scaling["rope_theta"]
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(
    hf_dir: Path,
    path: Path,
    quantize: tuple[str, ...] = (),
    extra_fields: Callable[[gguf.GGUFWriter], None] | None = None,
    minimal: bool = False,
    quantize_type: gguf.GGMLQuantizationType = Q8_0,
) -> dict[str, np.ndarray]:
    """Convert hf_dir to a llama GGUF at path; tensors named in quantize are stored as
    quantize_type (Q8_0, Q4_0 or Q4_1: those the gguf package can write).
    minimal: leave out the keys the loader can default (vocab size, head_dim, kv heads, name).
    Returns what was stored per GGUF name (quantized: the uint8 blocks)."""
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    hf = load_file(str(hf_dir / "model.safetensors"))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_eos_token_id(EOS_TOKEN_ID)
    if not minimal:
        w.add_name("tiny-gguf")
        w.add_head_count_kv(n_kv)
        w.add_rope_dimension_count(cfg["head_dim"])
        w.add_vocab_size(cfg["vocab_size"])
    rope_type = cfg["rope_parameters"].get("rope_type", "default")
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg["rope_parameters"]["factor"])
    if extra_fields:
        extra_fields(w)

    tensors: dict[str, np.ndarray] = {}
    tensors["token_embd.weight"] = hf["model.embed_tokens.weight"]
    tensors["output_norm.weight"] = hf["model.norm.weight"]
    if "lm_head.weight" in hf:
        tensors["output.weight"] = hf["lm_head.weight"]
    if rope_type == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_factors(cfg)
    layer_names = {
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
    for i in range(cfg["num_hidden_layers"]):
        for short, long in layer_names.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{long}.{kind}"
                if key not in hf:
                    continue
                data = hf[key]
                # llama.cpp permutes q and k, biases included
                if short == "attn_q":
                    data = permute_qk(data, n_head)
                elif short == "attn_k":
                    data = permute_qk(data, n_kv)
                tensors[f"blk.{i}.{short}.{kind}"] = data
    stored: dict[str, np.ndarray] = {}
    for name, data in tensors.items():
        data = np.ascontiguousarray(data, dtype=np.float32)
        if name in quantize:
            q = gguf.quants.quantize(data, quantize_type)
            w.add_tensor(name, q, raw_dtype=quantize_type)
            stored[name] = q
        else:
            w.add_tensor(name, data)
            stored[name] = data
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def make_biased_llama(directory: Path) -> Path:
    """A tiny HF Llama with random attention biases (tests.factories cannot set them)."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        rms_norm_eps=1e-5,
        attention_bias=True,
        bos_token_id=None,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=None,
    )
    torch.manual_seed(7)
    model = HFLlama(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.5)
    model.save_pretrained(directory)
    return directory


def hf_logits(hf_dir: Path, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    from transformers import LlamaForCausalLM as HFLlama

    model = HFLlama.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if state:
        model.load_state_dict(state, strict=False)
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0].float()


def our_model(path: Path) -> tuple[ModelConfig, LlamaForCausalLM]:
    config = load_model_config(path)
    weights = load_weights(path, config)
    model = build_model(config, weights, 256, torch.float32, torch.device("cpu"))
    return config, model


@torch.no_grad()
def our_logits(config: ModelConfig, model: LlamaForCausalLM) -> torch.Tensor:
    """Every position's logits for PROMPT in one step, blocks 7, 2, 5, 0, 3, 6 of 8."""
    block_size = 8
    table = [7, 2, 5, 0, 3, 6]
    kv = allocate_kv_cache(config, 8, block_size, torch.float32, torch.device("cpu"))
    n = len(PROMPT)
    ctx = AttentionContext(
        slot_mapping=torch.tensor([table[p // block_size] * block_size + p % 8 for p in range(n)]),
        block_tables=torch.tensor([table]),
        seq_lens=[n],
        cu_seqlens_q=[0, n],
        kv_caches=layer_views(kv),
    )
    hidden = model(torch.tensor(PROMPT), torch.arange(n), ctx)
    return model.compute_logits(hidden)


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


# ---- end to end: GGUF -> llmserve -> logits == HF ----------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_kv_heads": 4, "tie_word_embeddings": True, "seed": 1},
        {"num_kv_heads": 1, "seed": 2},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "seed": 4},
        {"rope_scaling": dict(LLAMA3), "seed": 3},
    ],
    ids=["gqa-untied", "mha-tied", "mqa", "linear", "llama3"],
)
def test_f32_gguf_logits_match_hf(
    tiny_model: Callable[..., Path], tmp_path: Path, kwargs: dict[str, Any]
) -> None:
    hf_dir = tiny_model(**kwargs)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_dir, path)
    config, model = our_model(path)
    hf_config = load_model_config(hf_dir)
    for field in (
        "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
        "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
        "tie_word_embeddings",
    ):  # fmt: skip
        assert getattr(config, field) == pytest.approx(getattr(hf_config, field)), field
    assert config.name == "tiny-gguf"
    assert config.eos_token_ids == (EOS_TOKEN_ID,)
    assert rel_err(our_logits(config, model), hf_logits(hf_dir)) < TOLERANCE


def test_minimal_gguf_metadata_defaults(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """Without vocab size, kv head count, rope dimension and name, the loader derives them from
    the embedding's shape, the head count, hidden / heads and the file name."""
    hf_dir = tiny_model(num_kv_heads=4, tie_word_embeddings=True, seed=1)
    path = tmp_path / "minimal.gguf"
    write_gguf(hf_dir, path, minimal=True)
    config, model = our_model(path)
    assert (config.vocab_size, config.num_kv_heads, config.head_dim) == (TINY_VOCAB, 4, 16)
    assert config.name == "minimal"
    assert config.tie_word_embeddings
    assert rel_err(our_logits(config, model), hf_logits(hf_dir)) < TOLERANCE


def test_gguf_without_unpermute_would_differ(tiny_model: Callable[..., Path]) -> None:
    """Guards the test above: the permutation is not a no-op on these weights."""
    from safetensors.numpy import load_file

    hf = load_file(str(tiny_model() / "model.safetensors"))
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(permute_qk(q, 4), q)


def test_gguf_with_attention_biases_matches_hf(tmp_path: Path) -> None:
    """llama.cpp's llama architecture carries optional attn_q/k/v/output biases (q/k biases
    permuted like their weights); they must be loaded, not dropped."""
    hf_dir = make_biased_llama(tmp_path / "hf")
    path = tmp_path / "biased.gguf"
    stored = write_gguf(hf_dir, path)
    assert "blk.0.attn_q.bias" in stored
    config, model = our_model(path)
    assert rel_err(our_logits(config, model), hf_logits(hf_dir)) < TOLERANCE


def test_q8_0_tensors_dequantize_and_unpermute(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    hf_dir = tiny_model()
    path = tmp_path / "q8.gguf"
    names = ("blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.0.ffn_down.weight")
    stored = write_gguf(hf_dir, path, quantize=names)
    config = load_model_config(path)
    weights = load_weights(path, config)
    deq = {n: gguf.quants.dequantize(stored[n], Q8_0) for n in names}
    assert deq["blk.0.ffn_down.weight"].shape == (64, 128)
    expected = {
        "model.layers.0.self_attn.q_proj.weight": unpermute_qk(deq[names[0]], 4),
        "model.layers.1.self_attn.k_proj.weight": unpermute_qk(deq[names[1]], 2),
        "model.layers.0.mlp.down_proj.weight": deq[names[2]],
    }
    for name, value in expected.items():
        assert weights[name].dtype == torch.float32
        assert np.array_equal(weights[name].numpy(), value), name
    # quantization really changed them (else the check above proves little)
    from safetensors.numpy import load_file

    hf = load_file(str(hf_dir / "model.safetensors"))
    down = weights["model.layers.0.mlp.down_proj.weight"].numpy()
    assert not np.array_equal(down, hf["model.layers.0.mlp.down_proj.weight"])
    np.testing.assert_allclose(
        weights["model.layers.0.self_attn.q_proj.weight"].numpy(),
        hf["model.layers.0.self_attn.q_proj.weight"],
        atol=0.02,
    )
    # and the whole model equals HF's with the same dequantized weights
    model = build_model(config, weights, 256, torch.float32, torch.device("cpu"))
    state = {k: v.clone() for k, v in weights.items()}
    assert rel_err(our_logits(config, model), hf_logits(hf_dir, state)) < TOLERANCE


# ---- names and the permutation --------------------------------------------------------------


@pytest.mark.parametrize(
    ("gguf_name", "hf_name"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output_norm.weight", "model.norm.weight"),
        ("output.weight", "lm_head.weight"),
        ("rope_freqs.weight", "rope_freqs"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_k.weight", "model.layers.12.self_attn.k_proj.weight"),
        ("blk.3.attn_v.weight", "model.layers.3.self_attn.v_proj.weight"),
        ("blk.3.attn_output.weight", "model.layers.3.self_attn.o_proj.weight"),
        ("blk.1.ffn_gate.weight", "model.layers.1.mlp.gate_proj.weight"),
        ("blk.1.ffn_up.weight", "model.layers.1.mlp.up_proj.weight"),
        ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
        ("blk.29.attn_norm.weight", "model.layers.29.input_layernorm.weight"),
        ("blk.29.ffn_norm.weight", "model.layers.29.post_attention_layernorm.weight"),
        ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
        ("blk.0.attn_output.bias", "model.layers.0.self_attn.o_proj.bias"),
        ("rope_factors_long.weight", None),
        ("blk.0.attn_rot_embd", None),
        ("blk.0.attn_q_norm.weight", None),
        ("blk.x.attn_q.weight", None),
        ("token_embd.bias", None),
        ("blk.0.attn_q.weight.extra", None),
    ],
)
def test_gguf_name_to_hf(gguf_name: str, hf_name: str | None) -> None:
    assert gguf_name_to_hf(gguf_name) == hf_name


@pytest.mark.parametrize(
    ("n_head", "head_dim", "cols"), [(1, 2, 3), (4, 16, 5), (3, 8, 1), (2, 64, 0)]
)
def test_unpermute_qk_inverts_llama_cpp_permutation(n_head: int, head_dim: int, cols: int) -> None:
    shape = (n_head * head_dim, cols) if cols else (n_head * head_dim,)
    w = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    permuted = permute_qk(w, n_head)
    if head_dim > 2:
        assert not np.array_equal(permuted, w)
    assert np.array_equal(unpermute_qk(permuted, n_head), w)
    assert np.array_equal(permute_qk(unpermute_qk(w, n_head), n_head), w)


def test_unpermute_qk_row_order() -> None:
    """Per head, llama.cpp stores rows (0, d/2, 1, d/2 + 1, ...); HF wants (0, 1, ..., d-1)."""
    rows = np.arange(8, dtype=np.float32)  # two heads of head_dim 4
    stored = [0, 2, 1, 3, 4, 6, 5, 7]
    assert permute_qk(rows, 2).tolist() == stored
    assert unpermute_qk(np.array(stored, dtype=np.float32), 2).tolist() == list(range(8))


# ---- common.gguf_file against gguf.GGUFReader ----------------------------------------------


@pytest.fixture(scope="module")
def builtin_reader(builtin_model_path: Path) -> gguf.GGUFReader:
    return gguf.GGUFReader(builtin_model_path)


def reader_fields(reader: gguf.GGUFReader) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_gguf_file_metadata_matches_reader(
    builtin_model_path: Path, builtin_reader: gguf.GGUFReader
) -> None:
    ours = GGUFFile(builtin_model_path).fields
    theirs = reader_fields(builtin_reader)
    for key, kind in [
        ("general.architecture", str),
        ("general.name", str),
        ("general.languages", list),
        ("llama.block_count", int),
        ("llama.rope.freq_base", float),
        ("llama.attention.layer_norm_rms_epsilon", float),
        ("tokenizer.ggml.add_space_prefix", bool),
        ("tokenizer.ggml.bos_token_id", int),
        ("tokenizer.ggml.token_type", list),
        ("tokenizer.ggml.tokens", list),
        ("tokenizer.ggml.merges", list),
        ("tokenizer.chat_template", str),
    ]:
        assert isinstance(ours[key], kind), key
        assert type(ours[key]) is type(theirs[key]), key
        assert ours[key] == theirs[key], key
    assert ours == theirs
    assert len(ours["tokenizer.ggml.tokens"]) == 49152
    assert read_gguf_fields(builtin_model_path) == ours


def test_gguf_file_tensors_match_reader(
    builtin_model_path: Path, builtin_reader: gguf.GGUFReader
) -> None:
    ours = GGUFFile(builtin_model_path)
    assert [t.name for t in ours.tensors] == [t.name for t in builtin_reader.tensors]
    for mine, theirs in zip(ours.tensors, builtin_reader.tensors, strict=True):
        assert mine.shape == tuple(int(d) for d in theirs.shape), mine.name
        assert mine.ggml_type == int(theirs.tensor_type), mine.name
        assert mine.offset == theirs.data_offset, mine.name
    q41 = next(t for t in builtin_reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_1)
    info = next(t for t in ours.tensors if t.name == q41.name)
    got = ours.tensor_array(info)
    expected = gguf.quants.dequantize(q41.data, q41.tensor_type)
    assert got.dtype == np.float32
    assert got.shape == tuple(reversed(info.shape)) == expected.shape
    assert np.array_equal(got, expected)
    f32 = next(t for t in builtin_reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.F32)
    info = next(t for t in ours.tensors if t.name == f32.name)
    assert np.array_equal(ours.tensor_array(info), np.asarray(f32.data))


def test_gguf_file_value_types(tiny_model: Callable[..., Path], tmp_path: Path) -> None:
    """Every GGUF value type, scalars and arrays, as the gguf package reads them back."""

    def extra(w: gguf.GGUFWriter) -> None:
        w.add_custom_alignment(64)
        w.add_uint8("t.u8", 200)
        w.add_int8("t.i8", -100)
        w.add_uint16("t.u16", 60000)
        w.add_int16("t.i16", -30000)
        w.add_uint32("t.u32", 4_000_000_000)
        w.add_int32("t.i32", -2_000_000_000)
        w.add_uint64("t.u64", 2**63 + 5)
        w.add_int64("t.i64", -(2**62))
        w.add_float32("t.f32", 0.1)
        w.add_float64("t.f64", 0.1)
        w.add_bool("t.true", True)
        w.add_bool("t.false", False)
        w.add_string("t.str", "héllo ✓")
        w.add_string("t.empty", "")
        w.add_array("t.ints", [1, -2, 3])
        w.add_array("t.floats", [0.5, 1.25])
        w.add_array("t.strs", ["a", "", "ünï"])
        w.add_array("t.bools", [True, False, True])
        w.add_array("t.empty_arr", [])
        w.add_array("t.nested", [[1, 2], [3]])

    path = tmp_path / "types.gguf"
    stored = write_gguf(tiny_model(), path, extra_fields=extra, quantize=("blk.1.ffn_up.weight",))
    gguf_file = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    # tensors, at the custom alignment
    assert gguf_file.fields["general.alignment"] == 64
    assert [t.offset % 64 for t in gguf_file.tensors] == [0] * len(stored)
    for info, theirs_t in zip(gguf_file.tensors, reader.tensors, strict=True):
        assert info.offset == theirs_t.data_offset
        if info.name in ("blk.1.ffn_up.weight",):
            expected = gguf.quants.dequantize(stored[info.name], Q8_0)
        else:
            expected = stored[info.name]
        assert np.array_equal(gguf_file.tensor_array(info), expected), info.name
    ours = gguf_file.fields
    theirs = reader_fields(reader)
    # GGUFReader.contents() flattens arrays of arrays; the file holds [[1, 2], [3]]
    assert ours.pop("t.nested") == [[1, 2], [3]]
    theirs.pop("t.nested")
    for key in theirs:
        if key.startswith("t."):
            assert ours[key] == theirs[key], key
            assert type(ours[key]) is type(theirs[key]), key
    assert ours["t.f32"] == float(np.float32(0.1)) and ours["t.f64"] == 0.1
    assert ours["t.u64"] == 2**63 + 5 and ours["t.i64"] == -(2**62)
    assert ours["t.str"] == "héllo ✓"
    assert ours == theirs
