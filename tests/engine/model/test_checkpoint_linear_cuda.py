"""The GPU wiring of quantized checkpoints (engine/model/checkpoint_linear_cuda.py) on the kernel
emulator of tests/kernel_emu/: int4 (W4A16) and FP8 linears kept as stored call kernels/
w4a16_gemm.cu and fp8_block_gemm.cu through CudaCheckpointLinear (fused parts, act-order parts
with their own column orders, a bias); a tiny GPTQ act-order Llama and a tiny FP8-block Llama
with every projection on those kernels give the logits of their dequantized twins; the start-up
self-check passes and names a kernel that disagrees; the start line says why the weights are
dequantized where the kernels cannot run. No GPU: CPU tensors, the real wrappers and launch
shapes. Skips without g++ or off Linux."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from llmserve.common.model_config import load_model_config
from llmserve.engine.model import checkpoint_linear_cuda as clc
from llmserve.engine.model import weights as weights_mod
from llmserve.engine.model.checkpoint_formats import CheckpointView
from llmserve.engine.model.checkpoint_linear import kept_description
from llmserve.engine.model.kept_weights import KeptWeight, fp8_weight, int_weight
from llmserve.engine.model.layers import Linear, PackedLinear
from llmserve.engine.model.weights import build_model, load_weights
from llmserve.kernels import w4a16
from tests.engine.model import test_weights
from tests.engine.model.test_weights import our_logits
from tests.kernel_emu import emu

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def emulator() -> Iterator[emu.Emulator]:
    with emu.installed_or_skip() as emulator:
        yield emulator


def _int4_part(n: int, k: int, group: int, act_order: bool, gen: torch.Generator) -> KeptWeight:
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, -(-k // group), generator=gen) * 0.02 + 0.005
    zero = torch.randint(0, 16, scale.shape, generator=gen).float()
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    kept = int_weight(4, q, scale, zero, group, g_idx)
    assert kept is not None
    return kept


@pytest.mark.parametrize("rows", [1, 12])
def test_linear_over_fused_int4_and_fp8_parts(emulator: emu.Emulator, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    k = 96  # 64 + a partial group of 32
    # q, k, v: two act-order parts with their own column orders and a plain one
    int4 = [_int4_part(n, k, 64, order, gen) for n, order in ((16, True), (8, True), (8, False))]
    w8 = torch.randn(40, 128, generator=gen) * 0.05
    block_scale = torch.rand(2, 4, generator=gen) * 1e-3 + 1e-4
    rows_scale = block_scale.repeat_interleave(32, dim=0)[:40].repeat_interleave(32, dim=1)
    q8 = (w8 / rows_scale).to(torch.float8_e4m3fn)
    fp8 = [
        fp8_weight(q8[:24], block_scale[:1], (32, 32)),
        fp8_weight(q8[24:], block_scale[1:], (32, 32)),
    ]
    for parts, width in ((int4, k), (fp8, 128)):
        assert all(p is not None for p in parts)
        kept = [p for p in parts if p is not None]
        bias = torch.randn(sum(p.q.shape[0] for p in kept), generator=gen)
        layer = clc.CudaCheckpointLinear(kept, bias.bfloat16(), CPU)
        x = torch.randn(rows, width, generator=gen).bfloat16()
        want = x.double() @ torch.cat([p.dequantize() for p in kept]).double().t() + bias.double()
        got = layer(x.view(1, rows, width))
        assert got.shape == (1, rows, want.shape[1]) and got.dtype == torch.bfloat16
        err = (got[0].double() - want).norm(dim=1) / want.norm(dim=1)
        assert float(err.max()) < 1e-2, (parts[0].kind if parts[0] else None, err)
    # each column order its own kernel call; the two FP8 parts one call
    assert len(clc.CudaCheckpointLinear(int4, None, CPU).segments) == 3
    assert len(clc.CudaCheckpointLinear([p for p in fp8 if p], None, CPU).segments) == 1


def test_self_check_passes_and_names_a_wrong_kernel(
    emulator: emu.Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert clc.self_check(CPU, torch.bfloat16) is None
    real = w4a16.w4a16_linear

    def off_by_one_group(x: torch.Tensor, weight: w4a16.W4A16Weight) -> torch.Tensor:
        out = real(x, weight)
        return out if x.shape[0] > 8 else out * 1.1

    monkeypatch.setattr(w4a16, "w4a16_linear", off_by_one_group)
    why = clc.self_check(CPU, torch.bfloat16)
    assert why is not None and why.startswith("self-check: w4a16_linear on 1 rows differs")


def test_the_start_line_says_why_weights_are_dequantized() -> None:
    why = clc._problem(torch.device("cuda"), torch.bfloat16)
    assert why == "kernels.cuda.is_available() is False (needs CuPy and an sm_80+ GPU)"
    why = clc._problem(torch.device("cpu"), torch.bfloat16)
    assert why == "the checkpoint kernels run on CUDA devices, not cpu"
    model = torch.nn.Module()
    setattr(model, clc.NOT_KEPT_ATTR, "kernels.cuda.is_available() is False")
    assert kept_description(model) == ""
    assert clc.gpu_kept_description(model) == (
        "0 linears kept quantized on the GPU (kernels.cuda.is_available() is False)"
    )


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def checkpoints(
    tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, Path]]:
    """GPTQ 4-bit, group 64, act-order; DeepSeek-V3's FP8 layout with 128 x 128 blocks; each
    with its dequantized float32 twin."""
    from llmserve.bench.quant_checkpoints import write_fp8_block, write_gptq

    float_dir = tiny_model(hidden_size=128, intermediate_size=256)
    root = tmp_path_factory.mktemp("gpu-kept")
    made = {name: (root / name, root / f"{name}-dq") for name in ("gptq", "fp8-block")}
    write_gptq(float_dir, *made["gptq"], bits=4, group_size=64, desc_act=True)
    write_fp8_block(float_dir, *made["fp8-block"], (128, 128))
    return made


@pytest.mark.parametrize("name", ["gptq", "fp8-block"])
def test_a_tiny_model_on_the_gpu_kernels_gives_its_dequantized_logits(
    emulator: emu.Emulator,
    checkpoints: dict[str, tuple[Path, Path]],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    """build_model's GPU step (keep_checkpoint_weights_cuda) on CPU tensors: every projection
    (2 layers x qkv, o, gate_up, down) served by the GPU kernels, bf16 logits within bf16's
    noise of the dequantized model's, and the same argmax at every position."""
    quantized, dequantized = checkpoints[name]

    def keep(model: torch.nn.Module, weights: object) -> int:
        return clc.keep_checkpoint_weights_cuda(model, weights, CPU)  # type: ignore[arg-type]

    monkeypatch.setattr(weights_mod, "keep_checkpoint_weights", keep)
    config = load_model_config(quantized)
    model = build_model(config, load_weights(quantized, config), 256, torch.bfloat16, CPU)
    kept = [m for m in model.modules() if isinstance(m, clc.CudaCheckpointLinear)]
    assert len(kept) == 8, kept_description(model)
    assert [n for n, m in model.named_modules() if isinstance(m, (Linear, PackedLinear))] == [
        "lm_head"
    ]
    plain = load_model_config(dequantized)
    ref_model = build_model(plain, load_weights(dequantized, plain), 256, torch.bfloat16, CPU)
    ref32 = build_model(plain, load_weights(dequantized, plain), 256, torch.float32, CPU)
    stem = "w4a16" if name == "gptq" else "fp8_block"
    # 2 tokens: the GEMV (2-row instance). Its other instances and paths are the kernel tests';
    # through this model on the emulator they would cost 5-30 s
    for length, kernel in ((2, f"{stem}_gemv_kernel"),):
        monkeypatch.setattr(test_weights, "PROMPT", test_weights.PROMPT[:length])
        emulator.launches.clear()
        with torch.no_grad():
            got = our_logits(config, model).float()
            assert {launch.expr.partition("<")[0] for launch in emulator.launches} == {kernel}
            bf16 = our_logits(plain, ref_model).float()
            exact = our_logits(plain, ref32)
        # within bf16's own error (the dequantized model in bf16 against float32)
        err, bf16_err = _max_rel(got, exact), _max_rel(bf16, exact)
        top1 = float((got.argmax(-1) == exact.argmax(-1)).float().mean())
        bf16_top1 = float((bf16.argmax(-1) == exact.argmax(-1)).float().mean())
        assert err <= 1.5 * bf16_err, (err, bf16_err)
        assert top1 >= bf16_top1 - 1 / length, (top1, bf16_top1)


def test_keep_on_gpu_without_the_kernels_notes_why(
    checkpoints: dict[str, tuple[Path, Path]],
) -> None:
    """build_model's GPU step where the kernels cannot run (no CUDA here): nothing swapped, and
    the reason kept for the start line."""
    quantized, _ = checkpoints["gptq"]
    config = load_model_config(quantized)
    model = build_model(config, None, 256, torch.bfloat16, CPU)
    weights = load_weights(quantized, config)
    assert isinstance(weights, CheckpointView)
    assert clc.keep_on_gpu(model, weights, torch.device("cuda"), torch.bfloat16) == 0
    assert not any(isinstance(m, clc.CudaCheckpointLinear) for m in model.modules())
    assert clc.gpu_kept_description(model).startswith(
        "0 linears kept quantized on the GPU (kernels.cuda.is_available() is False"
    )
