"""The engine features on every family's tiny random model (tests/family_models.py,
tests/moe_models.py): tensor and pipeline parallelism at 2 ranks (one group of gloo processes
each, loading every family in turn) against one engine, speculative decoding against plain
decoding, int8 / fp8 weights against float32; what a family cannot do is refused by name
(tests/engine/model/families/test_families.py: test_a_refused_feature_stops_the_engine_at_start)."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.engine.config import EngineConfig
from llmserve.engine.parallel.ranks import run_group_locally
from llmserve.engine.step.engine import Engine
from llmserve.scheduler.request import Request
from tests.engine.model.test_model import BLOCK_SIZE, forward_direct, prompt, rel_err
from tests.factories import sampling
from tests.family_models import ENGINE_SETTINGS, FAMILY_CONFIGS, make_tiny_family
from tests.moe_models import MOE_CONFIGS, make_tiny_moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOLERANCE = 1e-4
DENSE = list(FAMILY_CONFIGS)
# SmolLM3, GLM-4.5, DeepSeek-V3 (MLA) and gpt-oss: out of DENSE and MOE_CONFIGS (GLM-4.5 has no
# GGUF writer; DeepSeek-V3's and gpt-oss's are their own: tests/deepseek_gguf.py, gpt_oss_gguf.py)
NO_GGUF_MOE = ["glm4_moe", "deepseek_v3", "gpt_oss"]
ALL = [*DENSE, "smollm3", *MOE_CONFIGS, *NO_GGUF_MOE]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every family's tiny model, made once."""
    made = {}
    for i, family in enumerate(ALL):
        make = make_tiny_moe if family in [*MOE_CONFIGS, *NO_GGUF_MOE] else make_tiny_family
        made[family] = make(tmp_path_factory.mktemp(family), family, seed=i)
    return made


def _every_family_on_rank(
    engine: Any, parallel: Any, paths: list[tuple[str, str]]
) -> list[tuple[list[list[int]], list[Any], list[list[int]]]]:
    """On each rank of a group: test_parallel's scenario on the group's engine (the first
    family's), then on one engine of each further family built on the same group; (outputs,
    the driver's logits, the experts each sparse layer of this rank holds) per family."""
    from llmserve.engine.model.moe import SparseMoeBlock
    from tests.engine.parallel.test_parallel import _scenario_on_rank

    got = []
    for i, (family, path) in enumerate(paths):
        if i:
            config = replace(engine.config, model=path, **ENGINE_SETTINGS.get(family, {}))
            engine = Engine(config, parallel)
        outputs, logits, _ = _scenario_on_rank(engine, parallel)
        blocks = [getattr(layer, "mlp", None) for layer in engine.model.layers]
        held = [list(b.experts.experts) for b in blocks if isinstance(b, SparseMoeBlock)]
        got.append((outputs, logits, held))
    return got


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_every_family_in_a_group_matches_one_engine(
    models: dict[str, Path], tp: int, pp: int
) -> None:
    """T = 2 (Phi-3's fused projections split per part; the MoE families' experts split whole
    across the ranks: expert parallelism, Qwen2-MoE's shared expert by columns) and P = 2 (one layer
    a stage: Gemma 3's full layer, Qwen3-MoE's dense one in the second): the scenario of
    tests/engine/parallel/test_parallel.py (prefill chunks, decodes, a prefix-cache hit, a
    preemption and its
    recompute) gives one engine's tokens on every rank, and logits within 1e-4."""
    from tests.engine.parallel.test_parallel import _capturing, _engine_config, run_scenario

    paths = [(f, str(models[f])) for f in ALL]
    want = {}
    for family, path in paths:
        one = Engine(_engine_config(Path(path), 1, 1, **ENGINE_SETTINGS.get(family, {})))
        logits = _capturing(one)
        want[family] = (run_scenario(one, logits), logits)
    first, path = paths[0]
    config = _engine_config(Path(path), tp, pp, **ENGINE_SETTINGS.get(first, {}))
    work = functools.partial(_every_family_on_rank, paths=paths)
    ranks = run_group_locally(config, work, timeout=300)
    driver = ranks[0]  # the driver: rank 0 (the last stage's first rank)
    for (family, _), (outputs, logits, _) in zip(paths, driver, strict=True):
        want_outputs, want_logits = want[family]
        assert outputs == want_outputs, family
        assert len(logits) == len(want_logits), family
        for step, (ours, theirs) in enumerate(zip(logits, want_logits, strict=True)):
            assert rel_err(torch.tensor(ours), theirs) < TOLERANCE, (family, step)
    for rank in ranks[1:]:
        assert [outputs for outputs, _, _ in rank] == [want[f][0] for f, _ in paths]
    # Qwen2-MoE's routed experts: whole, 4 a rank at T = 2; each stage its own layer's 8 at P = 2.
    held = [rank[ALL.index("qwen2_moe")][2] for rank in ranks]
    assert held == (
        [[list(range(4))] * 2, [list(range(4, 8))] * 2] if tp == 2 else [[list(range(8))]] * 2
    )


@pytest.mark.parametrize("family", [*DENSE, "smollm3", "glm4_moe"])
def test_draft_speculation_gives_the_same_tokens(models: dict[str, Path], family: str) -> None:
    """Greedy tokens with the model's first layer as its draft (3 tokens a step; the verify
    step sees several tokens of a request at once, windows and soft-caps included) equal those
    without (tests/engine/model/families/test_moe_models.py does the MoE families, n-gram too)."""
    from tests.spec_driver import drive, make_scheduler_for

    text = prompt(12, seed=4)
    prompts = [text * 3, prompt(20, seed=5) + text]
    greedy = sampling(temperature=0.0)
    settings = ENGINE_SETTINGS.get(family, {})

    def run(**spec: Any) -> dict[int, list[int]]:
        config = EngineConfig(
            model=str(models[family]), device="cpu", num_kv_blocks=64, **settings, **spec
        )
        engine = Engine(config)
        requests = [
            Request(f"r{i}", i + 1, p, greedy, 10, ignore_eos=True)  # type: ignore[arg-type]
            for i, p in enumerate(prompts)
        ]
        return drive(make_scheduler_for(engine), engine, requests).outputs

    spec = {"speculative_method": "draft", "num_speculative_tokens": 3, "draft_num_layers": 1}
    assert run(**spec) == run()


# Measured on these tiny random models (20 positions, 259 tokens): int8 moves the logits by
# 0.7-5.4% of their largest and keeps 95-100% of the greedy tokens; fp8 (e4m3 weights and
# activations, large on models of initializer_range 0.2) 4-35%, keeping 70-100%. A quantized
# layer that broke (Phi-3's fused projections split wrong, a bias dropped) agrees on ~1 in 259.
QUANT_BOUNDS = {"int8": 0.1, "fp8": 0.5}
QUANT_TOP1 = {"int8": 0.9, "fp8": 0.6}


@pytest.mark.parametrize("family", DENSE)
def test_quantized_weights_stay_near_float32(models: dict[str, Path], family: str) -> None:
    """--quantization int8 and fp8 on every dense family: every linear layer quantized and the
    logits of a 20-token prompt near the float32 engine's."""
    from llmserve.engine.model.layers import Linear, PackedLinear
    from llmserve.engine.model.quant import QUANTIZED_LINEARS

    tokens = prompt(20, seed=6)
    settings = ENGINE_SETTINGS.get(family, {})
    got = {}
    for method in ("none", "int8", "fp8"):
        config = EngineConfig(
            model=str(models[family]), device="cpu", num_kv_blocks=4, block_size=BLOCK_SIZE,
            quantization=method, **settings,
        )  # fmt: skip
        engine = Engine(config)
        (got[method],) = forward_direct(engine, [(tokens, 0, 20, [2, 0, 3])])
        if method != "none":  # no float linear layer left, four a layer and the head quantized
            modules = list(engine.model.modules())
            assert not [m for m in modules if isinstance(m, (Linear, PackedLinear))], method
            quantized = [m for m in modules if isinstance(m, QUANTIZED_LINEARS[method])]
            assert len(quantized) >= 4 * len(engine.model.layers) + 1, method
    for method, bound in QUANT_BOUNDS.items():
        err = rel_err(got[method], got["none"])
        agree = (got[method].argmax(-1) == got["none"].argmax(-1)).float().mean().item()
        assert err < bound and agree >= QUANT_TOP1[method], (method, err, agree)


# The CPU's GGUF kernel rounds the activations per block of 32 (kernels/cpu_gguf.py): 0.3-0.9%
# of the largest logit on these tiny models (measured); a wrong row order would be ~100%.
GGUF_BOUND = 0.03


@pytest.mark.parametrize("family", DENSE)
def test_gguf_blocks_served_as_stored(models: dict[str, Path], family: str, tmp_path: Path) -> None:
    """A GGUF of the family's layout with its projections in Q8_0 blocks: --quantization auto
    keeps the blocks (the CPU's GGUF kernel, Phi-3's fused ones split by rows) and gives the
    logits of the same file dequantized to float32 within GGUF_BOUND."""
    from llmserve.engine.model.gguf_linear import GGUFLinear, gguf_kernel_missing
    from tests.family_gguf import write_family_gguf

    if gguf_kernel_missing():
        pytest.skip("the CPU's GGUF kernel does not build here")
    path = write_family_gguf(models[family], tmp_path / "q8.gguf", family, q8=True)
    tokens = prompt(20, seed=6)
    got = {}
    for method in ("none", "auto"):
        config = EngineConfig(
            model=str(path), device="cpu", num_kv_blocks=4, block_size=BLOCK_SIZE,
            quantization=method, **ENGINE_SETTINGS.get(family, {}),
        )  # fmt: skip
        engine = Engine(config)
        assert engine.quantization == {"none": "none", "auto": "gguf"}[method]
        if method == "auto":  # every projection on its blocks (Phi-3's fused ones whole), none
            layers = engine.model.layers  # widened to int8 on the way
            kept = [m for m in engine.model.modules() if isinstance(m, GGUFLinear)]
            assert len(kept) >= 4 * len(layers), (family, len(kept))
        (got[method],) = forward_direct(engine, [(tokens, 0, 20, [2, 0, 3])])
    assert rel_err(got["auto"], got["none"]) < GGUF_BOUND
