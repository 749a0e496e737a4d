"""CPU checks of kernels/w4a16_gemm.cu (W4A16: int4 levels, a scale and zero point per group
along K, act-order) and kernels/fp8_block_gemm.cu (e4m3 weights with 128 x 128 block scales) on
the kernel emulator of tests/kernel_emu/, through the real wrappers (kernels/w4a16.py,
kernels/fp8_block.py), against kernels/quant_reference.py in float64 with the GPU tests' bounds
(per-row relative L2 error: bf16 1e-2, fp16 5e-3). Each case names the instance and grid it must
reach: a partial last CTA, a channel count off the warp's R, rows short of the instance's M,
K tails that only some lanes reach, partial last groups. Skips without g++ or off Linux."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from llmserve.kernels import fp8_block, w4a16
from llmserve.kernels import quant_reference as qref
from tests.kernel_checks import assert_close
from tests.kernel_emu import emu

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def emulator() -> Iterator[emu.Emulator]:
    with emu.installed_or_skip() as emulator:
        yield emulator


@pytest.fixture
def kc(emulator: emu.Emulator) -> Iterator[ModuleType]:
    import llmserve.kernels.cuda as kcuda

    torch.manual_seed(0)
    emulator.launches.clear()
    yield kcuda


def w4_weight(
    n: int, k: int, group: int, *, signed: bool, asym: bool, act_order: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(q in the kept column order, scale, zero, perm) as engine/model/kept_weights.py holds a
    GPTQ / AWQ / compressed-tensors int4 weight."""
    groups = -(-k // group)
    q = torch.randint(-8, 8, (n, k)) if signed else torch.randint(0, 16, (n, k))
    scale = torch.rand(n, groups) * 0.02 + 0.005
    zero = torch.randint(0, 16, (n, groups)).float() if asym else None
    perm = torch.randperm(k) if act_order else None
    return q.int(), scale, zero, perm


# (rows, N, K, group, signed, asym, act_order, path) -> the launches: (GEMV instance's M, R, or
# None for the dequantize kernel; grid)
Launches = list[tuple[str | None, tuple[int, int, int]]]
W4_CASES: dict[str, tuple[tuple[int, int, int, int, bool, bool, bool, str], Launches]] = {
    # 20 channels: 3 CTAs, the last with one warp; K 160: lanes 5-31 idle, a partial group of 32
    "gemv-1-g128": ((1, 20, 160, 128, False, True, False, "auto"), [("1, 2", (3, 1, 1))]),
    # K 2112 = 66 chunks: every lane runs the 2-chunk loop, lanes 0-1 one more chunk; group 32
    "gemv-2-g32": ((2, 9, 2112, 32, True, False, False, "auto"), [("2, 2", (2, 1, 1))]),
    # 3 rows on the M=4 instance; 96 = 64 + a partial group of 32; act-order
    "gemv-3-g64-actorder": ((3, 17, 96, 64, False, True, True, "auto"), [("4, 4", (2, 1, 1))]),
    "gemv-8-g128-actorder": ((8, 12, 256, 128, True, False, True, "auto"), [("8, 4", (1, 1, 1))]),
    # 12 rows: the GEMV on rows 0-7, then on rows 8-11 (the M=4 instance)
    "sliced-12": (
        (12, 40, 160, 64, False, True, True, "auto"),
        [("8, 4", (3, 1, 1)), ("4, 4", (3, 1, 1))],
    ),
    # dequantized (40 * 160 / 8 words: 4 CTAs of 256 threads), then torch.matmul
    "dequant-9": ((9, 40, 160, 64, False, True, True, "dequant"), [(None, (4, 1, 1))]),
}


@pytest.mark.parametrize("case", list(W4_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_linear(
    kc: ModuleType, emulator: emu.Emulator, dtype: torch.dtype, case: str
) -> None:
    (rows, n, k, group, signed, asym, act_order, path), launches = W4_CASES[case]
    q, scale, zero, perm = w4_weight(n, k, group, signed=signed, asym=asym, act_order=act_order)
    weight = w4a16.pack_w4a16(q, scale, zero, group, perm)
    x = torch.randn(rows, k).to(dtype)
    wide = torch.full((rows, -(-n // 8) * 8 + 8), float("nan"), dtype=dtype)
    got = kc.w4a16_linear(x, weight, out=wide[:, :n], path=path)
    ctype = "bf16_t" if dtype == torch.bfloat16 else "f16_t"
    want = [
        (f"w4a16_gemv_kernel<{ctype}, {inst}>" if inst else f"w4a16_dequant_kernel<{ctype}>", grid)
        for inst, grid in launches
    ]
    assert [(launch.expr, launch.grid) for launch in emulator.launches] == want
    assert bool(wide[:, n:].isnan().all()), "a store past N"
    assert_close(got, qref.w4a16_linear_reference(x, q, scale, zero, group, perm), dtype, case)


def test_w4a16_pack_round_trips_and_dequantizes(kc: ModuleType) -> None:
    """The packed levels are q's (signed ones shifted by 8, the zero point alike), and the
    dequantize kernel gives (q - zero) * scale in the weight's column order."""
    q, scale, zero, _ = w4_weight(24, 96, 32, signed=True, asym=True, act_order=False)
    weight = w4a16.pack_w4a16(q, scale, zero, 32)
    assert torch.equal(w4a16.unpack_levels(weight), q + 8)
    want = qref.dequantize_groups(q, scale, zero, 32)
    got = w4a16.w4a16_dequantize(weight, torch.float16).float()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)


def test_w4a16_checks(kc: ModuleType) -> None:
    q, scale, zero, _ = w4_weight(8, 64, 32, signed=False, asym=True, act_order=False)
    weight = w4a16.pack_w4a16(q, scale, zero, 32)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=r"x.shape\[1\]=48 \(K\) must be a positive multiple of 32"
    ):
        kc.w4a16_linear(x[:, :48], weight)
    with pytest.raises(ValueError, match=r"path='tiled' must be one of"):
        kc.w4a16_linear(x, weight, path="tiled")
    with pytest.raises(ValueError, match=r"group 48 is not a multiple of 32"):
        w4a16.pack_w4a16(q, torch.ones(8, 2), None, 48)
    with pytest.raises(ValueError, match=r"int4 values span \[0, 16\]"):
        w4a16.pack_w4a16(q.clamp(max=15) + (q == 15).int(), scale, zero, 32)


def fp8_weight(n: int, k: int, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 q, scale [N, ceil(K / bk)]): block scales repeated per row, as kept_weights.py's
    fp8_weight holds DeepSeek-V3's weight_scale_inv."""
    bn, bk = block
    w = torch.randn(n, k) * 0.05
    blocks = torch.rand(-(-n // bn), -(-k // bk)) * 1e-3 + 1e-4
    rows = blocks.repeat_interleave(bn, dim=0)[:n]
    q = (w / rows.repeat_interleave(bk, dim=1)[:, :k]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, rows.contiguous()


FP8_CASES: dict[str, tuple[tuple[int, int, int, tuple[int, int], str], Launches]] = {
    "gemv-1": ((1, 20, 256, (128, 128), "auto"), [("1, 2", (3, 1, 1))]),
    # K 2080 = 16 blocks + a partial 32: the 4-chunk loop, then single chunks on some lanes
    "gemv-2-partial": ((2, 9, 2080, (128, 128), "auto"), [("2, 2", (2, 1, 1))]),
    "gemv-5-channel": ((5, 16, 96, (1, 96), "auto"), [("8, 4", (1, 1, 1))]),
    # 12 rows off Hopper: the GEMV on rows 0-7 and 8-11
    "sliced-12": ((12, 24, 256, (128, 128), "auto"), [("8, 4", (2, 1, 1)), ("4, 4", (2, 1, 1))]),
    # 40 rows off Hopper: dequantized (24 * 256 / 16 chunks: 2 CTAs), then torch.matmul
    "dequant-40": ((40, 24, 256, (128, 128), "auto"), [(None, (2, 1, 1))]),
}


@pytest.mark.parametrize("case", list(FP8_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_block_linear(
    kc: ModuleType, emulator: emu.Emulator, dtype: torch.dtype, case: str
) -> None:
    (rows, n, k, block, path), launches = FP8_CASES[case]
    q, scale = fp8_weight(n, k, block)
    weight = fp8_block.pack_fp8_block(q, scale, block[1])
    x = torch.randn(rows, k).to(dtype)
    wide = torch.full((rows, -(-n // 8) * 8 + 8), float("nan"), dtype=dtype)
    got = kc.fp8_block_linear(x, weight, out=wide[:, :n], path=path)
    ctype = "bf16_t" if dtype == torch.bfloat16 else "f16_t"
    want = [
        (f"fp8_block_gemv_kernel<{ctype}, {i}>" if i else f"fp8_block_dequant_kernel<{ctype}>", g)
        for i, g in launches
    ]
    assert [(launch.expr, launch.grid) for launch in emulator.launches] == want
    assert bool(wide[:, n:].isnan().all()), "a store past N"
    assert_close(got, qref.fp8_block_linear_reference(x, q, scale, block[1]), dtype, case)


def test_fp8_scaled_mm_path_passes_deepseeks_layout(
    kc: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Hopper path's arguments to torch._scaled_mm (no FP8 GEMM on this CPU: a stand-in that
    checks cuBLASLt's documented scale layouts and computes the blockwise product) give the
    reference with x quantized per token-group of 128; rows padded to a multiple of 4."""
    n, k, rows = 256, 384, 5
    q, scale = fp8_weight(n, k, (128, 128))
    weight = fp8_block.pack_fp8_block(q, scale, 128)
    assert weight.block_scales is not None and weight.block_scales.shape == (2, 3)
    seen: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def scaled_mm(a, b, *, scale_a, scale_b, out_dtype):  # type: ignore[no-untyped-def]
        assert a.shape[0] % 4 == 0 and scale_a.stride() == (1, a.shape[0])
        seen.append((tuple(scale_a.shape), tuple(scale_b.shape)))
        sa = scale_a.repeat_interleave(128, dim=1)
        sb = scale_b.repeat_interleave(128, dim=0).repeat_interleave(128, dim=1)
        return ((a.double() * sa.double()) @ (b.double() * sb.double())).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    x = torch.randn(rows, k).to(torch.bfloat16)
    got = fp8_block.scaled_mm_linear(x, weight)
    assert seen == [((8, 3), (3, 2))]
    want = qref.fp8_block_linear_reference(x, q, scale, 128, quantize_x=True)
    assert_close(got, want, torch.bfloat16, "scaled_mm")
    loose = qref.fp8_block_linear_reference(x, q, scale, 128)  # x's quantization: a few %
    assert float((got.double() - loose).norm() / loose.norm()) < 0.08


def test_fp8_block_checks(kc: ModuleType) -> None:
    q, scale = fp8_weight(8, 64, (1, 32))
    weight = fp8_block.pack_fp8_block(q, scale, 32)
    assert weight.block_scales is None
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"blockwise path is sm_90 only|needs a CUDA device"):
        kc.fp8_block_linear(x, weight, path="scaled_mm")
    with pytest.raises(ValueError, match=r"scales.shape\[1\]=2 must be 4"):
        bad = fp8_block.Fp8BlockWeight(weight.q, weight.scales, 16)
        kc.fp8_block_linear(x, bad)
    with pytest.raises(ValueError, match=r"group 8 is not a multiple of 16"):
        fp8_block.pack_fp8_block(q, torch.ones(8, 8), 8)
