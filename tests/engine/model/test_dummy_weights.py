"""`--load-format dummy`: the seeded generator (deterministic, device- and chunk-independent,
near-normal), the dummy model against HF transformers loading the same values, the shipped
configs/, the byte-level tokenizer for config-only models, and the flags through the CLI.

The SmolLM2 shape runs here with num_hidden_layers overridden to 2 (the full 30 take ~10 s to
generate on 2 cores); every other dimension is the real one.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from llmserve.bench.engine_driver import blocks_needed, generate
from llmserve.common.model_config import ModelConfig, load_model_config, resolve_model_path
from llmserve.engine.config import EngineConfig
from llmserve.engine.model import dummy
from llmserve.engine.model.model import LlamaForCausalLM
from llmserve.engine.model.ops import AttentionContext
from llmserve.engine.step.engine import Engine

ROOT = Path(__file__).resolve().parents[3]
SMOLLM2 = ROOT / "configs" / "smollm2-135m"
LLAMA3_8B = ROOT / "configs" / "llama-3-8b"
SEED = 7

pytestmark = [pytest.mark.stack, pytest.mark.usefixtures("one_torch_thread")]


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (a 32-bit integer hash) of int64 values in [0, 2^32), elementwise."""
    return dummy._hash32_(x.clone(), torch.empty_like(x))


def dummy_state_dict(
    config: ModelConfig, seed: int, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """The dummy weights as HF-named tensors, made on `device` in `dtype`: what
    init_dummy_weights puts into our fused model, for loading into HF's LlamaForCausalLM
    (`load_state_dict(..., strict=False)` when the embeddings are tied)."""
    weights: dict[str, torch.Tensor] = {}
    for name, shape in dummy.hf_tensor_shapes(config).items():
        tensor = torch.empty(shape, dtype=dtype, device=device)
        dummy.fill_hf_tensor_(tensor, seed, name)
        weights[name] = tensor
    return weights


def write_config(directory: Path, base: Path, **overrides: object) -> Path:
    """A copy of base/config.json with some fields changed (a config-only model directory)."""
    config = json.loads((base / "config.json").read_text())
    config.update(overrides)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@pytest.fixture(scope="module")
def smollm2_2l(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(tmp_path_factory.mktemp("smollm2-2l"), SMOLLM2, num_hidden_layers=2)


# ---- the generator -----------------------------------------------------------------------------


def test_values_depend_only_on_seed_name_and_index(monkeypatch: pytest.MonkeyPatch) -> None:
    whole = torch.empty(3000)
    dummy.fill_dummy_(whole, SEED, "a.weight", std=1.0)
    monkeypatch.setattr(dummy, "CHUNK", {"cpu": 257})  # chunk edges fall anywhere
    chunked = torch.empty(3000)
    dummy.fill_dummy_(chunked, SEED, "a.weight", std=1.0)
    assert torch.equal(whole, chunked)
    other_seed, other_name = torch.empty(3000), torch.empty(3000)
    dummy.fill_dummy_(other_seed, SEED + 1, "a.weight", std=1.0)
    dummy.fill_dummy_(other_name, SEED, "b.weight", std=1.0)
    assert not torch.equal(whole, other_seed) and not torch.equal(whole, other_name)


def test_integer_hash_is_lowbias32() -> None:
    """The int64 tensor version (products split so nothing overflows) against plain Python."""

    def lowbias32(x: int) -> int:
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)

    values = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]
    values += [(i * 2654435761) & 0xFFFFFFFF for i in range(1000)]
    assert hash32(torch.tensor(values)).tolist() == [lowbias32(v) for v in values]


def test_values_are_near_normal_with_the_asked_moments() -> None:
    x = dummy.standard_values(dummy.tensor_keys(SEED, "w"), 0, 1 << 20, torch.device("cpu"))
    assert abs(float(x.mean())) < 5e-3
    assert abs(float(x.std()) - 1.0) < 5e-3
    assert float(x.abs().max()) <= 3.47  # Irwin-Hall with 4 terms is bounded at sqrt(12)
    assert abs(float(torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1])) < 5e-3
    # near-normal: P(|z| > 2) is 4.55% for a normal, 3.9% for the 4-term sum
    assert 0.035 < float((x.abs() > 2).float().mean()) < 0.05
    out = torch.empty(1 << 16)
    dummy.fill_dummy_(out, SEED, "n.weight", std=0.02, mean=1.0)
    assert abs(float(out.mean()) - 1.0) < 1e-3 and abs(float(out.std()) - 0.02) < 1e-3


def test_half_types_are_the_float32_values_rounded() -> None:
    ref = torch.empty(5000)
    dummy.fill_dummy_(ref, SEED, "w", std=0.02)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.empty(5000, dtype=dtype)
        dummy.fill_dummy_(out, SEED, "w", std=0.02)
        assert torch.equal(out, ref.to(dtype))


# ---- the model -----------------------------------------------------------------------------------


def test_llama3_8b_shapes_cover_the_model_without_allocating_it() -> None:
    config = load_model_config(LLAMA3_8B)
    shapes = dummy.hf_tensor_shapes(config)
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 8_030_261_248
    with torch.device("meta"):
        model = LlamaForCausalLM(config, 16)
    slices = dummy.hf_parameter_slices(model)
    assert sorted((n, tuple(t.shape)) for n, t in slices) == sorted(shapes.items())


def test_fused_slices_hold_the_hf_named_values(smollm2_2l: Path) -> None:
    config = load_model_config(smollm2_2l)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, 16)
    model = model.to(torch.bfloat16).to_empty(device="cpu")
    dummy.init_dummy_weights(model, SEED)
    expected = dummy_state_dict(config, SEED, torch.bfloat16, torch.device("cpu"))
    for name, tensor in dummy.hf_parameter_slices(model):
        assert torch.equal(tensor, expected[name]), name
    norm = model.layers[1].input_layernorm.weight
    assert norm.float().mean().item() == pytest.approx(1.0, abs=0.01)


@pytest.fixture(scope="module")
def engine(smollm2_2l: Path) -> Iterator[Engine]:
    yield Engine(
        EngineConfig(
            model=str(smollm2_2l / "config.json"),
            device="cpu",
            load_format="dummy",
            seed=SEED,
            num_kv_blocks=blocks_needed([37, 9, 20], 4, 16),
        )
    )


@torch.no_grad()
def test_dummy_engine_matches_hf_on_the_same_weights(smollm2_2l: Path, engine: Engine) -> None:
    """HF's LlamaForCausalLM loading dummy_state_dict gives the logits of our engine's model
    (fused, packed for the CPU), and its greedy tokens."""
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    config = engine.model_config
    hf = HFLlama(LlamaConfig.from_pretrained(smollm2_2l)).float().eval()
    state = dummy_state_dict(config, SEED, torch.float32, torch.device("cpu"))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()  # tied

    tokens = [(i * 7919) % config.vocab_size for i in range(37)]
    ref = hf(torch.tensor([tokens])).logits[0]
    bs = engine.config.block_size
    ctx = AttentionContext(
        slot_mapping=torch.arange(len(tokens)),
        block_tables=torch.arange(-(-len(tokens) // bs))[None],
        seq_lens=[len(tokens)],
        cu_seqlens_q=[0, len(tokens)],
        kv_caches=engine.runner.kv_caches,
    )
    hidden = engine.model(torch.tensor(tokens), torch.arange(len(tokens)), ctx)
    ours = engine.model.compute_logits(hidden)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-4

    prompts = [tokens, tokens[:9], tokens[5:25]]
    generated = generate(engine, prompts, 4)
    hf.generation_config.eos_token_id = None
    hf_tokens = [
        hf.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False,
            max_new_tokens=4,
            pad_token_id=0,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    assert generated == hf_tokens


def test_auto_load_format_on_a_config_only_directory_says_what_to_do(smollm2_2l: Path) -> None:
    from llmserve.common.model_config import ModelSourceError

    with pytest.raises(ModelSourceError, match="--load-format dummy"):
        Engine(EngineConfig(model=str(smollm2_2l), device="cpu", num_kv_blocks=4))


# ---- configs, tokenizer, CLI ------------------------------------------------------------------


def shape_of(config: ModelConfig) -> dict[str, object]:
    keep = (
        "vocab_size hidden_size intermediate_size num_layers num_heads num_kv_heads head_dim "
        "rms_norm_eps rope_theta max_position_embeddings tie_word_embeddings rope_scaling"
    )
    return {k: getattr(config, k) for k in keep.split()}


def test_smollm2_config_is_the_builtin_models_shape(builtin_model_path: Path) -> None:
    ours, builtin = (
        shape_of(load_model_config(SMOLLM2)),
        shape_of(load_model_config(builtin_model_path)),
    )
    assert ours.pop("rms_norm_eps") == pytest.approx(builtin.pop("rms_norm_eps"))  # GGUF: float32
    assert ours == builtin


def test_llama3_8b_config() -> None:
    c = load_model_config(LLAMA3_8B)
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        4096, 32, 32, 8, 128,
    )  # fmt: skip
    assert (c.intermediate_size, c.vocab_size, c.rope_theta) == (14336, 128256, 500000.0)
    assert c.max_position_embeddings == 8192 and not c.tie_word_embeddings
    assert c.rope_scaling is None and c.eos_token_ids == (128001,)


def test_config_only_model_gets_the_byte_level_tokenizer() -> None:
    from llmserve.gateway.tokenizer import ChatMessage, ChatTemplateError, Tokenizer

    path = resolve_model_path(str(LLAMA3_8B / "config.json"))
    assert path == LLAMA3_8B
    tok = Tokenizer.from_model_path(path)
    text = "héllo, wörld  \n"
    ids = tok.encode(text)
    assert ids == list(text.encode()) and tok.vocab_size == 256
    assert tok.decode(ids) == text
    assert tok.decode([*ids, 300, 128000]) == text  # ids past the bytes have no text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    with pytest.raises(ChatTemplateError):
        tok.encode_chat([ChatMessage("user", "hi")])


def test_cli_passes_the_gpu_flags_to_the_engine() -> None:
    from llmserve.cli import build_parser
    from llmserve.common.flags import from_json, to_json
    from llmserve.serve_flags import stack_from_flags
    from llmserve.services import CONFIG_CLASSES

    serve = build_parser().parse_args(
        ["serve", "--model", str(LLAMA3_8B), "--load-format", "dummy", "--enforce-eager",
         "--max-num-seqs", "64", "--max-num-batched-tokens", "4096", "--attention-backend", "torch"]
    )  # fmt: skip
    stack = stack_from_flags(serve)
    config = from_json(CONFIG_CLASSES, to_json(stack.engine))  # as the child reads it
    assert config == stack.engine
    assert (config.load_format, config.enforce_eager, config.attention_backend) == (
        "dummy", True, "torch",
    )  # fmt: skip
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (64, 4096)
    assert (stack.scheduler.max_num_seqs, stack.scheduler.max_num_batched_tokens) == (64, 4096)
    defaults = stack_from_flags(build_parser().parse_args(["serve"])).engine
    assert defaults.load_format == "auto" and not defaults.enforce_eager
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(load_format="pt")
