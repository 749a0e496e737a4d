"""The mixture-of-experts families end to end in-process: tiny random Mixtral, Qwen3-MoE and
Qwen2-MoE checkpoints (tests/moe_models.py) through the engine, logits within 1e-4 of
transformers (float32) at every position of a whole and a chunked prompt and at every sampled
row of a scheduler-driven script with prefix-cache hits and preemptions, from the HF directory
and from a GGUF; speculative decoding; what the families refuse. Expert parallelism at T = 2:
tests/engine/model/families/test_family_features.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.model_config import check_parallel_sizes, load_model_config, valid_tp_sizes
from llmserve.engine.config import EngineConfig
from llmserve.engine.model.moe import SparseMoeBlock
from llmserve.engine.step.engine import Engine
from llmserve.scheduler.request import Request
from tests.engine.model.families.test_families import Loaded, check_script_matches_hf
from tests.engine.model.test_model import (
    BLOCK_SIZE,
    forward_direct,
    prompt,
    rel_err,
    shuffled_blocks,
)
from tests.factories import sampling
from tests.moe_models import MOE_CONFIGS, make_tiny_moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-4
FAMILIES = list(MOE_CONFIGS)


@pytest.fixture(scope="module")
def load(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, Loaded] = {}

    def get(family: str) -> Loaded:
        if family not in cache:
            path = make_tiny_moe(tmp_path_factory.mktemp(family), family, seed=len(cache))
            cache[family] = Loaded(path)
        cache[family].engine.reset()
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_registry_reads_the_experts(load: Any, family: str) -> None:
    m = load(family)
    config = load_model_config(m.path)
    assert config.family == family and config.moe is not None
    assert (config.moe.num_experts, config.moe.top_k) == (8, 2)
    blocks = [layer.mlp for layer in m.engine.model.layers]
    sparse = [isinstance(b, SparseMoeBlock) for b in blocks]
    assert sparse == ([True, False] if family == "qwen3_moe" else [True, True])
    assert (blocks[0].shared_expert is not None) == (family == "qwen2_moe")


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_prompt_and_chunks_all_positions(load: Any, family: str) -> None:
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


# 4 requests, 8 tokens out, in 14 blocks. Windowed Mixtral keeps its blocks out of the window
# here (their release is the dense families' test's): released, 14 blocks would hold all four
# and nothing would be preempted.
SCRIPT: dict[str, Any] = dict(num_requests=4, num_out=8, num_blocks=14, release_window=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_scheduled_script_matches_hf(load: Any, family: str) -> None:
    """tests/test_families.check_script_matches_hf: chunked prefills, prefix-cache hits and
    preemptions; every sampled row within 1e-4 of HF's logits at its position."""
    m = load(family)
    check_script_matches_hf(m.engine, m.hf_logits, **SCRIPT)


def test_quantization_is_refused_by_name(load: Any) -> None:
    path = load("mixtral").path
    with pytest.raises(ValueError, match=r"family mixtral \(MixtralForCausalLM\) does not supp"):
        Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=8, quantization="int8"))


def test_tp_sizes_keep_at_least_one_expert_a_rank(load: Any) -> None:
    config = load_model_config(load("qwen2_moe").path)  # 4 heads, 2 KV heads, shared 48
    assert check_parallel_sizes(config, 2, 1) is None
    assert config.moe is not None and config.moe.expert_range(1, 2) == range(4, 8)
    wide = replace(config, num_heads=16, num_kv_heads=16, intermediate_size=160)
    moe = replace(config.moe, shared_intermediate_size=40)
    assert valid_tp_sizes(replace(wide, moe=moe)) == [1, 2, 4, 8]  # not 16: 8 experts
    why = check_parallel_sizes(replace(wide, moe=replace(moe, shared_intermediate_size=20)), 8, 1)
    assert why is not None and "8 experts" in why and "shared expert width 20" in why


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_gives_the_same_tokens(load: Any, method: str) -> None:
    """Greedy tokens of Mixtral with speculative decoding (n-gram, or its first layer as the
    draft) equal those without: the verify step's sparse blocks see several tokens of a
    request at once."""
    from tests.spec_driver import drive, make_scheduler_for

    path = load("mixtral").path
    text = prompt(12, seed=4)
    prompts = [text * 3, prompt(20, seed=5) + text]  # repeats, so n-grams find matches
    greedy = sampling(temperature=0.0)

    def run(**spec: Any) -> dict[int, list[int]]:
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, **spec))
        requests = [
            Request(f"r{i}", i + 1, p, greedy, 12, ignore_eos=True)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)
        ]
        return drive(make_scheduler_for(engine), engine, requests).outputs

    extra = {"draft_num_layers": 1} if method == "draft" else {}
    assert run(speculative_method=method, num_speculative_tokens=3, **extra) == run()


def test_qwen3_30b_a3b_shape_has_its_published_size() -> None:
    """configs/qwen3-30b-a3b (for --load-format dummy): the model card's 30.5 B parameters,
    3.3 B of them active per token, counted off the meta-device model."""
    import math

    from llmserve.engine.model.dummy import hf_tensor_shapes

    config = load_model_config(Path(__file__).parents[4] / "configs" / "qwen3-30b-a3b")
    assert config.family == "qwen3_moe" and config.moe is not None
    # One layer's tensors counted 48 times (every layer is alike), the rest once.
    sizes = {n: math.prod(s) for n, s in hf_tensor_shapes(replace(config, num_layers=1)).items()}
    per_layer = config.num_layers
    total = sum(size * (per_layer if ".layers." in n else 1) for n, size in sizes.items())
    experts = per_layer * sum(size for n, size in sizes.items() if ".experts." in n)
    active = total - experts + experts * config.moe.top_k // config.moe.num_experts
    assert abs(total / 30.5e9 - 1) < 0.01 and abs(active / 3.3e9 - 1) < 0.03


@pytest.mark.parametrize("family", FAMILIES)
def test_gguf_logits_match_hf(load: Any, family: str, tmp_path: Path) -> None:
    """The checkpoint written as llama.cpp lays out qwen3moe / qwen2moe / Mixtral (the llama
    architecture with experts; stacked experts, tests/moe_models.write_moe_gguf): the same MoE
    shape as config.json's, logits within 1e-4 of HF's at every position of a whole prompt and
    of the scheduled script (chunked prefills, prefix-cache hits, preemptions)."""
    from tests.moe_models import write_moe_gguf

    m = load(family)
    path = write_moe_gguf(m.path, tmp_path / f"{family}.gguf", family)
    from_hf, from_gguf = load_model_config(m.path), load_model_config(path)
    assert from_gguf.family == family
    assert from_gguf.moe is not None and from_hf.moe is not None
    assert from_gguf.moe.dense_layers == from_hf.moe.dense_layers
    assert from_gguf.moe == from_hf.moe
    assert from_gguf.qkv_bias == from_hf.qkv_bias
    engine = Engine(
        EngineConfig(model=str(path), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE)
    )
    tokens = prompt(45, seed=1)
    (ours,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(11)[:6])])
    assert rel_err(ours, m.hf_logits(tokens)) < TOLERANCE
    engine.reset()
    check_script_matches_hf(engine, m.hf_logits, **SCRIPT)


def test_quantization_auto_stays_off_for_experts(load: Any, tmp_path: Path) -> None:
    """--quantization auto picks int8 on a CPU for a GGUF of Q8_0 projections; for an MoE family,
    which refuses quantization, it picks none and serves."""
    from tests.moe_models import write_moe_gguf

    path = write_moe_gguf(load("qwen3_moe").path, tmp_path / "q8.gguf", "qwen3_moe", True)
    config = EngineConfig(model=str(path), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE)
    engine = Engine(config)
    assert engine.config.quantization == "auto" and engine.quantization == "none"
    tokens = prompt(9, seed=2)
    (logits,) = forward_direct(engine, [(tokens, 0, len(tokens), shuffled_blocks(3)[:2])])
    assert bool(torch.isfinite(logits).all())
