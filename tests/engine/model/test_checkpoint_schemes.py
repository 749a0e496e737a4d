"""Quantized checkpoints as llm-compressor, GPTQ, AWQ and gpt-oss ship them
(engine/model/checkpoint_schemes.py, checkpoint_dequant.py), each written by the tests from a tiny
random float model (llmserve/bench/quant_checkpoints.py): compressed-tensors by the
compressed-tensors library itself, GPTQ and AWQ by packing their documented layouts. The loader's
weights must equal the format's own dequantization, its logits the dequantized float model's
(transformers' forward), with every quantized projection served as stored on the CPU
(engine/model/checkpoint_linear.py), and its greedy tokens those of the dequantized model served
by the same engine."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from llmserve.bench.engine_driver import generate
from llmserve.bench.quant_checkpoints import (
    write_awq,
    write_compressed_tensors_per_tensor,
    write_fp8_block,
    write_gptq,
)
from llmserve.common.model_config import ModelSourceError, load_model_config
from llmserve.engine.config import EngineConfig
from llmserve.engine.model.checkpoint_dequant import dequantize_mxfp4
from llmserve.engine.model.checkpoint_formats import checkpoint_format
from llmserve.engine.model.checkpoint_linear import CheckpointLinear, kept_description
from llmserve.engine.model.layers import Linear, PackedLinear
from llmserve.engine.model.weights import build_model, load_weights
from llmserve.engine.step.engine import Engine
from llmserve.kernels import cpu_wq
from tests.engine.model.test_weights import PROMPT, our_logits, rel_err

pytest.importorskip(
    "compressed_tensors", reason="compressed-tensors (dev extra) writes the tests' checkpoints"
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[5, 77, 190, 33, 12], [200, 3, 3, 41], [9, 120, 64, 250, 18, 7], [100]]
ENGINE = dict(device="cpu", num_kv_blocks=32, max_model_len=128, seed=0)
# 128 wide and 256 deep: group sizes 32, 64 and 128 all divide every projection.
SHAPE = dict(hidden_size=128, intermediate_size=256)

FLOAT_LINEARS = (Linear, PackedLinear)
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
    from llmserve.bench.quant_checkpoints import write_compressed_tensors

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
    if cpu_wq.unavailable() is None:  # every quantized projection served as stored
        float_linears = [n for n, m in model.named_modules() if isinstance(m, FLOAT_LINEARS)]
        assert float_linears == ["lm_head"], float_linears
        assert any(isinstance(m, CheckpointLinear) for m in model.modules())


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_compressed_tensors_is_read_as_the_library_dequantizes_it(
    ct_dirs: Callable[[str], tuple[Path, Path]], scheme: str
) -> None:
    check_served_as_dequantized(*ct_dirs(scheme))


@pytest.mark.parametrize("scheme", ["w4a16-g64-asym", "fp8-tensor-static"])
def test_compressed_tensors_greedy_equals_the_dequantized_model(
    ct_dirs: Callable[[str], tuple[Path, Path]], scheme: str
) -> None:
    ct_dir, dequantized_dir = ct_dirs(scheme)
    dequantizing = dict(ENGINE, quantization="none")  # the float path (kept blocks: below)
    got = generate(Engine(EngineConfig(model=str(ct_dir), **dequantizing)), PROMPTS, 6)
    want = generate(Engine(EngineConfig(model=str(dequantized_dir), **ENGINE)), PROMPTS, 6)
    assert got == want


# name -> write_gptq's keyword arguments
GPTQ_SCHEMES: dict[str, dict[str, Any]] = {
    "4bit-g32": dict(bits=4, group_size=32, desc_act=False),
    "4bit-g64-act-order": dict(bits=4, group_size=64, desc_act=True),
    "4bit-g128-asym-v2": dict(
        bits=4, group_size=128, desc_act=False, symmetric=False, version="gptq_v2"
    ),
    "8bit-channel": dict(bits=8, group_size=-1, desc_act=False),
    "8bit-g32-act-order-asym": dict(bits=8, group_size=32, desc_act=True, symmetric=False),
}
AWQ_GROUPS = (32, 128)


@pytest.fixture(scope="module")
def packed_dirs(
    float_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[Path, Path]]:
    """ "gptq-<scheme>" or "awq-<group>" -> (the checkpoint, its dequantized float32 twin)."""

    made: dict[str, tuple[Path, Path]] = {}

    def get(name: str) -> tuple[Path, Path]:
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            made[name] = (root / "q", root / "dequantized")
            kind, _, which = name.partition("-")
            if kind == "gptq":
                write_gptq(float_dir, *made[name], **GPTQ_SCHEMES[which])
            else:
                write_awq(float_dir, *made[name], int(which))
        return made[name]

    return get


@pytest.mark.parametrize(
    "name", [f"gptq-{s}" for s in GPTQ_SCHEMES] + [f"awq-{g}" for g in AWQ_GROUPS]
)
def test_gptq_and_awq_are_read_as_their_layouts_dequantize(
    packed_dirs: Callable[[str], tuple[Path, Path]], name: str
) -> None:
    check_served_as_dequantized(*packed_dirs(name))


@pytest.mark.parametrize("name", ["gptq-4bit-g64-act-order"])
def test_gptq_and_awq_greedy_equal_the_dequantized_model(
    packed_dirs: Callable[[str], tuple[Path, Path]], name: str
) -> None:
    quantized, dequantized = packed_dirs(name)
    engine = Engine(EngineConfig(model=str(quantized), **ENGINE))
    got = generate(engine, PROMPTS, 6)
    want = generate(Engine(EngineConfig(model=str(dequantized), **ENGINE)), PROMPTS, 6)
    assert got == want
    assert checkpoint_format(quantized).startswith(name.split("-")[0])
    if cpu_wq.unavailable() is None:  # the start line: 2 layers x (qkv, o, gate_up, down)
        held = checkpoint_format(quantized, kept_description(engine.model))
        assert held.endswith(
            "8 linears kept quantized on the CPU (8 int4), the rest dequantized at load"
        )


def test_mxfp4_dequantizes_as_transformers_gpt_oss_does() -> None:
    """gpt-oss's experts: e2m1 pairs (low nibble first) and e8m0 block scales, against
    transformers' own converter (which returns [E, K, N]: ours keeps the stored [E, N, K])."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), generator=generator, dtype=torch.uint8)
    scales = torch.randint(118, 132, (3, 24, 4), generator=generator, dtype=torch.uint8)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 24, 128)
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_mxfp4_is_kept_as_stored_exactly() -> None:
    """kept_weights.mxfp4_weights: the e2m1 codes (kind fp4) with 2^(s - 127) per 32 are the
    MXFP4 values bit for bit, for every code and the extreme scales (2^-127 and 2^127: s = 0,
    254), one KeptWeight per expert, through the kernel's product too."""
    from llmserve.engine.model.kept_weights import mxfp4_weights

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 16, 3, 16), generator=generator, dtype=torch.uint8)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # each code, both nibbles
    scales = torch.randint(100, 140, (2, 16, 3), generator=generator, dtype=torch.uint8)
    scales[0, 0], scales[1, 0] = torch.tensor([0, 254, 127]), torch.tensor([1, 253, 128])
    want = dequantize_mxfp4(blocks, scales)
    kept = mxfp4_weights(blocks, scales)
    assert [(w.kind, w.group, tuple(w.q.shape)) for w in kept] == [("fp4", 32, (16, 96))] * 2
    for expert, weight in enumerate(kept):
        assert torch.equal(weight.dequantize(), want[expert])
    if cpu_wq.unavailable() is None:
        w = kept[1]
        x = torch.randn(3, 96, generator=generator)
        packed = cpu_wq.pack_wq(w.kind, w.q, w.scale, w.zero, w.group)
        got = cpu_wq.wq_linear(x, packed, None)  # channel 0's 2^126 overflows: left out
        torch.testing.assert_close(got[:, 1:], x @ want[1, 1:].t(), rtol=1e-5, atol=1e-5)


def test_mxfp4_tensors_are_seen_as_their_float_tensor(tmp_path: Path) -> None:
    """`X_blocks` and `X_scales` are the float tensor `X`; both count as read once it is."""
    from llmserve.engine.model.checkpoint_formats import checkpoint_weights

    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "mxfp4"}}')
    stem = "model.layers.0.mlp.experts.down_proj"
    blocks = torch.full((2, 8, 1, 16), 0x21, dtype=torch.uint8)  # 0.5 then 1.0
    stored = {
        f"{stem}_blocks": blocks,
        f"{stem}_scales": torch.full((2, 8, 1), 128, dtype=torch.uint8),  # x 2
        f"{stem}_bias": torch.zeros(2, 8),
    }
    dtypes = {f"{stem}_blocks": "U8", f"{stem}_scales": "U8", f"{stem}_bias": "F32"}
    view = checkpoint_weights(tmp_path, stored, dtypes)
    assert sorted(view) == [stem, f"{stem}_bias"]
    assert view[stem][0, 0, :4].tolist() == [1.0, 2.0, 1.0, 2.0]
    view[f"{stem}_bias"]
    view.check_all_read(tmp_path, tied_head=False)
    del stored[f"{stem}_scales"], dtypes[f"{stem}_scales"]
    with pytest.raises(ModelSourceError, match="_blocks \\(U8\\)"):
        checkpoint_weights(tmp_path, stored, dtypes)


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        ({"format": "nvfp4-pack-quantized"}, "format='nvfp4-pack-quantized'"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme="),
        ({"quantization_status": "frozen"}, "quantization_status='frozen'"),
        ({"weights": {"num_bits": 3}}, "weights.num_bits=3"),
        ({"weights": {"dynamic": True}}, "weights.dynamic=True"),
        ({"weights": {"strategy": "tensor_group"}}, "weights.strategy='tensor_group'"),
        ({"targets": ["re:.*mlp.*"]}, "no compressed-tensors config group targets it"),
    ],
    ids=["nvfp4", "kv-cache", "frozen", "3-bit", "dynamic-weights", "tensor-group", "targets"],
)
def test_a_compressed_tensors_option_not_read_is_refused_by_name(
    ct_dirs: Callable[[str], tuple[Path, Path]],
    tmp_path: Path,
    edit: dict[str, Any],
    named: str,
) -> None:
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(ct_dirs("w4a16-g32")[0], path)
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    group = qc["config_groups"]["group_0"]
    for key, value in edit.items():
        if key == "weights":
            group["weights"].update(value)
        elif key == "targets":
            group["targets"] = value
        else:
            qc[key] = value
            group.pop("format", None) if key == "format" else None
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelSourceError, match=re.escape(named)):
        build_model(load_model_config(path), load_weights(path, load_model_config(path)),
                    64, torch.float32, torch.device("cpu"))  # fmt: skip


MOE_FORMATS = {
    "gptq": lambda src, q, d: write_gptq(src, q, d, bits=4, group_size=32, desc_act=True),
    "awq": lambda src, q, d: write_awq(src, q, d, 32),
    "w4a16": lambda src, q, d: write_compressed_tensors_per_tensor(
        src, q, d, {**INT, "num_bits": 4, "strategy": "group", "group_size": 32}, "pack-quantized"
    ),
    "fp8": lambda src, q, d: write_compressed_tensors_per_tensor(
        src, q, d, {**FP8, "strategy": "channel"}, "float-quantized"
    ),
    "w8a16": lambda src, q, d: write_compressed_tensors_per_tensor(
        src, q, d, {**INT, "num_bits": 8, "strategy": "channel"}, "int-quantized"
    ),
    "fp8-block": lambda src, q, d: write_fp8_block(src, q, d, (16, 32)),
}
# Each format's kind as the kernel holds it (what the start line counts).
MOE_KINDS = {"gptq": "int4", "awq": "int4", "w4a16": "int4", "fp8": "fp8", "w8a16": "int8",
             "fp8-block": "fp8"}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "fmt"),
    [("mixtral", "gptq"), ("qwen3_moe", "awq"), ("mixtral", "w4a16"), ("qwen3_moe", "fp8"),
     ("mixtral", "w8a16"), ("qwen3_moe", "fp8-block"), ("glm4_moe", "gptq"),
     ("qwen2_moe", "gptq"), ("deepseek_v3", "gptq")],
)  # fmt: skip
def test_quantized_experts_are_read_as_their_dequantized_model(
    tmp_path_factory: pytest.TempPathFactory, family: str, fmt: str
) -> None:
    """Experts stored one by one (Mixtral's w1/w2/w3, Qwen3-MoE's gate/up/down), each in the
    format's layout; the routers stay float. On the CPU every expert is served as stored
    (engine/model/kept_experts.py: a gate/up and a down linear per expert, Mixtral's act-order
    GPTQ with a permutation per projection), the start line counts them, and the engine's
    greedy tokens are the dequantized model's."""
    from llmserve.engine.model.kept_experts import KeptExperts
    from tests.moe_models import make_tiny_moe

    root = tmp_path_factory.mktemp(f"moe-{family}-{fmt}")
    float_dir = make_tiny_moe(root / "float", family)
    MOE_FORMATS[fmt](float_dir, root / "q", root / "dequantized")
    check_served_as_dequantized(root / "q", root / "dequantized")
    if cpu_wq.unavailable() is not None:
        return
    engine = Engine(EngineConfig(model=str(root / "q"), **ENGINE))
    blocks = [layer.mlp for layer in engine.model.layers if hasattr(layer.mlp, "experts")]
    assert blocks and all(isinstance(b.experts, KeptExperts) for b in blocks)
    want = generate(Engine(EngineConfig(model=str(root / "dequantized"), **ENGINE)), PROMPTS, 6)
    assert generate(engine, PROMPTS, 6) == want
    # 8 experts x (gate/up, down) per sparse layer: Mixtral 2 of them, Qwen3-MoE 1
    experts = 16 * len(blocks)
    held = kept_description(engine.model)
    assert f", {experts} of them experts'" in held and f" {MOE_KINDS[fmt]}" in held, held


def test_int8_mode_holds_a_quantized_checkpoint_in_the_int8_layers(
    ct_dirs: Callable[[str], tuple[Path, Path]],
) -> None:
    """--quantization int8 on a W8A16 checkpoint (docs/quantization.md: the memory saving):
    every projection becomes an Int8Linear, the same model --quantization int8 makes of the
    dequantized float checkpoint (re-holding a grid in int8 groups of 32 is close, not exact:
    the logits differ from the dequantized float model's by about 4% of their range here)."""
    from llmserve.engine.model.quant import Int8Linear

    logits = []
    for path in ct_dirs("w8a16-int"):
        config = load_model_config(path)
        model = build_model(config, load_weights(path, config), 256, torch.float32,
                            torch.device("cpu"), quantization="int8")  # fmt: skip
        assert isinstance(model.layers[0].mlp.down_proj, Int8Linear)
        logits.append(our_logits(config, model))
    assert torch.equal(logits[0], logits[1])


def test_unpacked_int8_zero_points_are_read_too(
    ct_dirs: Callable[[str], tuple[Path, Path]], tmp_path: Path
) -> None:
    """Zero points stored one per int8 (earlier compressed-tensors) rather than packed along
    the rows: the same model."""
    import shutil

    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors.torch import save_file

    ct_dir, dequantized_dir = ct_dirs("w4a16-g64-asym")
    path = tmp_path / "m"
    shutil.copytree(ct_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight_zero_point")]:
        scale = tensors[name.replace("zero_point", "scale")]
        unpacked = unpack_from_int32(tensors[name], 4, scale.shape, packed_dim=0)
        tensors[name] = unpacked.contiguous()
        assert tensors[name].dtype == torch.int8
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    check_served_as_dequantized(path, dequantized_dir)


# checkpoint -> the ggml block type its projections are kept in on the CPU (--quantization auto)
KEPT = {"ct-w4a16-g32": 2, "ct-w4a16-g64-asym": 3, "ct-w8a16-int": 8, "gptq-4bit-g128-asym-v2": 3,
        "awq-32": 3, "gptq-8bit-channel": 8}  # fmt: skip


def _dirs(
    name: str, ct_dirs: Callable[..., tuple[Path, Path]], packed_dirs: Callable[..., Any]
) -> tuple[Path, Path]:
    return ct_dirs(name[3:]) if name.startswith("ct-") else packed_dirs(name)


@pytest.mark.parametrize("name", list(KEPT))
def test_w4a16_and_w8a16_projections_are_kept_in_gguf_blocks(
    ct_dirs: Callable[[str], tuple[Path, Path]],
    packed_dirs: Callable[[str], tuple[Path, Path]],
    name: str,
) -> None:
    """engine/model/checkpoint_blocks.py: every projection is a GGUFLinear of the expected block
    type whose blocks (read by the gguf package's dequantizer) equal the dequantized checkpoint's
    weight up to float16 storage of d and m; the LM head stays float."""
    from llmserve.engine.model.gguf_linear import GGUFLinear
    from llmserve.engine.model.weights import resolve_quantization
    from llmserve.kernels import cpu_gguf

    quantized, dequantized = _dirs(name, ct_dirs, packed_dirs)
    assert resolve_quantization("auto", quantized, torch.device("cpu")) == "none"  # cpu_wq's
    if cpu_gguf.unavailable():
        pytest.skip(f"GGUF kernel unavailable: {cpu_gguf.unavailable()}")
    config = load_model_config(quantized)
    model = build_model(config, load_weights(quantized, config), 256, torch.float32,
                        torch.device("cpu"), quantization="gguf")  # fmt: skip
    want = load_file(str(dequantized / "model.safetensors"))
    layer = model.layers[0]
    for proj, stems in [(layer.mlp.down_proj, ["mlp.down_proj"]),
                        (layer.self_attn.qkv_proj, ["self_attn.q_proj", "self_attn.k_proj",
                                                    "self_attn.v_proj"])]:  # fmt: skip
        assert isinstance(proj, GGUFLinear) and proj.ggml_type == KEPT[name]
        ref = torch.cat([want[f"model.layers.0.{s}.weight"].float() for s in stems])
        got = cpu_gguf.dequantize_reference(proj.blocks, proj.ggml_type)
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=1e-3 * float(ref.abs().max()))
    assert not isinstance(model.lm_head, GGUFLinear)
    assert "GGUF blocks" in checkpoint_format(quantized, "projections in GGUF blocks")


@pytest.mark.parametrize("name", ["ct-w4a16-g32", "gptq-4bit-g128-asym-v2", "ct-w8a16-int"])
def test_kept_blocks_greedy_equal_the_dequantized_model(
    ct_dirs: Callable[[str], tuple[Path, Path]],
    packed_dirs: Callable[[str], tuple[Path, Path]],
    name: str,
) -> None:
    quantized, dequantized = _dirs(name, ct_dirs, packed_dirs)
    if cpu_gguf_missing():
        pytest.skip("GGUF kernel unavailable")
    engine = Engine(EngineConfig(model=str(quantized), **dict(ENGINE, quantization="gguf")))
    got = generate(engine, PROMPTS, 6)
    want = generate(Engine(EngineConfig(model=str(dequantized), **ENGINE)), PROMPTS, 6)
    assert got == want


def cpu_gguf_missing() -> bool:
    from llmserve.kernels import cpu_gguf

    return cpu_gguf.unavailable() is not None


def test_gguf_blocks_refuse_a_checkpoint_without_integer_weights(float_dir: Path) -> None:
    from llmserve.engine.model.weights import checked_quantization

    with pytest.raises(ValueError, match="W4A16 / W8A16 checkpoint"):
        checked_quantization("gguf", float_dir, torch.device("cpu"))
