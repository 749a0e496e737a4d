"""Falcon-H1 (FalconH1ForCausalLM) against transformers on tiny random FalconH1Config
checkpoints (every layer attention and a Mamba-2 mixer side by side; every muP multiplier != 1):
every position of a whole prompt; two chunks with the state carried in a slot beside another
request, then a decode row; greedy decode; the scheduled script (chunked prefill, preemption
and recompute, n = 2), also at T = 2 x P = 2. The step:
tests/engine/model/families/test_granite_hybrid.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.families import family_refusal
from llmserve.common.families.falcon_h1 import read_falcon_h1
from llmserve.common.families.registry import ModelSourceError
from tests.engine.model.families.test_granite_hybrid import (
    TOLERANCE,
    Loaded,
    check_prompt,
    gguf_twin,
    save_mamba2_model,
)
from tests.engine.model.families.test_qwen3_next import (
    check_group_script,
    check_rows,
    run_requests,
    script_requests,
)
from tests.engine.model.test_model import prompt, rel_err

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VARIANTS: dict[str, dict[str, Any]] = {
    # the released models' shape: no gated norm in the mixer, mamba_d_ssm given, multipliers;
    # one group of B and C (FalconH1Config's default: kept whole on every rank under T)
    "mup": dict(
        mamba_d_ssm=48, mamba_n_groups=1, mamba_rms_norm=False, embedding_multiplier=2.0,
        lm_head_multiplier=0.7, key_multiplier=0.5, attention_in_multiplier=1.5,
        attention_out_multiplier=0.8,
        ssm_in_multiplier=1.3, ssm_out_multiplier=0.6, mlp_multipliers=[1.4, 0.9],
        ssm_multipliers=[0.5, 1.2, 0.8, 1.6, 0.7],
    ),
    # the mixer's gated RMSNorm, normalizing before the gate; its width from mamba_expand
    "gated_norm": dict(mamba_d_ssm=None, mamba_expand=1, mamba_rms_norm=True,
                       mamba_norm_before_gate=True, mamba_n_groups=2),
}  # fmt: skip


def make_falcon(directory: Path, variant: str, seed: int) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.FalconH1Config(
        vocab_size=256, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4,
        mamba_d_state=8, mamba_d_conv=4, mamba_chunk_size=4, max_position_embeddings=256,
        initializer_range=0.2, tie_word_embeddings=False, **VARIANTS[variant],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.FalconH1ForCausalLM(config).float()
    return save_mamba2_model(model, directory)


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Loaded] = {}

    def get(variant: str) -> Loaded:
        if variant not in cache:
            path = make_falcon(tmp_path_factory.mktemp(variant), variant, seed=len(cache) + 21)
            cache[variant] = Loaded(path, "FalconH1ForCausalLM")
        return cache[variant]

    return get


def test_config_state_pool_and_refusals(load: Any) -> None:
    """Every layer keeps KV and a state; the pool is [layers, slots, ...] of the mixer's shape
    (mamba_d_ssm = 48: 4 heads of 12, one group); speculation / quantization refused by name,
    tensor and pipeline parallelism not."""
    engine = load("mup").engine
    config = engine.model.config
    assert config.layer_types == ("hybrid", "hybrid")
    assert (config.num_kv_layers, config.num_state_layers) == (2, 2)
    assert config.mamba2 is not None and config.mamba2.ssm_shape == (4, 12, 8)
    assert engine.state_pool.conv.shape[:3] == (2, engine.info.num_state_slots, 48 + 2 * 8)
    for feature in ("speculative_decoding", "quantization"):
        assert family_refusal("falcon_h1", [feature]) is not None, feature
    assert family_refusal("falcon_h1", ["tensor_parallel", "pipeline_parallel"]) is None
    with pytest.raises(ModelSourceError, match="ssm_multipliers has 3 entries"):
        cfg = {"num_attention_heads": 4, "hidden_size": 32, "num_hidden_layers": 1}
        read_falcon_h1({**cfg, "mamba_d_ssm": 64, "mamba_n_heads": 4, "ssm_multipliers": [1, 1, 1]})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_whole_prompt_and_carried_chunks(load: Any, variant: str) -> None:
    m = load(variant)
    a, b = prompt(12, seed=4), prompt(9, seed=5)
    (whole,) = m.forward([(a, 0, 12, 3)])
    assert rel_err(whole, m.hf_logits(a)) < TOLERANCE
    (a1,) = m.forward([(a, 0, 6, 2)])
    a2, b1 = m.forward([(a, 6, 11, 2), (b, 0, 9, 0)])
    a3, b2 = m.forward([(a, 11, 12, 2), ([*b, 7], 9, 10, 0)])
    assert rel_err(torch.cat((a1, a2, a3)), m.hf_logits(a)) < TOLERANCE
    assert rel_err(torch.cat((b1, b2)), m.hf_logits([*b, 7])) < TOLERANCE


def test_greedy_decode_matches_transformers(load: Any) -> None:
    m = load("mup")
    want = prompt(7, seed=6)
    tokens = list(want)
    for _ in range(8):
        want.append(int(m.hf_logits(want)[-1].argmax()))
    (logits,) = m.forward([(tokens, 0, len(tokens), 1)])
    for _ in range(8):
        tokens.append(int(logits[-1].argmax()))
        (logits,) = m.forward([(tokens, len(tokens) - 1, len(tokens), 1)])
    assert tokens == want


def test_scheduled_script_matches_hf(load: Any) -> None:
    """test_qwen3_next's script through the real scheduler (chunked prefills, preemptions and
    recomputes, n = 2, the prefix cache off): every sampled row as transformers'."""
    m = load("mup")
    m.engine.reset()
    requests = script_requests()
    script = run_requests(m.engine, requests)
    sched = script.sched
    assert script.num_partial_prefills > 0 and sched.counters.num_preemptions > 0
    assert sched.state_slots.num_free_slots == sched.state_slots.num_slots
    check_rows(m, requests, script.rows)
    assert requests[0].token_ids == requests[1].token_ids


def test_tensor_and_pipeline_parallel_match_hf(load: Any) -> None:
    """T = 2 x P = 2, four gloo ranks, on the released shape (every multiplier != 1, one group
    of B and C): each rank 2 of the 4 Mamba heads (their gate, x and dt rows of in_proj with
    their mup factors, conv channels, A_log / D / dt_bias, out_proj columns; B and C whole), 2
    of the 4 query heads and 1 of the 2 KV heads, half the MLP's columns; stage 0 layer 0,
    stage 1 layer 1, each with its own KV and state pools. The script gives transformers'
    logits and greedy tokens on the driver, the same tokens on every rank."""
    m = load("mup")
    # each rank: its stage's one state layer, 2 heads of 12 channels, state size 8
    assert check_group_script(m) == [(1, 2, 12, 8)] * 4


def test_from_a_gguf_as_llama_cpps_converter_writes_it(load: Any, tmp_path: Path) -> None:
    """`falcon-h1`: every muP multiplier multiplied into the weights by the converter (none
    written as a key, so all read as 1), the mixer's tensors rewritten as Mamba-2's: a prompt
    as transformers' (which applies the multipliers at run time)."""
    m = gguf_twin(load("mup"), tmp_path / "falcon.gguf")
    config = m.engine.model.config
    assert config.embed_scale == 1.0 and config.falcon_multipliers is not None
    assert config.falcon_multipliers.lm_head == 1.0
    assert config.mamba2 is not None and config.mamba2.proj_multipliers == (1.0,) * 5
    check_prompt(m)
