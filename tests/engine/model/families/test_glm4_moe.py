"""GLM-4.5 (DeepSeek-V3's MoE: sigmoid router with the score-correction bias, grouped top-k,
routed_scaling_factor, an ungated shared expert, first_k_dense_replace; GQA with partial
rotary, q/k norms and biases) against transformers on a tiny random checkpoint of its own config
class: every position whole and chunked, the scheduled script, and each routing rule shown to
matter."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.model_config import load_model_config
from llmserve.engine.model.moe import SparseMoeBlock
from tests.engine.model.families.test_families import TOLERANCE, check_script_matches_hf
from tests.engine.model.families.test_moe_models import SCRIPT, load  # noqa: F401 (load: the module's fixture)
from tests.engine.model.test_model import (
    BLOCK_SIZE,
    forward_direct,
    prompt,
    rel_err,
    shuffled_blocks,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_registry_reads_the_deepseek_moe(load: Any) -> None:  # noqa: F811
    m = load("glm4_moe")
    config = load_model_config(m.path)
    moe = config.moe
    assert config.family == "glm4_moe" and moe is not None and moe.grouped
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups) == (8, 2, 4, 2)
    assert (moe.routed_scaling_factor, moe.shared_intermediate_size) == (2.5, 32)
    assert (config.rotary_dim, config.qk_norm, config.qkv_bias) == (8, True, True)
    blocks = [layer.mlp for layer in m.engine.model.layers]
    assert [isinstance(b, SparseMoeBlock) for b in blocks] == [False, True]


def test_whole_prompt_and_chunks_all_positions(load: Any) -> None:  # noqa: F811
    m = load("glm4_moe")
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


def test_scheduled_script_matches_hf(load: Any) -> None:  # noqa: F811
    m = load("glm4_moe")
    check_script_matches_hf(m.engine, m.hf_logits, **SCRIPT)


@pytest.mark.parametrize("rule", ["groups", "bias", "scale"])
def test_each_routing_rule_matters_for_these_prompts(load: Any, rule: str) -> None:  # noqa: F811
    """Routing without the group limit, without the correction bias, or unscaled moves the
    logits away from transformers'."""
    m = load("glm4_moe")
    block = m.engine.model.layers[1].mlp
    saved_moe, bias = block.moe, block.gate.e_score_correction_bias
    saved_bias = bias.detach().clone()
    if rule == "groups":
        block.moe = dataclasses.replace(saved_moe, topk_groups=saved_moe.num_groups)
    elif rule == "scale":
        block.moe = dataclasses.replace(saved_moe, routed_scaling_factor=1.0)
    else:
        bias.data.zero_()
    tokens = prompt(45, seed=1)
    try:
        (ours,) = forward_direct(m.engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    finally:
        block.moe = saved_moe
        bias.data.copy_(saved_bias)
    assert rel_err(ours, m.hf_logits(tokens)) > 1e-2


@pytest.mark.parametrize(("groups", "kept"), [(1, 1), (4, 2), (8, 3)])
def test_router_matches_transformers(groups: int, kept: int) -> None:
    """route_grouped against transformers' own GLM-4.5 router module on random tokens: the same
    experts and weights (in expert order: both take top-k unsorted). GLM-4.5's released configs
    have one group."""
    import transformers
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    from llmserve.common.moe_config import moe_from_hf
    from llmserve.engine.model.moe import route_grouped

    fields = {"n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": groups}
    fields.update(topk_group=kept, routed_scaling_factor=1.8, hidden_size=32)
    hf_config = transformers.Glm4MoeConfig(**fields)
    torch.manual_seed(groups)
    router = Glm4MoeTopkRouter(hf_config)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(std=0.5)
    x = torch.randn(64, 32)
    _, want_weights, want_ids = router(x)
    cfg = {"architectures": ["Glm4MoeForCausalLM"], "num_hidden_layers": 2, **fields}
    moe = moe_from_hf({**cfg, "moe_intermediate_size": 8})
    assert moe is not None
    weights, ids = route_grouped(x @ router.weight.T, router.e_score_correction_bias, moe)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_weights.gather(1, want_order))


def test_router_stays_float32_in_a_bfloat16_engine(load: Any) -> None:  # noqa: F811
    """As transformers keeps them: the router's weight and correction bias in float32, loaded
    unrounded, while the rest of the model is bfloat16; the engine still serves a step."""
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine

    m = load("glm4_moe")
    config = EngineConfig(model=str(m.path), device="cpu", dtype="bfloat16", num_kv_blocks=96)
    engine = Engine(config)
    block = engine.model.layers[1].mlp
    bias = block.gate.e_score_correction_bias
    assert block.gate.weight.dtype == bias.dtype == torch.float32
    assert block.experts.w13.dtype == torch.bfloat16
    want = m.engine.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(bias, want)  # not rounded through bfloat16 on the way
    assert not torch.equal(bias.bfloat16().float(), want)
    tokens = prompt(20, seed=2)
    (logits,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:3])])
    assert torch.isfinite(logits).all()


def test_from_a_gguf_as_llama_cpps_converter_writes_it(load: Any, tmp_path: Path) -> None:  # noqa: F811
    """The tiny model written as llama.cpp's converter writes `glm4moe` (tests/glm4_moe_gguf:
    experts stacked, `exp_probs_b.bias`, an MTP layer counted in block_count, ...): the same
    shape read back (the MTP layer not among the model's), and every position of a prompt
    within 1e-4 of transformers' logits, its greedy token at each."""
    from llmserve.engine.config import EngineConfig
    from llmserve.engine.step.engine import Engine
    from tests.glm4_moe_gguf import write_glm4_moe_gguf

    m = load("glm4_moe")
    path = write_glm4_moe_gguf(m.path, tmp_path / "glm4_moe.gguf")
    hf_config, config = load_model_config(m.path), load_model_config(path)
    fields = ("family", "num_layers", "num_mtp_layers", "moe", "head_dim", "qkv_bias")
    for field in (*fields, "attention_bias", "rotary_dim", "qk_norm", "intermediate_size"):
        assert getattr(config, field) == getattr(hf_config, field), field
    assert config.num_layers == 2 and config.num_mtp_layers == 1
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=96,
                                 block_size=BLOCK_SIZE))  # fmt: skip
    tokens = prompt(30, seed=3)
    want = m.hf_logits(tokens)
    (got,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:4])])
    assert rel_err(got, want) < TOLERANCE
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_a_gguf_of_another_router_is_refused_by_name() -> None:
    """A `glm4moe` file whose expert_gating_func is not sigmoid (2) is refused, naming the key."""
    from llmserve.common.families.moe import read_glm4_moe_gguf
    from llmserve.common.families.registry import ModelSourceError

    fields = {"glm4moe.expert_gating_func": 1, "glm4moe.block_count": 2, "tensor_names": set()}
    with pytest.raises(ModelSourceError, match=r"glm4moe\.expert_gating_func=1: only the sigmoid"):
        read_glm4_moe_gguf(fields, "glm4moe")
