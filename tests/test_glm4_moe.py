"""GLM-4.5 (DeepSeek-V3's MoE: sigmoid router with the score-correction bias, grouped top-k,
routed_scaling_factor, an ungated shared expert, first_k_dense_replace; GQA with partial
rotary, q/k norms and biases) against transformers on a tiny random checkpoint of its own config
class: every position whole and chunked, the scheduled script, and each routing rule shown to
matter."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from llmserve.common.model_config import load_model_config
from llmserve.engine.moe import SparseMoeBlock
from tests.test_families import TOLERANCE, check_script_matches_hf
from tests.test_model import forward_direct, prompt, rel_err, shuffled_blocks
from tests.test_moe_models import SCRIPT, load  # noqa: F401 (load: the module's fixture)

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
