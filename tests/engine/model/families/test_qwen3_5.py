"""Qwen3.5 (Qwen3-Next's layers, the DeltaNet's projections stored flat, a dense MLP; and
Qwen3.5-MoE, a sparse block with a shared expert in every layer) against transformers on tiny
random checkpoints of Qwen3_5TextConfig / Qwen3_5MoeTextConfig, multimodal rope's
mrope_section in rope_parameters: every position of a whole prompt and of chunks carrying the
state (test_qwen3_next.py's checks, run on these models), the scheduled script, T = 2,
the text model served from a Qwen3_5ForConditionalGeneration directory (weights under
`model.language_model.`, a vision tower beside them), and each model from a `qwen35` /
`qwen35moe` GGUF as llama.cpp's converter writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.families import family_refusal
from llmserve.common.model_config import load_model_config
from llmserve.engine.config import EngineConfig
from llmserve.engine.parallel.ranks import run_group_locally
from tests.engine.model.families import test_qwen3_next as next_checks
from tests.engine.model.families.test_families import TOLERANCE, Loaded
from tests.engine.model.test_model import BLOCK_SIZE, prompt, rel_err, shuffled_blocks
from tests.factories import write_byte_tokenizer
from tests.family_models import COMMON

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Qwen3-Next's tiny shape (tests/moe_models.py QWEN3_NEXT): three DeltaNet layers and one
# attention layer, 2 key heads serving 4 value heads; rope as the released configs write it.
SHAPE = {
    "num_hidden_layers": 4,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
}
EXPERTS = {
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}


def make_qwen3_5(directory: Path, moe: bool, seed: int) -> Any:
    """A random Qwen3_5ForCausalLM (moe: Qwen3_5MoeForCausalLM) saved in directory, its norms,
    dt_bias and routers randomized so they matter; returns transformers' model."""
    import transformers

    fields = {**COMMON, **SHAPE}
    if moe:
        del fields["intermediate_size"]  # Qwen3.5-MoE has none
        config = transformers.Qwen3_5MoeTextConfig(**fields, **EXPERTS)
    else:
        config = transformers.Qwen3_5TextConfig(**fields)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "dt_bias")):
                param.copy_(torch.randn_like(param) * 0.5)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    return model


def make_multimodal(directory: Path, text_model: Any) -> None:
    """A Qwen3_5ForConditionalGeneration holding text_model's weights under
    `model.language_model.`, a one-block vision tower and an `mtp.` tensor (the released
    checkpoints carry a multi-token prediction head)."""
    import transformers

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 32, "num_heads": 2}
    text = text_model.config.to_dict()
    config = transformers.Qwen3_5Config(
        text_config=text, vision_config={**vision, "out_hidden_size": 64}
    )
    model = transformers.Qwen3_5ForConditionalGeneration(config).float()
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    model.lm_head.load_state_dict(text_model.lm_head.state_dict())
    model.save_pretrained(directory)
    write_byte_tokenizer(directory)
    from safetensors.torch import load_file, save_file

    file = str(directory / "model.safetensors")  # and a multi-token prediction head's tensor
    save_file({**load_file(file), "mtp.fc.weight": torch.ones(4, 4)}, file, {"format": "pt"})


@pytest.fixture(scope="module", params=["dense", "moe"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    directory = tmp_path_factory.mktemp(f"qwen3_5_{request.param}")
    # seeds whose float32 run is well conditioned: with seed 2 the MoE model's own float32
    # forward is 3.5e-4 (ours 1.5e-3) from its float64 one at one position of the prompt
    moe = request.param == "moe"
    make_qwen3_5(directory, moe, seed=7 if moe else 5)
    return Loaded(directory)


def test_registry_reads_the_family(model: Loaded) -> None:
    config = load_model_config(model.path)
    assert config.family == "qwen3_5" and config.partial_rotary_factor == 0.25
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.state_layout is not None
    assert config.state_layout.recurrent_shape == (4, 16, 8)
    assert type(model.engine.model).__name__ == "Qwen3_5ForCausalLM"
    if config.moe is None:  # Qwen3.5: dense everywhere
        assert config.intermediate_size == COMMON["intermediate_size"]
    else:  # every layer sparse, the top-k renormalised (transformers' router always does)
        assert config.moe.dense_layers == () and config.moe.renormalize
        assert config.moe.shared_intermediate_size == 48


def test_whole_prompt_and_chunks_carrying_the_state(model: Loaded) -> None:
    """test_qwen3_next.py's check: whole; chunks of 7, 1 and 20 beside another request."""
    next_checks.test_whole_prompt_and_chunks_carrying_the_state(model)


def test_the_state_matters(model: Loaded) -> None:
    next_checks.test_the_state_matters(model)


def test_scheduled_script_matches_hf(model: Loaded) -> None:
    """Chunked prefills, preemptions and recomputes, n = 2 in two slots, no prefix-cache hit:
    every sampled row as transformers'."""
    next_checks.test_scheduled_script_matches_hf(model)


def test_tensor_parallel_matches_hf(model: Loaded) -> None:
    """T = 2 on two gloo ranks (the flat parts' rows a rank holds: its key head's q and k, its
    2 value heads' v, z, b and a; 4 of the 8 experts; the shared expert by columns): the script
    as transformers' on the driver, the same tokens on both ranks, each state pool its heads'.
    Pipeline parallelism is Qwen3-Next's code unchanged (test_qwen3_next.py runs T = 2 x P = 2)."""
    if model.engine.model_config.moe is None:
        pytest.skip("the MoE model runs it (the DeltaNet split is the same)")
    config = EngineConfig(
        model=str(model.path), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE,
        tensor_parallel_size=2, num_threads=1, seed=0,
    )  # fmt: skip
    ranks = run_group_locally(config, next_checks._script_on_rank, timeout=300)
    tokens, rows = ranks[0][0], ranks[0][1] or ranks[1][1]
    assert ranks[0][2] > 0 and ranks[1][0] == tokens
    assert [rank[3] for rank in ranks] == [(3, config.max_num_seqs, 2, 16, 8)] * 2
    requests = next_checks.script_requests()
    for request, ids in zip(requests, tokens, strict=True):
        request.token_ids = ids
    next_checks.check_rows(model, requests, rows)


def test_served_from_the_multimodal_checkpoint(
    model: Loaded, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A Qwen3_5ForConditionalGeneration directory: config.json's text_config read, the weights
    under `model.language_model.` loaded (the vision tower's and mtp.'s left unread, on
    purpose: the after-load check does not refuse them), transformers' text logits."""
    if model.engine.model_config.moe is not None:
        pytest.skip("the dense model runs it (the prefix and config handling are the same)")
    directory = tmp_path_factory.mktemp("qwen3_5_multimodal")
    make_multimodal(directory, model.hf)
    names = _tensor_names(directory)
    assert any(k.startswith("model.visual.") for k in names) and "mtp.fc.weight" in names
    loaded = Loaded.__new__(Loaded)
    loaded.path, loaded.hf = directory, model.hf
    from llmserve.engine.step.engine import Engine

    engine = Engine(
        EngineConfig(model=str(directory), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE)
    )
    assert load_model_config(directory).family == "qwen3_5"
    tokens = prompt(30, seed=2)
    rows = [(tokens, 0, len(tokens), shuffled_blocks(7)[:4])]
    (got,) = next_checks.forward_rows(engine, rows, [0])
    assert rel_err(got, model.hf_logits(tokens)) < TOLERANCE


def test_from_a_gguf_as_llama_cpps_converter_writes_it(model: Loaded, tmp_path: Path) -> None:
    """The tiny model written as llama.cpp's converter writes `qwen35` / `qwen35moe`
    (tests/qwen3_next_gguf.write_qwen3_5_gguf: value heads tiled, A_log as -exp, norms as
    1 + w, an MTP layer counted in block_count, ...): the same shape read back, and every
    position of a prompt, prefilled whole then one decode row from its slot, within 1e-4 of
    transformers' logits, its greedy token at each."""
    from llmserve.common.gguf_file import open_gguf
    from llmserve.engine.step.engine import Engine
    from tests.qwen3_next_gguf import write_qwen3_5_gguf

    path = write_qwen3_5_gguf(model.path, tmp_path / "qwen3_5.gguf")
    moe = model.engine.model_config.moe is not None
    assert open_gguf(path).fields["general.architecture"] == ("qwen35moe" if moe else "qwen35")
    hf_config, config = load_model_config(model.path), load_model_config(path)
    fields = ("family", "num_layers", "layer_types", "gated_delta_net", "moe", "head_dim")
    for field in (*fields, "partial_rotary_factor", "intermediate_size"):
        assert getattr(config, field) == getattr(hf_config, field), field
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=96,
                                 block_size=BLOCK_SIZE))  # fmt: skip
    tokens, table = prompt(30, seed=7), shuffled_blocks(5)[:4]
    want = model.hf_logits(tokens)
    (head,) = next_checks.forward_rows(engine, [(tokens, 0, 29, table)], [2])
    (last,) = next_checks.forward_rows(engine, [(tokens, 29, 30, table)], [2])
    got = torch.cat((head, last))
    assert rel_err(got, want) < TOLERANCE
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def _tensor_names(directory: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return list(f.keys())


def test_what_the_family_refuses() -> None:
    for feature, words in [("speculative_decoding", "rejected proposal"), ("quantization", "")]:
        why = family_refusal("qwen3_5", [feature])
        assert why is not None and "qwen3_5" in why and words in why, feature
