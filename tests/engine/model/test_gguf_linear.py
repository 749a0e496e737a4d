"""--quantization gguf: kernels/cpu_gguf.cpp against its torch twin for each block type (Q4_0,
Q4_1, Q8_0, Q4_K), each instruction set this CPU has and both activation widths; the model built
from a GGUF's blocks against the same GGUF dequantized; `auto` choosing it. The built-in model's
quality under it is in tests/engine/model/test_quantization.py (MODES["gguf"]) and, through the
whole stack
against HF transformers, tests/system/test_e2e_smollm2.py (auto picks gguf there)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from llmserve.bench.engine_driver import generate
from llmserve.bench.quality import prompt_logits
from llmserve.common.model_config import load_model_config
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.telemetry import EngineTelemetry
from llmserve.engine.model import cpu_fused
from llmserve.engine.model.cpu_weights import dense_layers
from llmserve.engine.model.gguf_linear import GGUFEmbedding, GGUFLinear
from llmserve.engine.model.quant import Int8Linear
from llmserve.engine.model.weights import (
    LazyWeights,
    build_model,
    checked_quantization,
    load_weights,
    resolve_quantization,
)
from llmserve.engine.step.engine import Engine
from llmserve.kernels import cpu_gguf

HAS_AVX2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
pytestmark = pytest.mark.skipif(not HAS_AVX2, reason="kernels/cpu_gguf.cpp is AVX2 code")


def random_blocks(n: int, k: int, ggml_type: int, seed: int) -> torch.Tensor:
    """uint8 [n, row_bytes]: random levels and scale bytes, with finite float16 scales (d, and
    Q4_1's m / Q4_K's dmin) of a trained model's size."""
    _, elems, nbytes = cpu_gguf.FORMATS[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n * k // elems, nbytes), dtype=np.uint8)
    raw[:, 0:2] = (rng.random((len(raw), 1)) * 0.01 + 1e-3).astype(np.float16).view(np.uint8)
    if ggml_type in (3, 12):  # Q4_1's m (any sign), Q4_K's dmin (subtracted)
        second = (rng.random((len(raw), 1)) - (0.5 if ggml_type == 3 else 0.0)) * 0.02
        raw[:, 2:4] = second.astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1).copy())


def quantized_activations(x: torch.Tensor, bits: int) -> torch.Tensor:
    """x rounded as the kernel rounds it: per block of 32, to the int grid of amax / (2^(b-1)-1)."""
    top = 2.0 ** (bits - 1) - 1
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, top / amax, torch.zeros_like(amax))
    return ((blocks * inv).round() * (amax / top)).view_as(x)


def max_row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).norm(dim=1) / want.norm(dim=1)).max())


ISAS = (
    [False, True]
    if HAS_AVX2 and cpu_gguf.unavailable() is None and cpu_gguf.has_vnni()
    else [False]
)


@pytest.mark.parametrize(
    "ggml_type", sorted(cpu_gguf.FORMATS), ids=lambda t: cpu_gguf.FORMATS[t][0]
)
@pytest.mark.parametrize("vnni", ISAS, ids=["avx2", "vnni"][: len(ISAS)])
@pytest.mark.parametrize("act_bits", [16, 8])
def test_kernel_matches_its_torch_twin(ggml_type: int, vnni: bool, act_bits: int) -> None:
    """Decode-sized products (1-4 rows in one pass, remainders, several passes) and a prefill
    one: exact to float32 summation order (relative L2 error per row <= 1e-5) against the gguf
    package's dequantized weight times x rounded as the kernel rounds it; against unrounded x,
    within what the rounding costs (int16: 1e-4; int8, as llama.cpp: 3e-2)."""
    assert cpu_gguf.unavailable() is None
    n, k = 40, 512
    blocks = random_blocks(n, k, ggml_type, seed=ggml_type)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(1))
    for rows in (1, 3, 4, 7, 16):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = cpu_gguf.gguf_linear(x, blocks, ggml_type, bias, vnni=vnni, act_bits=act_bits)
        rounded = cpu_gguf.gguf_linear_reference(
            quantized_activations(x, act_bits), blocks, ggml_type, bias
        )
        assert max_row_error(got, rounded) <= 1e-5, rows
        exact = cpu_gguf.gguf_linear_reference(x, blocks, ggml_type, bias)
        assert max_row_error(got, exact) <= (1e-4 if act_bits == 16 else 3e-2), rows
    x = torch.randn(cpu_gguf.PREFILL_ROWS, k, generator=torch.Generator().manual_seed(0))
    got = cpu_gguf.gguf_linear(x, blocks, ggml_type, bias)  # widened: no activation rounding
    assert max_row_error(got, cpu_gguf.gguf_linear_reference(x, blocks, ggml_type, bias)) <= 1e-5


@pytest.mark.parametrize(
    "ggml_type", sorted(cpu_gguf.FORMATS), ids=lambda t: cpu_gguf.FORMATS[t][0]
)
def test_widening_equals_the_gguf_package(ggml_type: int) -> None:
    blocks = random_blocks(24, 512, ggml_type, seed=7)
    want = cpu_gguf.dequantize_reference(blocks, ggml_type)
    assert torch.equal(cpu_gguf.dequantize(blocks, ggml_type), want)


def test_kernel_rejects_a_row_of_the_wrong_length() -> None:
    blocks = random_blocks(4, 64, 3, seed=0)
    with pytest.raises(RuntimeError, match="a row of K=96 takes 60 bytes in ggml type 3"):
        cpu_gguf.gguf_linear(torch.zeros(1, 96), blocks, 3)


@pytest.fixture(scope="module")
def q4_1_gguf(tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama (GQA, an LM head of its own) whose projections and embeddings are stored as
    Q4_1 (the head as float32)."""
    import gguf

    from tests.engine.model.test_weights import write_gguf

    hf_dir = tiny_model(hidden_size=64, intermediate_size=128)
    projections = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    names = (*(f"blk.{i}.{t}.weight" for i in range(2) for t in projections), "token_embd.weight")
    path = tmp_path_factory.mktemp("gguf") / "q4_1.gguf"
    write_gguf(hf_dir, path, quantize=names, quantize_type=gguf.GGMLQuantizationType.Q4_1)
    return path


def test_model_on_gguf_blocks_equals_the_dequantized_one(q4_1_gguf: Path) -> None:
    """Every projection a GGUFLinear on the file's Q4_1 blocks (q and k rows unpermuted, q/k/v
    and gate/up stacked), the embeddings a GGUFEmbedding, the float32 head an Int8Linear (set
    back to the float one for the comparison): the logits of a prompt equal the float32 model's
    from the same file to int16 activation rounding (8 rows: the kernel's dot products;
    PREFILL_ROWS: the widened weight)."""
    config = load_model_config(q4_1_gguf)
    weights = load_weights(q4_1_gguf, config)
    cpu = torch.device("cpu")
    dense = build_model(config, weights, 256, torch.float32, cpu)
    model = build_model(config, weights, 256, torch.float32, cpu, quantization="gguf")
    assert isinstance(model.layers[1].self_attn.qkv_proj, GGUFLinear)
    assert model.layers[1].mlp.gate_up_proj.ggml_type == 3
    assert isinstance(model.embed_tokens, GGUFEmbedding)
    assert isinstance(model.lm_head, Int8Linear)  # output.weight is float32 in this file
    model.lm_head = dense.lm_head
    ids = [1, 5, 9, 2, 7, 3, 8, 4]
    want = prompt_logits(dense, config, ids)
    assert max_row_error(prompt_logits(model, config, ids), want) <= 1e-3  # 8 rows: kernel
    long_ids = (ids * cpu_gguf.PREFILL_ROWS)[: cpu_gguf.PREFILL_ROWS]
    assert (
        max_row_error(
            prompt_logits(model, config, long_ids), prompt_logits(dense, config, long_ids)
        )
        <= 1e-4
    )


def test_gguf_load_widens_only_tensors_stored_otherwise(q4_1_gguf: Path) -> None:
    """The blocks are swapped in before the load: the loader reads as float32 only the tensors
    the file does not store in blocks (the norms, this file's float32 head), never a
    projection or the embeddings (the load used to build the whole model in float32 first)."""
    config = load_model_config(q4_1_gguf)
    weights = load_weights(q4_1_gguf, config)
    assert isinstance(weights, LazyWeights)
    read: list[str] = []
    original = weights.read
    weights.read = lambda name: (read.append(name), original(name))[1]
    build_model(config, weights, 256, torch.float32, torch.device("cpu"), quantization="gguf")
    assert "lm_head.weight" in read
    assert all(name.endswith("norm.weight") or name == "lm_head.weight" for name in read), read


def test_auto_picks_gguf_for_a_4_bit_gguf_on_a_cpu(
    q4_1_gguf: Path, tiny_model: Callable[..., Path], builtin_model_path: Path
) -> None:
    """auto: gguf on a CPU for a GGUF stored in the kernel's block types, whole and loaded from
    the file; int8 (its exact form of Q4_0 / Q4_1 / Q8_0) when tensor-parallel or dummy; none
    for an HF directory or a GPU. Asking gguf where it cannot serve names the reason."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert resolve_quantization("auto", builtin_model_path, cpu) == "gguf"  # Q4_1
    assert resolve_quantization("auto", q4_1_gguf, cpu) == "gguf"
    assert resolve_quantization("auto", q4_1_gguf, cpu, whole=False) == "int8"
    assert resolve_quantization("auto", q4_1_gguf, cpu, dummy=True) == "int8"
    assert resolve_quantization("auto", q4_1_gguf, gpu) == "none"
    hf_dir = tiny_model(hidden_size=64, intermediate_size=128)
    assert resolve_quantization("auto", hf_dir, cpu) == "none"
    with pytest.raises(ValueError, match="needs such a --model"):
        checked_quantization("gguf", hf_dir, cpu)
    with pytest.raises(ValueError, match="tensor-parallel"):
        checked_quantization("gguf", q4_1_gguf, cpu, whole=False)
    with pytest.raises(ValueError, match="runs on a CPU"):
        checked_quantization("gguf", q4_1_gguf, gpu)


def fused_against_unfused(
    engine: Engine, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> tuple[list[list[int]], list[list[int]], int]:
    """(greedy tokens with the fused decode layers, without them, decode_layer calls made)."""
    calls = []
    kernel = cpu_gguf.decode_layer
    monkeypatch.setattr(cpu_gguf, "decode_layer", lambda *a: calls.append(1) or kernel(*a))
    fused = generate(engine, prompts, 6)
    monkeypatch.setattr(cpu_fused, "ENABLED", False)
    unfused = generate(engine, prompts, 6)
    return fused, unfused, len(calls)


def test_fused_decode_layers_give_the_unfused_tokens(
    q4_1_gguf: Path, builtin_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode-only steps on GGUF blocks run each layer as one C++ call (engine/model/cpu_fused.py),
    with the greedy tokens of the layers' torch path: a tiny Llama (GQA) and the built-in
    model, prompts of several lengths decoded together (rows over different block counts)."""
    prompts = [[1, 5, 9, 2, 7], [3] * 19 + [8], [4, 6]]
    for path in (q4_1_gguf, builtin_model_path):
        engine = Engine(
            EngineConfig(model=str(path), device="cpu", num_kv_blocks=32, max_model_len=128, seed=0)
        )
        assert engine.quantization == "gguf"
        layers = [layer.fused_decode for layer in engine.model.layers]
        assert all(layers), "every layer fused"
        fused, unfused, calls = fused_against_unfused(engine, prompts, monkeypatch)
        assert calls == 5 * len(layers)  # the 5 decode steps after the prefill, every layer
        assert fused == unfused, path
        monkeypatch.undo()


def test_auto_multiplies_a_dense_copy_from_its_crossover(
    q4_1_gguf: Path, builtin_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--quantization auto keeps the blocks and, within --cpu-dense-weights-mib, a oneDNN-packed
    dense copy of the decoder layers that steps of --cpu-dense-rows rows or more multiply, the
    fused decode layers included (engine/model/cpu_weights.py): their tokens are the unfused layers'
    and, in float32, the dequantized model's. A copy over the budget is not made, and why is
    said; the steps each form ran are counted (/metrics)."""
    config = EngineConfig(
        model=str(q4_1_gguf), device="cpu", num_kv_blocks=32, max_model_len=128, seed=0,
        cpu_dense_rows=2,
    )  # fmt: skip
    engine = Engine(config)
    path = engine.model.weight_path
    assert path.dense_rows == 2 and path.name == f"gguf+dense-{path.dtype}", path
    assert path.reason == "--cpu-dense-rows=2" and path.dense_mib > 0
    layers = dense_layers(engine.model)
    assert len(layers) == 4 * len(engine.model.layers)
    assert all(layer.fast is not None and layer.fast_rows == 2 for layer in layers)
    prompts = [[1, 5, 9, 2, 7], [3] * 19 + [8], [4, 6]]
    fused, unfused, calls = fused_against_unfused(engine, prompts, monkeypatch)
    assert calls == 5 * len(engine.model.layers) and fused == unfused
    assert path.steps["dense"] >= 10  # 5 decode steps of 3 rows, fused and unfused
    telemetry = EngineTelemetry(lambda: path)
    assert telemetry._observe("cpu_dense_rows")[0][0] == 2.0
    assert dict((a["path"], v) for v, a in telemetry._observe("cpu_weight_steps")) == {
        "dense": path.steps["dense"], "packed": path.steps["packed"]
    }  # fmt: skip
    if path.dtype == "float32":
        reference = Engine(dataclasses.replace(config, quantization="none"))
        assert generate(reference, prompts, 6) == fused
    blocks_only = Engine(dataclasses.replace(config, quantization="gguf"))
    assert blocks_only.model.weight_path.name == "gguf"
    builtin = EngineConfig(model=str(builtin_model_path), device="cpu", num_kv_blocks=8, seed=0)
    small = Engine(dataclasses.replace(builtin, cpu_dense_weights_mib=100)).model.weight_path
    assert small.dense_rows == 0 and "exceeds --cpu-dense-weights-mib=100" in small.reason


def one_layer(batch: int, act_bits: int, one_region: bool, seed: int) -> list[torch.Tensor]:
    """decode_layer over `batch` rows of a small GQA layer (8 heads, 2 KV heads, head_dim 32, Q4_1
    and Q8_0 projections), rows of different lengths over shuffled blocks: (out, residual, the
    K and V pools after the call)."""
    hidden, heads, kv_heads, dim, inter, block = 256, 8, 2, 32, 512, 4
    gen = torch.Generator().manual_seed(seed)
    blocks = [
        random_blocks((heads + 2 * kv_heads) * dim, hidden, 3, seed),
        random_blocks(hidden, heads * dim, 8, seed + 1),
        random_blocks(2 * inter, hidden, 3, seed + 2),
        random_blocks(hidden, inter, 8, seed + 3),
    ]
    lens = torch.tensor([1 + (17 * b + 5) % 40 for b in range(batch)])
    tables = torch.randperm(16 * batch, generator=gen).view(batch, 16)
    last = lens - 1
    slots = tables.gather(1, (last // block)[:, None])[:, 0] * block + last % block
    pools = [torch.randn(16 * batch, block, kv_heads, dim, generator=gen) for _ in range(2)]
    x, residual = torch.randn(2, batch, hidden, generator=gen)
    norms = torch.rand(2, hidden, generator=gen) + 0.5
    bits, region = cpu_gguf.ACT_BITS, cpu_gguf.ONE_REGION
    cpu_gguf.ACT_BITS, cpu_gguf.ONE_REGION = act_bits, one_region
    try:
        out, new_residual = cpu_gguf.decode_layer(
            x, residual if batch != 3 else None, norms[0], norms[1], 1e-5, blocks, [3, 8, 3, 8],
            torch.randn(64, dim, generator=gen), last, pools[0], pools[1], slots, tables, lens,
            heads, dim**-0.5,
        )  # fmt: skip
    finally:
        cpu_gguf.ACT_BITS, cpu_gguf.ONE_REGION = bits, region
    return [out, new_residual, *pools]


@pytest.mark.parametrize("act_bits", [16, 8])
def test_one_region_layer_is_the_per_phase_layer_bit_for_bit(act_bits: int) -> None:
    """decode_layer on GGUF blocks as one OpenMP region (kernels/cpu_decode_team.h: the threads
    meet at barriers) gives exactly the per-phase path's outputs and KV writes, with two threads
    and one: 1 row, 3 (no residual), 6 (the int16 products' transposed form)."""
    threads = torch.get_num_threads()
    try:
        for num_threads in (2, 1):
            torch.set_num_threads(num_threads)
            for batch in (1, 3, 6):
                one, phases = (one_layer(batch, act_bits, flag, batch) for flag in (True, False))
                for got, want in zip(one, phases, strict=True):
                    assert torch.equal(got, want), (num_threads, batch)
    finally:
        torch.set_num_threads(threads)
