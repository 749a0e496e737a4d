"""yarn and dynamic NTK rope scaling, and SmolLM3's layers without rotary, against transformers:
the frequencies and the cos/sin scale of each parameter set against transformers' own rope
functions, and tiny Llama / Qwen3 models with yarn or dynamic scaling and a tiny SmolLM3 at every
prompt position, whole and chunked, and through a scheduler-driven script (chunked prefill,
prefix-cache hits, preemptions)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.model_config import load_model_config
from llmserve.engine.model.rotary import rope_attention_factor, rope_inv_freq
from tests.engine.model.families.test_families import (  # noqa: F401 (load: the module-scoped fixture)
    NUM_OUT,
    TOLERANCE,
    _unscaled_rope,
    check_script_matches_hf,
    load,
    script_blocks,
)
from tests.engine.model.test_model import forward_direct, prompt, rel_err, shuffled_blocks
from tests.family_models import ROPE_CONFIGS

pytestmark = pytest.mark.usefixtures("one_torch_thread")

YARN = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0}
# Each: (config fields, what it exercises).
PARAMETER_SETS: dict[str, dict[str, Any]] = {
    "yarn": {"rope_parameters": {**YARN, "original_max_position_embeddings": 256}},
    "yarn-untruncated-betas": {
        "rope_parameters": {
            **YARN,
            "original_max_position_embeddings": 512,
            "beta_fast": 24,
            "beta_slow": 2,
            "truncate": False,
        }
    },
    "yarn-deepseek-mscale": {  # DeepSeek-V3: no factor, mscale / mscale_all_dim
        "max_position_embeddings": 4096,
        "rope_parameters": {
            **YARN,
            "factor": None,
            "original_max_position_embeddings": 1024,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    },
    "yarn-attention-factor": {
        "rope_parameters": {
            **YARN,
            "original_max_position_embeddings": 256,
            "attention_factor": 0.9,
        }
    },
    "yarn-top-level-original": {  # the top-level field wins, as transformers reads it
        "original_max_position_embeddings": 128,
        "rope_parameters": {**YARN, "original_max_position_embeddings": 512},
    },
    "dynamic": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e5}},
}


@pytest.mark.parametrize("name", PARAMETER_SETS)
def test_frequencies_and_scale_match_transformers(name: str, tmp_path: Path) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {"hidden_size": 256, "num_attention_heads": 4, "max_position_embeddings": 2048}
    config = transformers.LlamaConfig(**{**fields, **PARAMETER_SETS[name]})
    config.save_pretrained(tmp_path)
    ours = load_model_config(tmp_path)
    rope_type = config.rope_parameters["rope_type"]
    want, want_scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    got = rope_inv_freq(ours, max_positions=ours.max_position_embeddings)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(want_scale, rel=1e-9)
    if rope_type == "yarn":  # the scaling did something these sets can see
        unscaled = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
        assert not torch.allclose(got, unscaled)


@pytest.mark.parametrize("family", ROPE_CONFIGS)
def test_whole_prompt_and_chunks_all_positions(load: Any, family: str) -> None:  # noqa: F811
    m = load(family)
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


@pytest.mark.parametrize("family", ["llama-yarn", "qwen3-yarn", "smollm3"])
def test_scheduled_script_matches_hf(load: Any, family: str) -> None:  # noqa: F811
    m = load(family)
    check_script_matches_hf(m.engine, m.hf_logits, 6, NUM_OUT, script_blocks(m.engine))


@pytest.mark.parametrize("family", ["llama-yarn", "qwen3-yarn"])
def test_yarn_matters_for_these_prompts(load: Any, family: str) -> None:  # noqa: F811
    m = load(family)
    tokens = prompt(45, seed=1)
    undo = _unscaled_rope(m.engine.model)
    try:
        (ours,) = forward_direct(m.engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    finally:
        undo()
    assert rel_err(ours, m.hf_logits(tokens)) > 1e-2


def test_smollm3_reads_its_nope_layers(load: Any) -> None:  # noqa: F811
    from llmserve.common.families.smollm3 import nope_layers

    assert load_model_config(load("smollm3").path).nope_layers == (1,)
    assert nope_layers(8, None, 4) == (3, 7)  # the released models' default interval


def test_smollm3_nope_matters_for_these_prompts(load: Any) -> None:  # noqa: F811
    """Rotating the NoPE layer too moves the logits away from transformers'."""
    m = load("smollm3")
    attention = m.engine.model.layers[1].self_attn
    saved = attention.rotary_emb
    attention.rotary_emb = m.engine.model.rotary_emb
    tokens = prompt(45, seed=1)
    try:
        (ours,) = forward_direct(m.engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    finally:
        attention.rotary_emb = saved
    assert rel_err(ours, m.hf_logits(tokens)) > 1e-2


def test_yarn_gguf_logits_match_hf(load: Any, tmp_path: Path) -> None:  # noqa: F811
    """llama-yarn written as llama.cpp's converter writes yarn (type, factor, original context):
    the same rope settings as from the HF directory, logits within 1e-4 of transformers'."""
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine
    from tests.family_gguf import write_family_gguf

    m = load("llama-yarn")
    path = write_family_gguf(m.path, tmp_path / "yarn.gguf", "llama-yarn")
    scaling = load_model_config(path).rope_scaling
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=96, block_size=8))
    tokens = prompt(45, seed=1)
    (whole,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(whole, m.hf_logits(tokens)) < TOLERANCE


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"llama.rope.scaling.type": "dynamic"}, "llama.rope.scaling.type 'dynamic'"),
        ({"llama.rope.scaling.yarn_log_multiplier": 0.1}, "llama.rope.scaling.yarn_log_multiplier"),
    ],
)
def test_gguf_rope_scaling_we_do_not_map_is_refused(extra: dict[str, Any], field: str) -> None:
    from llmserve.common.model_config import ModelSourceError, _gguf_rope_scaling

    fields = {
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 16,
        **extra,
    }
    with pytest.raises(ModelSourceError, match=field):
        _gguf_rope_scaling(fields, "llama", lambda key: fields[key.replace("{arch}", "llama")])


def test_smollm3_gguf_logits_match_hf(load: Any, tmp_path: Path) -> None:  # noqa: F811
    """A 4-layer SmolLM3 (NoPE on the 4th, llama.cpp's fixed interval) written as llama.cpp's
    converter writes it (Llama's layout, q / k rows permuted): its NoPE layers read, logits
    within 1e-4 of transformers'."""
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine
    from tests.family_gguf import write_family_gguf

    m = load("smollm3", num_hidden_layers=4, no_rope_layer_interval=4)
    path = write_family_gguf(m.path, tmp_path / "smollm3.gguf", "smollm3")
    assert load_model_config(path).nope_layers == load_model_config(m.path).nope_layers == (3,)
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=96, block_size=8))
    tokens = prompt(45, seed=1)
    (whole,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(whole, m.hf_logits(tokens)) < TOLERANCE
