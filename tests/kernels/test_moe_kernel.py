"""kernels/moe.cu through kernels/moe.py on the CPU emulator (tests/kernel_emu), against
kernels/moe_reference.py and float64, under the emulated kernels' rules (tests/kernel_checks):
a NaN-filled output, so an element never written shows; per-row relative error <= 1e-2 (bf16) or
5e-3 (fp16). Skips without g++ or off Linux, as tests/kernels/test_kernels_emulated.py does."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from llmserve.kernels import moe_reference as moe_ref
from tests.kernel_checks import assert_close, nan_like
from tests.kernel_emu import emu

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def emulator() -> Iterator[emu.Emulator]:
    with emu.installed_or_skip() as emulator:
        yield emulator


@pytest.fixture
def kc(emulator: emu.Emulator) -> Iterator[ModuleType]:
    import llmserve.kernels.cuda as kcuda

    torch.manual_seed(26)
    emulator.launches.clear()
    yield kcuda


def float64_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor,
    w2: torch.Tensor, first_expert: int,
) -> torch.Tensor:  # fmt: skip
    """The module docstring's formula, pair by pair, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - first_expert
            if 0 <= e < w13.shape[0]:
                gate_up = w13[e].double() @ x[t].double()
                gate, up = gate_up[:inter], gate_up[inter:]
                hidden = gate * torch.sigmoid(gate) * up
                out[t] += float(weights[t, j]) * (w2[e].double() @ hidden)
    return out


# hidden 264: 33 chunks of 8, so lane 0 of each warp loops twice and lanes 1-31 once; inter 24:
# 3 chunks (lanes 3-31 idle in the down product). 8 experts, this rank holds 2..5 (first_expert
# 2); token 0 routes only to experts elsewhere (a zero row), token 3 to two local ones.
HIDDEN, INTER, NUM_EXPERTS, FIRST, NUM_LOCAL, TOP_K, TOKENS = 264, 24, 8, 2, 4, 2, 5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_moe_experts(
    kc: ModuleType, emulator: emu.Emulator, dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    x = torch.randn(TOKENS, HIDDEN).to(dtype)
    w13 = (torch.randn(NUM_LOCAL, 2 * INTER, HIDDEN) * HIDDEN**-0.5).to(dtype)
    w2 = (torch.randn(NUM_LOCAL, HIDDEN, INTER) * INTER**-0.5).to(dtype)
    weights, ids = moe_ref.route(torch.randn(TOKENS, NUM_EXPERTS), TOP_K, renormalize=True)
    ids[0] = torch.tensor([0, 7])
    ids[3] = torch.tensor([3, 5])
    expect = moe_ref.moe_experts(x, weights, ids, w13, w2, FIRST)
    got = kc.moe_experts(x, weights, ids.to(index_dtype), w13, w2, FIRST, out=nan_like(expect))
    ctype, itype = kc._CTYPES[dtype], kc._INDEX_CTYPES[index_dtype]
    grids = [(launch.expr, launch.grid) for launch in emulator.launches]
    assert grids == [
        (f"moe_gate_up_kernel<{ctype}, {itype}>", (TOKENS * TOP_K, INTER // 4, 1)),
        (f"moe_down_kernel<{ctype}, {itype}>", (TOKENS, HIDDEN // 4, 1)),
    ]
    assert not got[0].any(), "a token with no local expert must come out zero"
    assert_close(got[1:], expect[1:], dtype, "moe_experts vs reference")
    want = float64_experts(x, weights, ids, w13, w2, FIRST)
    assert_close(got[1:], want[1:], dtype, "moe_experts vs float64")


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_moe_experts_with_gpt_oss_biases_and_clamp(
    kc: ModuleType, emulator: emu.Emulator, dtype: torch.dtype
) -> None:
    """gpt-oss's experts (moe_reference.ClampedSwiGLU): biases on both products and the clamped
    SwiGLU, with a limit the products reach (0.5), against the reference and float64; without
    the biases or the clamp the result moves away."""
    x = torch.randn(TOKENS, HIDDEN).to(dtype)
    w13 = (torch.randn(NUM_LOCAL, 2 * INTER, HIDDEN) * HIDDEN**-0.5).to(dtype)
    w2 = (torch.randn(NUM_LOCAL, HIDDEN, INTER) * INTER**-0.5).to(dtype)
    b13, b2 = torch.randn(NUM_LOCAL, 2 * INTER).to(dtype), torch.randn(NUM_LOCAL, HIDDEN).to(dtype)
    oss = moe_ref.ClampedSwiGLU(b13, b2, 1.702, 0.5)
    weights, ids = moe_ref.route(torch.randn(TOKENS, NUM_EXPERTS), TOP_K, renormalize=True)
    ids[0] = torch.tensor([0, 7])
    expect = moe_ref.moe_experts(x, weights, ids, w13, w2, FIRST, oss)
    got = kc.moe_experts(x, weights, ids, w13, w2, FIRST, oss, out=nan_like(expect))
    assert not got[0].any(), "a token with no local expert must come out zero"
    assert_close(got[1:], expect[1:], dtype, "gpt-oss experts vs reference")
    want = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(TOKENS):
        for j in range(TOP_K):
            e = int(ids[t, j]) - FIRST
            if 0 <= e < NUM_LOCAL:
                gate_up = w13[e].double() @ x[t].double() + b13[e].double()
                h = oss.activation(gate_up)
                want[t] += float(weights[t, j]) * (w2[e].double() @ h + b2[e].double())
    assert_close(got[1:], want[1:], dtype, "gpt-oss experts vs float64")
    plain = moe_ref.moe_experts(x, weights, ids, w13, w2, FIRST)
    assert (plain[1:].float() - want[1:].float()).abs().max() > 0.5


def test_moe_experts_checks(kc: ModuleType) -> None:
    x = torch.randn(3, 16).half()
    w13, w2 = torch.randn(2, 16, 16).half(), torch.randn(2, 16, 8).half()
    weights, ids = torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int64)
    assert kc.moe_experts(x, weights, ids, w13, w2).shape == (3, 16)
    with pytest.raises(ValueError, match=r"weights\.dtype=torch\.float16"):
        kc.moe_experts(x, weights.half(), ids, w13, w2)
    with pytest.raises(ValueError, match=r"w2.shape\[2\]=16 must be 8"):
        kc.moe_experts(x, weights, ids, w13, torch.randn(2, 16, 16).half())
    with pytest.raises(ValueError, match="hidden=12 and inter=8 must be multiples of 8"):
        kc.moe_experts(
            x[:, :12], weights, ids, w13[:, :, :12].contiguous(), w2[:, :12].contiguous()
        )
    with pytest.raises(ValueError, match="first_expert=-1"):
        kc.moe_experts(x, weights, ids, w13, w2, -1)
    bad = moe_ref.ClampedSwiGLU(torch.zeros(2, 8).half(), torch.zeros(2, 16).half(), 1.7, 7.0)
    with pytest.raises(ValueError, match=r"b13.shape\[1\]=8 must be 16"):
        kc.moe_experts(x, weights, ids, w13, w2, 0, bad)
    assert kc.moe_experts(x[:0], weights[:0], ids[:0], w13, w2).shape == (0, 16)


@torch.inference_mode()
def test_self_check_covers_the_experts(emulator: emu.Emulator) -> None:
    """The engine's start-up check of the CUDA ops (engine.ops.self_check) runs moe.cu for an
    MoE model, so a kernel that fails or disagrees sends `auto` to torch before a request does."""
    from llmserve.common.moe_config import MoEConfig
    from llmserve.engine.model.ops import KernelOps, self_check
    from tests.engine.test_gpu_plumbing import tiny_config

    config = tiny_config(moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=32,
                                       renormalize=True))  # fmt: skip
    cpu = torch.device("cpu")
    emulator.launches.clear()
    assert self_check(KernelOps(), config, torch.bfloat16, cpu, 16) is None
    assert any(launch.expr.startswith("moe_down_kernel<") for launch in emulator.launches)

    class Broken(KernelOps):
        def moe_experts(self, x: torch.Tensor, *args: object) -> torch.Tensor:
            return torch.zeros_like(x)

    why = self_check(Broken(), config, torch.bfloat16, cpu, 16)
    assert why is not None and why.startswith("self-check: moe_experts differs")
