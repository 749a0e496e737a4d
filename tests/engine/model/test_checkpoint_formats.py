"""Quantized checkpoints as they ship (engine/model/checkpoint_formats.py): a tiny Llama written by
llmserve/bench/quant_checkpoints.py in the FP8 block-scaled layout is served as the same model
dequantized to float32 (greedy tokens identical), its logits match transformers' own FP8
loader (which dequantizes on a CPU); and a checkpoint whose quantization_config or tensors the
loader does not read is refused at start, naming the method, the option or the tensors."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve.bench.engine_driver import generate
from llmserve.bench.quant_checkpoints import edit_config, fp8_block, write_fp8_block
from llmserve.common.model_config import ModelSourceError, load_model_config
from llmserve.engine.config import EngineConfig
from llmserve.engine.model.checkpoint_dequant import dequantize_fp8_block
from llmserve.engine.model.weights import build_model, load_weights
from llmserve.engine.step.engine import Engine
from tests.engine.model.test_weights import PROMPT, our_logits, rel_err

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 77, 190, 33, 12], [200, 3, 3, 41], [9, 120, 64, 250, 18, 7], [100]]
ENGINE = dict(device="cpu", num_kv_blocks=32, max_model_len=128, seed=0)
# [32, 32] divides every weight of the tiny Llama (transformers' loader needs that); [48, 40]
# leaves partial blocks in the last row and column, as DeepSeek-V3's 576-wide kv_a_proj does.
BLOCKS = {"even": (32, 32), "partial": (48, 40)}


@pytest.fixture(scope="module")
def fp8_dirs(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    """blocks name -> (the FP8 block-scaled checkpoint, its dequantized float32 twin)."""
    made: dict[str, tuple[Path, Path]] = {}

    def get(which: str) -> tuple[Path, Path]:
        if which not in made:
            root = tmp_path_factory.mktemp(f"fp8-{which}")
            made[which] = (root / "fp8", root / "dequantized")
            write_fp8_block(tiny_model(), *made[which], BLOCKS[which])
        return made[which]

    return get


@pytest.mark.parametrize("which", list(BLOCKS))
def test_fp8_block_checkpoint_is_served_as_its_dequantized_model(
    fp8_dirs: Callable[[str], tuple[Path, Path]], which: str
) -> None:
    """The issue's case: served greedy tokens equal the dequantized float32 model's on every
    prompt (before the loader read the scales they matched on 0 of 4), and differ from what the
    stored fp8 values alone give (so the scales are what made them equal)."""
    fp8_dir, dequantized_dir = fp8_dirs(which)
    got = generate(Engine(EngineConfig(model=str(fp8_dir), **ENGINE)), PROMPTS, 6)
    want = generate(Engine(EngineConfig(model=str(dequantized_dir), **ENGINE)), PROMPTS, 6)
    assert got == want
    config = load_model_config(fp8_dir)
    weights = load_weights(fp8_dir, config)
    name = "model.layers.0.mlp.down_proj.weight"
    raw = weights.weights[name].float()  # type: ignore[attr-defined]
    assert not torch.equal(weights[name], raw)


def test_fp8_block_logits_match_transformers_loader(
    fp8_dirs: Callable[[str], tuple[Path, Path]],
) -> None:
    """transformers' FineGrainedFP8 loader, dequantizing on this CPU, reads our checkpoint
    as the same model we serve."""
    from transformers import LlamaForCausalLM as HFLlama

    fp8_dir, _ = fp8_dirs("even")
    hf = HFLlama.from_pretrained(fp8_dir, dtype=torch.float32).eval()
    assert hf.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    config = load_model_config(fp8_dir)
    model = build_model(
        config, load_weights(fp8_dir, config), 256, torch.float32, torch.device("cpu")
    )
    assert rel_err(our_logits(config, model), ref) < 1e-4


def test_dequantize_matches_transformers_on_whole_blocks() -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    torch.manual_seed(0)
    q, scale = fp8_block(torch.randn(96, 64), (32, 32))
    theirs = Fp8Dequantize(None)._dequantize_one(q, scale, torch.float32)
    assert torch.equal(dequantize_fp8_block(q, scale, (32, 32)), theirs)


def test_fp8_scale_grid_of_the_wrong_shape_is_refused() -> None:
    q, scale = fp8_block(torch.randn(96, 64), (32, 32))
    with pytest.raises(ModelSourceError, match=r"expected \[\.\.\., 3, 4\]"):
        dequantize_fp8_block(q, scale, (32, 16))


def _variant(source: Path, target: Path, **config: object) -> Path:
    shutil.copytree(source, target)
    edit_config(target, **config)
    return target


def _refusal(path: Path) -> str:
    with pytest.raises(ModelSourceError) as caught:
        Engine(EngineConfig(model=str(path), **ENGINE))
    return str(caught.value)


def test_fp8_tensors_without_a_quantization_config_are_refused(
    fp8_dirs: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    """Today's silent case, config.json stripped of the format: the scales and the fp8
    weights are named, nothing is served."""
    path = _variant(fp8_dirs("even")[0], tmp_path / "m", quantization_config=None)
    message = _refusal(path)
    assert "weight_scale_inv (F32)" in message and "F8_E4M3" in message, message


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method='bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 3}, "bits=3"),
        ({"quant_method": "awq", "version": "gemv"}, "version='gemv'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size=None"),
        (
            {"quant_method": "fp8", "weight_block_size": [32, 32], "activation_scheme": "static"},
            "activation_scheme='static'",
        ),
    ],
    ids=["bitsandbytes", "gptq-3-bit", "awq-gemv", "fp8-per-tensor", "fp8-static"],
)
def test_an_unread_method_or_option_is_refused_by_name(
    fp8_dirs: Callable[[str], tuple[Path, Path]],
    tmp_path: Path,
    config: dict[str, object],
    named: str,
) -> None:
    path = _variant(fp8_dirs("even")[0], tmp_path / "m", quantization_config=config)
    assert named in _refusal(path)


def test_a_float_tensor_no_layer_reads_is_refused(
    tiny_model: Callable[..., Path], tmp_path: Path
) -> None:
    """A q_proj bias in a Llama without attention biases: a float tensor of a known leaf name
    the model has no parameter for, named after the load."""
    path = tmp_path / "m"
    shutil.copytree(tiny_model(), path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.1.self_attn.q_proj.bias"] = torch.zeros(64)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    message = _refusal(path)
    assert "used by no layer" in message
    assert "model.layers.1.self_attn.q_proj.bias" in message
