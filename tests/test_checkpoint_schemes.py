"""Quantized checkpoints as llm-compressor, GPTQ, AWQ and gpt-oss ship them
(engine/checkpoint_schemes.py, checkpoint_dequant.py), each written by the tests from a tiny
random float model (tests/quant_checkpoints.py): compressed-tensors by the compressed-tensors
library itself, GPTQ and AWQ by packing their documented layouts. The loader's weights must
equal the format's own dequantization, its logits the dequantized float model's (transformers'
forward), and its greedy tokens those of the dequantized model served by the same engine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from llmserve.bench.engine_driver import generate
from llmserve.common.model_config import ModelSourceError, load_model_config
from llmserve.engine.config import EngineConfig
from llmserve.engine.engine import Engine
from llmserve.engine.weights import build_model, load_weights
from tests.test_weights import PROMPT, our_logits, rel_err

pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors (dev extra) writes the tests' checkpoints"
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 77, 190, 33, 12], [200, 3, 3, 41], [9, 120, 64, 250, 18, 7], [100]]
ENGINE = dict(device="cpu", num_kv_blocks=32, max_model_len=128, seed=0)
# 128 wide and 256 deep: group sizes 32, 64 and 128 all divide every projection.
SHAPE = dict(hidden_size=128, intermediate_size=256)

INT = dict(type="int", symmetric=True)
FP8 = dict(num_bits=8, type="float", symmetric=True)
# name -> (weights, input_activations, format forced or None for the library's choice)
CT_SCHEMES: dict[str, tuple[dict[str, Any], dict[str, Any] | None, str | None]] = {
    "w4a16-g32": ({**INT, "num_bits": 4, "strategy": "group", "group_size": 32}, None, None),
    "w4a16-g64-asym": (
        {**INT, "num_bits": 4, "strategy": "group", "group_size": 64, "symmetric": False},
        None,
        None,
    ),
    "w4a16-g128": ({**INT, "num_bits": 4, "strategy": "group", "group_size": 128}, None, None),
    "w4a16-channel-asym": (
        {**INT, "num_bits": 4, "strategy": "channel", "symmetric": False},
        None,
        None,
    ),
    "w8a16-int": ({**INT, "num_bits": 8, "strategy": "channel"}, None, "int-quantized"),
    "w8a16-packed": ({**INT, "num_bits": 8, "strategy": "channel"}, None, None),
    "fp8-tensor-static": (
        {**FP8, "strategy": "tensor"},
        {**FP8, "strategy": "tensor", "dynamic": False},
        None,
    ),
    "fp8-channel-dynamic": (
        {**FP8, "strategy": "channel"},
        {**FP8, "strategy": "token", "dynamic": True},
        None,
    ),
    "fp8-block": ({**FP8, "strategy": "block", "block_structure": [32, 32]}, None, None),
}


@pytest.fixture(scope="module")
def float_dir(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model(**SHAPE)


@pytest.fixture(scope="module")
def ct_dirs(
    float_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    """scheme name -> (the compressed-tensors checkpoint, the library's decompression of it)."""
    from tests.quant_checkpoints import write_compressed_tensors

    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            root = tmp_path_factory.mktemp(f"ct-{name}")
            made[name] = (root / "ct", root / "dequantized")
            write_compressed_tensors(float_dir, *made[name], *CT_SCHEMES[name])
        return made[name]

    return get


def _hf_logits(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].float()


def check_served_as_dequantized(quantized: Path, dequantized: Path) -> None:
    """Every weight the loader hands the model equals the dequantized checkpoint's (to float32
    rounding), the whole model loads with no tensor unread, and its logits are transformers'
    on the dequantized model."""
    config = load_model_config(quantized)
    weights = load_weights(quantized, config)
    want = load_file(str(dequantized / "model.safetensors"))
    assert set(weights) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(weights[name].float(), tensor, rtol=1e-6, atol=1e-6, msg=name)
    model = build_model(
        config, load_weights(quantized, config), 256, torch.float32, torch.device("cpu")
    )
    assert rel_err(our_logits(config, model), _hf_logits(dequantized)) < 1e-4


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_compressed_tensors_is_read_as_the_library_dequantizes_it(
    ct_dirs: Callable[[str], tuple[Path, Path]], scheme: str
) -> None:
    check_served_as_dequantized(*ct_dirs(scheme))


@pytest.mark.parametrize("scheme", ["w4a16-g64-asym", "w8a16-int", "fp8-tensor-static"])
def test_compressed_tensors_greedy_equals_the_dequantized_model(
    ct_dirs: Callable[[str], tuple[Path, Path]], scheme: str
) -> None:
    ct_dir, dequantized_dir = ct_dirs(scheme)
    got = generate(Engine(EngineConfig(model=str(ct_dir), **ENGINE)), PROMPTS, 6)
    want = generate(Engine(EngineConfig(model=str(dequantized_dir), **ENGINE)), PROMPTS, 6)
    assert got == want
