"""gpt-oss (attention sinks, sliding and full layers alternating, biased experts under the
clamped SwiGLU, yarn) against transformers on a tiny random checkpoint of GptOssConfig
(tests/moe_models.py): every position of a whole and a chunked prompt, the scheduled script
(chunked prefill, prefix-cache hits, preemptions, decode over several blocks), each quirk shown
to matter, what the family refuses."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.families import family_refusal
from llmserve.common.model_config import load_model_config
from llmserve.engine.model.ops import kernel_limits
from tests.engine.model.families.test_families import TOLERANCE, Loaded, check_script_matches_hf
from tests.engine.model.families.test_moe_models import SCRIPT
from tests.engine.model.test_model import forward_direct, prompt, rel_err, shuffled_blocks
from tests.moe_models import make_tiny_moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    return Loaded(make_tiny_moe(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", seed=1))


def test_registry_reads_the_family(model: Loaded) -> None:
    config = load_model_config(model.path)
    assert config.family == "gpt_oss" and config.attention_sinks and config.attention_bias
    assert config.layer_types == ("sliding_attention", "full_attention")
    assert [config.layer_window(i) for i in range(2)] == [12, None]
    assert config.moe is not None and config.moe.clamped_swiglu == (1.702, 1.5)
    layers = model.engine.model.layers
    assert [layer.self_attn.window for layer in layers] == [12, None]
    assert all(layer.self_attn.sinks is not None for layer in layers)


def test_whole_prompt_and_chunks_all_positions(model: Loaded) -> None:
    model.engine.reset()
    tokens = prompt(45, seed=1)
    want = model.hf_logits(tokens)
    (whole,) = forward_direct(model.engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(whole, want) < TOLERANCE
    table = shuffled_blocks(12)[:6]
    chunks = [
        forward_direct(model.engine, [(tokens, s, min(s + 7, len(tokens)), table)])[0]
        for s in range(0, len(tokens), 7)
    ]
    assert rel_err(torch.cat(chunks), want) < TOLERANCE


def test_scheduled_script_matches_hf(model: Loaded) -> None:
    """Chunked prefills, prefix-cache hits, preemptions and decode steps (the sinks in the
    batched decode path too); every sampled row within 1e-4 of transformers' and its greedy
    token."""
    model.engine.reset()
    check_script_matches_hf(model.engine, model.hf_logits, **SCRIPT)


def _set(model: Loaded, quirk: str) -> None:
    for layer in model.engine.model.layers:
        if quirk == "sinks":
            layer.self_attn.sinks.data.fill_(float("-inf"))  # e^-inf: no sink
        elif quirk == "window":
            layer.self_attn.window = None
        else:
            layer.mlp.experts.limit = float("inf")


@pytest.mark.parametrize("quirk", ["sinks", "window", "limit"])
def test_each_quirk_matters_for_these_prompts(
    tmp_path_factory: pytest.TempPathFactory, quirk: str
) -> None:
    """Without the sinks, the sliding layer's window, or the SwiGLU clamp, the logits move away
    from transformers' (a model of its own: this edits it)."""
    m = Loaded(make_tiny_moe(tmp_path_factory.mktemp(quirk), "gpt_oss", seed=1))
    _set(m, quirk)
    tokens = prompt(45, seed=1)
    (ours,) = forward_direct(m.engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(ours, m.hf_logits(tokens)) > 1e-2


def test_what_the_family_refuses(model: Loaded) -> None:
    """Quantization by name at start, a LoRA adapter when loaded; the CUDA kernels take the
    sinks, windows and experts (kernel_limits declines only the tiny model's head_dim, not the
    family). Tensor and pipeline parallelism: tests/engine/model/families/test_family_features.py.
    """
    why = family_refusal("gpt_oss", ["tensor_parallel", "pipeline_parallel", "quantization"])
    assert why is not None and "GptOssForCausalLM" in why and "quantization" in why
    with pytest.raises(ValueError, match=r"gpt_oss \(GptOssForCausalLM\) does not support lora"):
        model.engine.adapters.add("a", "/nonexistent")  # refused before the path is read
    config = load_model_config(model.path)
    why = kernel_limits(config, torch.bfloat16, 16)
    assert why is not None and f"head_dim={config.head_dim}" in why
    assert kernel_limits(dataclasses.replace(config, head_dim=64), torch.bfloat16, 16) is None


def test_sinks_in_the_reference_decode_equal_the_chunk_path() -> None:
    """kernels/reference.py's two paths with sinks agree: a request's last query through the
    batched decode path equals the same query as the last row of a chunk."""
    from llmserve.kernels.reference import paged_attention

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, block = 4, 2, 8, 4
    k_cache = torch.randn(6, block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(6, block, kv_heads, dim, generator=gen)
    table = torch.tensor([[3, 1, 5]])
    q = torch.randn(3, heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) * 2
    kw: dict[str, Any] = {"scale": 0.3, "sinks": sinks, "window": 5}
    chunk = paged_attention(q, k_cache, v_cache, table, [11], [0, 3], **kw)
    decode = paged_attention(q[2:], k_cache, v_cache, table, [11], [0, 1], **kw)
    torch.testing.assert_close(decode[0], chunk[2])
    plain = paged_attention(q[2:], k_cache, v_cache, table, [11], [0, 1], scale=0.3, window=5)
    assert not torch.allclose(decode, plain)


def test_a_sparse_config_reads_gptossconfigs_defaults(tmp_path: Path) -> None:
    """A config.json without head_dim, layer_types, sliding_window, rope or the SwiGLU limit
    reads as GptOssConfig fills them in."""
    import transformers

    cfg = {
        "vocab_size": 300, "hidden_size": 96, "intermediate_size": 32, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "max_position_embeddings": 131072,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **cfg})
    )
    ours, theirs = load_model_config(tmp_path), transformers.GptOssConfig(**cfg)
    assert ours.head_dim == theirs.head_dim == 64  # not hidden / heads
    assert list(ours.layer_types) == theirs.layer_types
    assert ours.sliding_window == theirs.sliding_window == 128
    rope = dict(theirs.rope_parameters)
    assert ours.rope_theta == rope.pop("rope_theta") and ours.rope_scaling == rope
    assert ours.moe is not None and ours.moe.clamped_swiglu == (1.702, theirs.swiglu_limit)


@pytest.fixture(scope="module")
def mxfp4_dirs(model: Loaded, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(gpt-oss's MXFP4 checkpoint of the module's tiny model, the same model with those
    experts dequantized to float32), written by llmserve/bench/quant_checkpoints.py."""
    from llmserve.bench.quant_checkpoints import write_mxfp4

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4(model.path, root / "q", root / "dequantized")
    return root / "q", root / "dequantized"


def test_mxfp4_experts_are_read_as_transformers_reads_them(mxfp4_dirs: tuple[Path, Path]) -> None:
    """transformers' own MXFP4 loader (dequantize=True) on the written checkpoint holds the
    experts the dequantized directory holds: the writer follows gpt-oss's layout."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, Mxfp4Config

    quantized, dequantized = mxfp4_dirs
    hf = AutoModelForCausalLM.from_pretrained(
        quantized, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    theirs = hf.state_dict()
    experts = {n: t for n, t in load_file(str(dequantized / "model.safetensors")).items()
               if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}  # fmt: skip
    assert len(experts) == 4
    for name, tensor in experts.items():
        assert torch.equal(theirs[name].float(), tensor), name


def test_mxfp4_checkpoint_serves_as_its_dequantized_model(mxfp4_dirs: tuple[Path, Path]) -> None:
    """gpt-oss's MXFP4 experts (`*_blocks`, `*_scales`) served: greedy tokens equal to the
    same model dequantized to float32. On the CPU they are kept as stored (cpu_wq's fp4 kind:
    e2m1 codes, e8m0 scales), biases and the clamped SwiGLU included, and the start line
    counts them (2 layers x 8 experts x (gate_up, down))."""
    from llmserve.bench.engine_driver import generate
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.model.checkpoint_formats import checkpoint_format
    from llmserve.engine.model.checkpoint_linear import kept_description
    from llmserve.engine.model.kept_experts import KeptExperts
    from llmserve.engine.step.engine import Engine
    from llmserve.kernels import cpu_wq

    prompts = [[5, 77, 190, 33, 12], [200, 3, 3, 41], [9, 120, 64, 250, 18, 7], [100]]
    settings: dict[str, Any] = dict(device="cpu", num_kv_blocks=32, max_model_len=128, seed=0)
    quantized, dequantized = mxfp4_dirs
    engine = Engine(EngineConfig(model=str(quantized), **settings))
    want = generate(Engine(EngineConfig(model=str(dequantized), **settings)), prompts, 6)
    assert generate(engine, prompts, 6) == want
    assert checkpoint_format(quantized).startswith("mxfp4")
    if cpu_wq.unavailable() is None:
        assert all(isinstance(layer.mlp.experts, KeptExperts) for layer in engine.model.layers)
        held = kept_description(engine.model)
        assert held == "32 linears kept quantized on the CPU (32 fp4), 32 of them experts'"


def test_gguf_logits_match_hf(tmp_path: Path) -> None:
    """The tiny model (with llama.cpp's fixed SwiGLU limit, 7.0) written as llama.cpp's
    converter lays out `gpt-oss` with float experts (tests/gpt_oss_gguf.py: gate / up split
    and transposed, down transposed, sinks, router with its bias): the same config as
    config.json's (the alternating windows from the sliding_window key, yarn untruncated),
    logits within TOLERANCE of transformers' over a whole prompt longer than the window and
    through the scheduled script."""
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine
    from tests.engine.model.test_model import BLOCK_SIZE
    from tests.gpt_oss_gguf import write_gpt_oss_gguf

    hf_dir = make_tiny_moe(tmp_path / "hf", "gpt_oss", seed=1, swiglu_limit=7.0)
    hf = Loaded(hf_dir)
    path = write_gpt_oss_gguf(hf_dir, tmp_path / "gpt-oss.gguf")
    from_hf, from_gguf = load_model_config(hf_dir), load_model_config(path)
    assert from_gguf.family == "gpt_oss"
    for field in ("moe", "layer_types", "sliding_window", "attention_sinks", "head_dim"):
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert from_gguf.rope_scaling is not None and from_gguf.rope_scaling["truncate"] is False
    config = EngineConfig(model=str(path), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE)
    engine = Engine(config)
    tokens = prompt(45, seed=1)
    (ours,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(ours, hf.hf_logits(tokens)) < TOLERANCE
    engine.reset()
    check_script_matches_hf(engine, hf.hf_logits, **SCRIPT)


def test_dummy_shapes_are_transformers_and_dummy_weights_load(tmp_path: Path) -> None:
    """The experts are stored in moe.cu's layout, yet the dummy loader's shapes are
    transformers' (every tensor of its state dict, on a model whose experts are not square:
    2 I != H), and a dummy engine of it loads and runs."""
    from safetensors import safe_open

    from llmserve.engine.config import EngineConfig
    from llmserve.engine.model.dummy import hf_tensor_shapes
    from llmserve.engine.step.engine import Engine
    from tests.engine.model.test_model import BLOCK_SIZE

    path = make_tiny_moe(tmp_path, "gpt_oss", seed=2, intermediate_size=16)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        hf = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert hf_tensor_shapes(load_model_config(path)) == hf
    engine = Engine(
        EngineConfig(model=str(path), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE,
                     load_format="dummy")
    )  # fmt: skip
    (out,) = forward_direct(engine, [(prompt(9, seed=2), 0, 9, shuffled_blocks(4)[:2])])
    assert torch.isfinite(out).all()
