"""DeepSeek-V3 (multi-head latent attention over a latent KV pool, DeepSeek-V3's MoE) against
transformers on tiny random checkpoints of DeepseekV3Config (tests/moe_models.py): with the q
latent, interleaved rotary pairs and yarn with both mscales, and without any of them; every position
of a whole and a chunked prompt, the scheduled script (chunked prefill, prefix-cache hits,
preemptions, paged decode over several blocks), greedy tokens; the pool's bytes per token are the
latent's; what the family refuses. At T = 2 and P = 2:
tests/engine/model/families/test_family_features.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.families import family_refusal
from llmserve.common.model_config import load_model_config
from llmserve.engine.config import EngineConfig
from llmserve.engine.kv.cache import bytes_per_block, bytes_per_token
from llmserve.engine.model.families.deepseek import MLAttention
from llmserve.engine.model.moe import SparseMoeBlock
from llmserve.engine.model.ops import kernel_limits
from llmserve.engine.step.engine import Engine
from tests.engine.model.families.test_families import TOLERANCE, Loaded, check_script_matches_hf
from tests.engine.model.families.test_moe_models import SCRIPT
from tests.engine.model.test_model import (
    BLOCK_SIZE,
    forward_direct,
    prompt,
    rel_err,
    shuffled_blocks,
)
from tests.moe_models import DEEPSEEK_V3, make_tiny_moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS = ["deepseek_v3", "deepseek_v3_plain"]


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Loaded] = {}

    def get(variant: str) -> Loaded:
        if variant not in cache:
            path = make_tiny_moe(tmp_path_factory.mktemp(variant), variant, seed=3)
            cache[variant] = Loaded(path)
        cache[variant].engine.reset()
        return cache[variant]

    return get


def test_registry_reads_mla_and_the_pool_holds_the_latent(load: Any) -> None:
    """The pool is [layers, 1, blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]; its
    bytes per token, the figure the engine reports (EngineInfo.kv_block_bytes), are the
    latent's: 2 layers x (32 + 8) x 4 bytes, against 2 x 2 x 4 heads x (24 + 12) / 2 x 4 for
    transformers' per-head K and V."""
    m = load("deepseek_v3")
    config = load_model_config(m.path)
    mla, moe = config.mla, config.moe
    assert config.family == "deepseek_v3" and mla is not None and moe is not None
    assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.q_lora_rank) == (32, 8, 48)
    assert (moe.grouped, moe.num_groups, moe.dense_layers) == (True, 4, (0,))
    layers = m.engine.model.layers
    assert all(isinstance(layer.self_attn, MLAttention) for layer in layers)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in layers] == [False, True]
    engine = m.engine
    assert tuple(engine.kv_cache.shape) == (2, 1, 96, BLOCK_SIZE, 1, 40)
    assert bytes_per_token(config, torch.float32) == 2 * 40 * 4
    assert engine.info.kv_block_bytes == bytes_per_block(config, BLOCK_SIZE, torch.float32)
    assert engine.info.kv_block_bytes == BLOCK_SIZE * 2 * 40 * 4
    per_head_kv = 2 * 2 * 4 * (24 + 12) // 2 * 4  # layers x (K + V) x heads x mean width x fp32
    assert bytes_per_token(config, torch.float32) < per_head_kv


@pytest.mark.parametrize("variant", VARIANTS)
def test_whole_prompt_and_chunks_all_positions(load: Any, variant: str) -> None:
    m = load(variant)
    tokens = prompt(45, seed=1)
    want = m.hf_logits(tokens)
    (whole,) = forward_direct(m.engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(whole, want) < TOLERANCE
    table = shuffled_blocks(12)[:6]
    chunks = [
        forward_direct(m.engine, [(tokens, s, min(s + 7, len(tokens)), table)])[0]
        for s in range(0, len(tokens), 7)
    ]
    assert rel_err(torch.cat(chunks), want) < TOLERANCE


@pytest.mark.parametrize("variant", VARIANTS)
def test_scheduled_script_matches_hf(load: Any, variant: str) -> None:
    """Chunked prefills, prefix-cache hits, preemptions and decodes over several blocks of the
    latent pool; every sampled row within 1e-4 of transformers' and its greedy token."""
    m = load(variant)
    check_script_matches_hf(m.engine, m.hf_logits, **SCRIPT)


def test_interleaved_rotary_matters_for_these_prompts(load: Any, tmp_path: Path) -> None:
    """The checkpoint read as rotate-half (rope_interleave false, so its rows stay as they are)
    moves the logits away from transformers'."""
    m = load("deepseek_v3")
    for file in m.path.iterdir():
        (tmp_path / file.name).symlink_to(file)
    cfg = json.loads((m.path / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_interleave": False}))
    engine = Engine(
        EngineConfig(model=str(tmp_path), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE)
    )
    tokens = prompt(45, seed=1)
    (ours,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(ours, m.hf_logits(tokens)) > 1e-2


def test_yarn_mscale_in_the_softmax_scale_matters(load: Any) -> None:
    """Without yarn's mscale_all_dim squared in the softmax scale, the logits move away."""
    m = load("deepseek_v3")
    layers = [layer.self_attn for layer in m.engine.model.layers]
    scales = [a.scale for a in layers]
    tokens = prompt(45, seed=1)
    try:
        for a in layers:
            a.scale = a.mla.qk_head_dim**-0.5
        (ours,) = forward_direct(m.engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    finally:
        for a, scale in zip(layers, scales, strict=True):
            a.scale = scale
    assert scales[0] != layers[0].mla.qk_head_dim ** -0.5
    assert rel_err(ours, m.hf_logits(tokens)) > 1e-2


def test_what_the_family_refuses(load: Any) -> None:
    """Quantization is refused by name at start, a LoRA adapter when loaded; the CUDA kernels
    take MLA (kernels/mla_decode.cu) within their limits and say why not outside them (the
    engine then runs the torch path, or --attention-backend cuda refuses). Tensor and pipeline
    parallelism: tests/engine/model/families/test_family_features.py."""
    config = load_model_config(load("deepseek_v3_plain").path)
    why = family_refusal("deepseek_v3", ["tensor_parallel", "pipeline_parallel", "quantization"])
    assert why is not None and "DeepseekV3ForCausalLM" in why and "quantization" in why
    adapters = load("deepseek_v3_plain").engine.adapters
    with pytest.raises(ValueError, match="does not support lora: multi-head latent attention"):
        adapters.add("a", "/nonexistent")  # refused before the path is read
    why = kernel_limits(config, torch.bfloat16, 16)  # the kernels read the latent pool (rank 32)
    assert why is not None and "rotary dimension 8" in why  # but rotate multiples of 16 only
    rope16 = dataclasses.replace(config, head_dim=16)
    assert kernel_limits(rope16, torch.bfloat16, 16) is None
    assert config.mla is not None
    wide = dataclasses.replace(rope16, mla=dataclasses.replace(config.mla, kv_lora_rank=520))
    why = kernel_limits(wide, torch.bfloat16, 16)
    assert why is not None and "kv_lora_rank <= 512" in why
    plain = dataclasses.replace(config, mla=None, moe=None, head_dim=64, intermediate_size=128)
    assert kernel_limits(plain, torch.bfloat16, 16) is None


def test_a_kimi_k2_config_reads_as_deepseek_v3(load: Any, tmp_path: Path) -> None:
    cfg = json.loads((load("deepseek_v3").path / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(tmp_path).family == "deepseek_v3"
    cfg["topk_method"] = "greedy"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="topk_method='greedy' is not served"):
        load_model_config(tmp_path)


def test_speculation_gives_the_same_tokens(load: Any) -> None:
    """The model's first layer proposes 3 tokens a step; the verify step writes several latents
    of a request at once and rolls back the rejected ones: greedy tokens equal those without."""
    from llmserve.scheduler.request import Request
    from tests.factories import sampling
    from tests.spec_driver import drive, make_scheduler_for

    m = load("deepseek_v3_plain")
    prompts = [prompt(36, seed=4), prompt(32, seed=5)]
    greedy = sampling(temperature=0.0)

    def run(engine: Engine) -> tuple[Any, Any]:
        requests = [
            Request(f"r{i}", i + 1, p, greedy, 12, ignore_eos=True)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)
        ]
        scheduler = make_scheduler_for(engine)
        return drive(scheduler, engine, requests).outputs, scheduler.counters.spec

    spec = EngineConfig(
        model=str(m.path), device="cpu", num_kv_blocks=64, speculative_method="draft",
        num_speculative_tokens=3, draft_num_layers=1,
    )  # fmt: skip
    (speculated, counts), (plain, _) = run(Engine(spec)), run(m.engine)
    assert speculated == plain
    assert counts.num_spec_draft_tokens > 0


def test_the_mtp_layer_is_left_unread_on_purpose(load: Any, tmp_path: Path) -> None:
    """A checkpoint that stores the multi-token prediction layer after the model's own
    (num_nextn_predict_layers = 1: model.layers.2.* here, as DeepSeek-V3's release stores
    layers.61) loads; a tensor past it is still refused by the after-load check."""
    from safetensors.torch import load_file, save_file

    from llmserve.common.model_config import ModelSourceError

    source = load("deepseek_v3_plain").path
    for file in source.iterdir():
        if file.name != "model.safetensors":
            (tmp_path / file.name).symlink_to(file)
    tensors = load_file(source / "model.safetensors")
    assert load_model_config(source).num_mtp_layers == 1
    tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = EngineConfig(model=str(tmp_path), device="cpu", num_kv_blocks=8, max_loras=0)
    Engine(config)
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelSourceError, match=r"\['model.layers.3.eh_proj.weight'\]"):
        Engine(config)


# rotary of the deepseek2 GGUF tests: none, and yarn with mscale = mscale_all_dim (what DeepSeek
# releases, and all a GGUF keeps: llama.cpp's converter writes 0.1 * mscale_all_dim alone)
GGUF_ROPE = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "yarn": {**DEEPSEEK_V3["rope_parameters"], "mscale": 0.8, "mscale_all_dim": 0.8},
}


@pytest.mark.parametrize("rope", list(GGUF_ROPE))
def test_deepseek2_gguf_logits_match_hf(tmp_path: Path, rope: str) -> None:
    """The tiny model (q latent, interleaved rotary) written as llama.cpp's converter lays out
    `deepseek2` (tests/deepseek_gguf.py: kv_b split into attn_k_b / attn_v_b, MQA metadata,
    stacked experts): the same MLA and MoE shape as config.json's, logits within TOLERANCE of
    transformers' over a whole prompt and, without rope scaling, through the scheduled script
    (chunked prefills, prefix-cache hits, preemptions)."""
    from tests.deepseek_gguf import write_deepseek2_gguf

    hf_dir = make_tiny_moe(tmp_path / "hf", "deepseek_v3", seed=3, rope_parameters=GGUF_ROPE[rope])
    model = Loaded(hf_dir)
    path = write_deepseek2_gguf(hf_dir, tmp_path / "deepseek2.gguf")
    from_hf, from_gguf = load_model_config(hf_dir), load_model_config(path)
    assert from_gguf.family == "deepseek_v3"
    for field in ("mla", "moe", "head_dim", "num_kv_heads", "num_layers"):
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert from_gguf.attention_scale == pytest.approx(from_hf.attention_scale, rel=1e-6)
    config = EngineConfig(model=str(path), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE)
    engine = Engine(config)
    tokens = prompt(45, seed=1)
    (ours,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(ours, model.hf_logits(tokens)) < TOLERANCE
    if rope == "default":
        engine.reset()
        check_script_matches_hf(engine, model.hf_logits, **SCRIPT)


def test_deepseek2_gguf_with_a_softmax_router_is_refused_by_name() -> None:
    """DeepSeek-V2's softmax router (llama.cpp's gating function 1) is not served."""
    from llmserve.common.families import ModelSourceError
    from llmserve.common.families.deepseek import read_deepseek2_gguf

    with pytest.raises(ModelSourceError, match=r"expert_gating_func=1: only DeepSeek-V3's"):
        read_deepseek2_gguf({"deepseek2.expert_gating_func": 1}, "deepseek2")
