"""MoE experts kept quantized on a GPU (engine/model/kept_experts.py with
checkpoint_linear_cuda.py's CudaCheckpointLinear per expert and projection) on the kernel emulator
of tests/kernel_emu/: tiny Mixtral / Qwen3-MoE / gpt-oss checkpoints in GPTQ (act-order),
compressed-tensors W4A16 and W8A16, FP8 block-scaled and MXFP4, built by build_model's GPU step on
CPU tensors, every expert on kernels/w4a16_gemm.cu (BITS 4, or 8 for W8A16 and MXFP4 converted
exactly to int8) or fp8_block_gemm.cu, logits within bf16's noise of the dequantized model's;
MXFP4's int8 form is exact; a model with kept experts decodes without CUDA graphs and says why. No
GPU: the real wrappers and launch shapes. Skips without g++ or off Linux."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from llmserve.common.model_config import load_model_config
from llmserve.engine.model import checkpoint_linear_cuda as clc
from llmserve.engine.model import weights as weights_mod
from llmserve.engine.model.kept_experts import KeptExperts
from llmserve.engine.model.kept_weights import KeptWeight
from llmserve.engine.model.weights import build_model, load_weights
from llmserve.engine.step.graph_capture import uses_graphs
from tests.engine.model import test_weights
from tests.engine.model.test_weights import our_logits
from tests.kernel_emu import emu

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")
PROMPT_TOKENS = 3  # 3 tokens x top-2: a few experts per layer, each a GEMV of 1-3 rows


@pytest.fixture(scope="module")
def emulator() -> Iterator[emu.Emulator]:
    with emu.installed_or_skip() as emulator:
        yield emulator


def _write(family: str, fmt: str, root: Path) -> tuple[Path, Path]:
    from llmserve.bench.quant_checkpoints import write_mxfp4
    from tests.engine.model.test_checkpoint_schemes import MOE_FORMATS
    from tests.moe_models import make_tiny_moe

    float_dir = make_tiny_moe(root / "float", family)
    if fmt == "mxfp4":
        write_mxfp4(float_dir, root / "q", root / "dequantized")
    else:
        MOE_FORMATS[fmt](float_dir, root / "q", root / "dequantized")
    return root / "q", root / "dequantized"


def _max_rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


W4, W8, FP8 = "wqa16_gemv_kernel<bf16_t, 4, ", "wqa16_gemv_kernel<bf16_t, 8, ", "fp8_block_gemv"
# (family, format) -> (the experts' kind on the GPU, the GEMV they launch)
# One case per kernel kind the experts reach (the suite's budget: each case is a whole tiny
# model on the emulator; compressed-tensors W4A16 / W8A16 experts reach the same int4 / int8
# kernels, and their CPU reading is test_checkpoint_schemes's)
CASES = {
    ("mixtral", "gptq"): ("int4", W4),  # act-order, group 32: a permutation per projection
    ("gpt_oss", "mxfp4"): ("int8", W8),  # e2m1 + e8m0 per 32, converted exactly to int8
    ("qwen3_moe", "fp8-block"): ("fp8", FP8),  # 16 x 32 blocks
}


@pytest.mark.parametrize(("family", "fmt"), list(CASES))
def test_tiny_moe_experts_on_the_gpu_kernels_give_the_dequantized_logits(
    emulator: emu.Emulator,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
    family: str,
    fmt: str,
) -> None:
    kind, kernel = CASES[(family, fmt)]
    quantized, dequantized = _write(family, fmt, tmp_path_factory.mktemp(f"{family}-{fmt}"))

    def keep_dense(model: Any, weights: Any) -> int:
        return clc.keep_checkpoint_weights_cuda(model, weights, CPU)

    def keep_experts(model: Any, weights: Any) -> int:
        return clc.keep_experts_cuda(model, weights, CPU)

    monkeypatch.setattr(weights_mod, "keep_checkpoint_weights", keep_dense)
    monkeypatch.setattr(weights_mod, "keep_expert_weights", keep_experts)
    config = load_model_config(quantized)
    model = build_model(config, load_weights(quantized, config), 256, torch.bfloat16, CPU)
    blocks = [layer.mlp for layer in model.layers if hasattr(layer.mlp, "experts")]
    assert blocks and all(isinstance(b.experts, KeptExperts) for b in blocks)
    gpu_linear = clc.CudaCheckpointLinear
    linears = [m for b in blocks for m in b.experts.modules() if isinstance(m, gpu_linear)]
    assert len(linears) == 16 * len(blocks)  # 8 experts x (gate/up, down)
    assert {m.kind for m in linears} == {kind}
    held = clc.gpu_kept_description(model)
    assert f", {16 * len(blocks)} of them experts'" in held, held

    plain = load_model_config(dequantized)
    ref16 = build_model(plain, load_weights(dequantized, plain), 256, torch.bfloat16, CPU)
    ref32 = build_model(plain, load_weights(dequantized, plain), 256, torch.float32, CPU)
    monkeypatch.setattr(test_weights, "PROMPT", test_weights.PROMPT[:PROMPT_TOKENS])
    emulator.launches.clear()
    with torch.no_grad():
        got = our_logits(config, model).float()
        launched = {launch.expr for launch in emulator.launches}
        bf16 = our_logits(plain, ref16).float()
        exact = our_logits(plain, ref32)
    expert_gemvs = {e for e in launched if e.startswith(kernel)}
    assert expert_gemvs, launched
    # within bf16's own error (the dequantized model in bf16 against float32), same argmax. The
    # ratio of the two is noise: 0.5x-1.9x over these cases at 3 and 8 tokens; a 5% error in one
    # scale (MXFP4's conversion, tried) gave 4.5x
    err, bf16_err = _max_rel(got, exact), _max_rel(bf16, exact)
    assert err <= 2 * bf16_err, (err, bf16_err)
    top1 = float((got.argmax(-1) == exact.argmax(-1)).float().mean())
    bf16_top1 = float((bf16.argmax(-1) == exact.argmax(-1)).float().mean())
    assert top1 >= bf16_top1 - 1 / PROMPT_TOKENS, (top1, bf16_top1)


def test_mxfp4_becomes_int8_exactly() -> None:
    """Every e2m1 code with e8m0 scales from 2^-127 to 2^127: the int8 form's weights are the
    MXFP4 weights, bit for bit, and take the GPU kernels."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(4, 16)  # [4, 256]
    exponents = torch.tensor([0, 1, 127, 254]).repeat_interleave(8).view(4, 8)
    scale = torch.ldexp(torch.ones(4, 8), exponents - 127)
    fp4 = KeptWeight("fp4", codes, scale, None, 32)
    int8 = clc.gpu_form(fp4)
    assert int8.kind == "int8" and int8.q.dtype == torch.int8
    assert int(int8.q.abs().max()) == 12 and clc.fits(int8) is None
    assert torch.equal(int8.dequantize(), fp4.dequantize())
    assert clc.gpu_form(int8) is int8


def test_kept_experts_decode_without_cuda_graphs() -> None:
    """KeptExperts reads its per-expert counts on the host: not capturable, said on the start
    line's cuda_graphs field."""
    experts = KeptExperts(range(2), [torch.nn.Identity()] * 2, [torch.nn.Identity()] * 2, abs)
    model: Any = SimpleNamespace(
        ops=SimpleNamespace(graph_safe=True, name="cuda"),
        config=SimpleNamespace(state_layout=None),
        modules=lambda: [experts],
    )
    config: Any = SimpleNamespace(enforce_eager=False)
    using, why = uses_graphs(config, torch.device("cuda"), model, None)
    assert not using and why.startswith("MoE experts kept quantized"), why
