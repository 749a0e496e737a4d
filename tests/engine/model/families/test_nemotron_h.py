"""Nemotron-H (NemotronHForCausalLM) against transformers on a tiny random NemotronHConfig
checkpoint (Mamba, MLP, attention, MLP, Mamba blocks) and a Nemotron 3 one with MoE blocks
(grouped sigmoid router with the correction bias, experts in a latent space, a shared
expert): every position of a whole prompt; two chunks with the state carried beside another
request, then a decode row; greedy decode; the scheduled script, both also at T = 2 x P = 2.
The step:
tests/engine/model/families/test_granite_hybrid.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.families.nemotron_h import read_nemotron_h
from llmserve.common.families.registry import ModelSourceError
from llmserve.common.model_config import check_parallel_sizes
from tests.engine.model.families.test_granite_hybrid import (
    TOLERANCE,
    Loaded,
    check_prompt,
    gguf_twin,
)
from tests.engine.model.families.test_qwen3_next import (
    check_group_script,
    check_rows,
    run_requests,
    script_requests,
)
from tests.engine.model.test_model import prompt, rel_err
from tests.factories import write_byte_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCKS = ["mamba", "mlp", "attention", "mlp", "mamba"]
# Nemotron 3's blocks: MoE in place of the MLPs; 8 experts in 4 groups, the best 2 groups;
# biases (random) on the latent projections and the shared expert (mlp_bias)
MOE_BLOCKS = ["mamba", "moe", "attention", "moe", "mamba"]
MOE = dict(
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    moe_latent_size=16, mlp_bias=True,
)  # fmt: skip


def make_nemotron(directory: Path, seed: int, blocks: list[str] = BLOCKS, **extra: Any) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.NemotronHConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_num_heads=4, mamba_head_dim=8, n_groups=2,
        ssm_state_size=8, conv_kernel=4, chunk_size=4, layer_types=blocks,
        initializer_range=0.2, tie_word_embeddings=False, max_position_embeddings=256, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("dt_bias", "A_log", "mixer.D", "conv1d.bias")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("gate.weight"):  # routing that differs token to token
                param.copy_(torch.randn_like(param))
            elif name.endswith("proj.bias"):
                param.copy_(torch.randn_like(param) * 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Loaded] = {}

    def get(variant: str) -> Loaded:
        if variant not in cache:
            directory = tmp_path_factory.mktemp(variant)
            if variant == "moe":
                path = make_nemotron(directory, 13, MOE_BLOCKS, **MOE)
            elif variant == "moe_one_group":  # Nemotron 3 Nano's routing: one group, no biases
                # (llama.cpp's converter maps no latent-projection or shared-expert bias)
                moe = {**MOE, "n_group": 1, "topk_group": 1, "mlp_bias": False}
                path = make_nemotron(directory, 17, MOE_BLOCKS, **moe)
            else:
                path = make_nemotron(directory, seed=11)
            cache[variant] = Loaded(path, "NemotronHForCausalLM")
        return cache[variant]

    return get


@pytest.fixture(scope="module")
def loaded(load: Any) -> Loaded:
    return load("dense")  # type: ignore[no-any-return]


def test_config_and_refusals(loaded: Loaded, tmp_path: Path) -> None:
    config = loaded.engine.model.config
    assert config.layer_types == ("mamba", "mlp", "full_attention", "mlp", "mamba")
    assert config.nope_layers == (0, 1, 2, 3, 4)
    # only the attention block has a slice of the KV pool; the two Mamba blocks a state layer
    assert (config.num_kv_layers, config.num_state_layers) == (1, 2)
    assert len(loaded.engine.runner.kv_caches) == 1
    assert read_nemotron_h({"hybrid_override_pattern": "M-*-M"})["layer_types"] == (
        config.layer_types
    )
    read = read_nemotron_h({"hybrid_override_pattern": "ME*", "n_routed_experts": 4})
    assert read["layer_types"] == ("mamba", "moe", "full_attention") and read["moe"].grouped
    with pytest.raises(ModelSourceError, match="num_experts_per_tok=6"):
        read_nemotron_h({"hybrid_override_pattern": "ME", "n_routed_experts": 4,
                         "num_experts_per_tok": 6})  # fmt: skip


def test_moe_config_and_weights(load: Any) -> None:
    """The MoE blocks' shape from config.json; the per-expert tensors and the correction bias
    loaded (the router in float32)."""
    m = load("moe")
    moe = m.engine.model.config.moe
    assert (moe.num_experts, moe.top_k, moe.num_groups, moe.topk_groups) == (8, 2, 4, 2)
    assert (moe.latent_size, moe.routed_scaling_factor) == (16, 2.5)
    ours, hf = m.engine.model.layers[3].mixer, m.hf.model.layers[3].mixer
    torch.testing.assert_close(ours.experts.down_proj[5], hf.experts.down_proj[5])
    torch.testing.assert_close(ours.gate.e_score_correction_bias, hf.gate.e_score_correction_bias)


@pytest.mark.parametrize("variant", ["dense", "moe"])
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


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_greedy_decode_matches_transformers(load: Any, variant: str) -> None:
    m = load(variant)
    want = prompt(7, seed=6)
    tokens = list(want)
    for _ in range(8):
        want.append(int(m.hf_logits(want)[-1].argmax()))
    (logits,) = m.forward([(tokens, 0, len(tokens), 1)])
    for _ in range(8):
        tokens.append(int(logits[-1].argmax()))
        (logits,) = m.forward([(tokens, len(tokens) - 1, len(tokens), 1)])
    assert tokens == want


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_scheduled_script_matches_hf(load: Any, variant: str) -> None:
    """test_qwen3_next's script through the real scheduler (chunked prefills, preemptions and
    recomputes, n = 2, the prefix cache off): every sampled row as transformers'."""
    m = load(variant)
    m.engine.reset()
    requests = script_requests()
    script = run_requests(m.engine, requests)
    assert script.num_partial_prefills > 0 and script.sched.counters.num_preemptions > 0
    check_rows(m, requests, script.rows)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_tensor_and_pipeline_parallel_match_hf(load: Any, variant: str) -> None:
    """T = 2 x P = 2, four gloo ranks: each rank 2 of the 4 Mamba heads with 1 of the 2 groups
    of B and C (so the gated norm's groups are the rank's own), half the MLP columns, 1 of
    the 2 KV heads; stage 0 blocks M - * (its one Mamba layer), stage 1 - M. The MoE blocks
    (E in the dense one's - places): 4 of the 8 experts a rank, half the shared expert's
    columns, the grouped router and the latent projections on both. The script gives
    transformers' rows on the driver, the same tokens on every rank."""
    loaded = load(variant)
    assert check_group_script(loaded) == [(1, 2, 8, 8)] * 4


def test_a_group_count_that_does_not_split_is_refused(load: Any) -> None:
    """Groups of B and C that neither divide by T nor are one: refused at start, naming them;
    MoE blocks split at T = 2 (8 experts, a shared expert of 24)."""
    config = load("dense").engine.model_config
    assert check_parallel_sizes(config, 2, 1) is None
    assert config.mamba2 is not None
    heads6 = dataclasses.replace(config.mamba2, num_heads=6, num_groups=3)
    why = check_parallel_sizes(dataclasses.replace(config, mamba2=heads6), 2, 1)
    assert why is not None and "mamba_n_groups=3" in why and "tensor_parallel_size=2" in why
    moe_config = load("moe").engine.model_config
    assert check_parallel_sizes(moe_config, 2, 2) is None


@pytest.mark.parametrize("variant", ["dense", "moe_one_group"])
def test_from_a_gguf_as_llama_cpps_converter_writes_it(
    load: Any, variant: str, tmp_path: Path
) -> None:
    """`nemotron_h` (dense) and `nemotron_h_moe` (the experts stacked, the correction bias as
    exp_probs_b, the latent projections): the blocks from the per-layer head_count_kv and
    feed_forward_length, the MoE from the expert keys, a prompt as transformers'."""
    m = gguf_twin(load(variant), tmp_path / f"{variant}.gguf")
    assert m.engine.model.config.moe == load(variant).engine.model.config.moe
    check_prompt(m)


def test_a_gguf_of_grouped_routing_without_the_kept_group_count_is_refused(
    load: Any, tmp_path: Path
) -> None:
    """The converter writes expert_group_count but not how many groups each token keeps: a
    file of 4 groups is refused naming both keys, not routed over a guessed count."""
    from llmserve.common.model_config import load_model_config
    from tests.mamba2_gguf import write_mamba2_gguf

    path = write_mamba2_gguf(load("moe").path, tmp_path / "grouped.gguf")
    with pytest.raises(ModelSourceError, match=r"expert_group_count=4 without .*group_used_count"):
        load_model_config(path)


def test_a_gguf_with_the_mtp_block_reads_the_model_without_it() -> None:
    """A Nemotron 3 file converted with its multi-token-prediction block: block_count counts it
    (attention and MoE at once), nextn_predict_layers says so; the model is the blocks before."""
    from llmserve.common.families.nemotron_h import read_nemotron_h_gguf

    a = "nemotron_h_moe"
    fields = {
        "tensor_names": {"blk.0.ssm_in.weight", "blk.0.ssm_conv1d.bias"},
        f"{a}.block_count": 4, f"{a}.nextn_predict_layers": 1,
        f"{a}.attention.head_count_kv": [0, 0, 2, 2], f"{a}.feed_forward_length": [0, 16, 0, 16],
        f"{a}.ssm.time_step_rank": 4, f"{a}.ssm.inner_size": 32, f"{a}.ssm.group_count": 2,
        f"{a}.ssm.state_size": 8, f"{a}.ssm.conv_kernel": 4, f"{a}.expert_count": 8,
        f"{a}.expert_used_count": 2, f"{a}.expert_feed_forward_length": 16,
        f"{a}.expert_shared_feed_forward_length": 24, f"{a}.expert_group_count": 1,
    }  # fmt: skip
    read = read_nemotron_h_gguf(fields, a)
    assert read["layer_types"] == ("mamba", "moe", "full_attention") and read["num_layers"] == 3
    assert read["moe"].num_experts == 8 and read["mamba2"].ssm_shape == (4, 8, 8)
