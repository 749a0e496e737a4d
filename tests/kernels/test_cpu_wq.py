"""kernels/cpu_wq.cpp (weights kept as checkpoints store them: int8, int4, fp8, fp4, dequantized in
registers) against its plain-torch twin, on every path (decode rows, buffered rows, the widened
GEMM) and ISA this CPU has; and engine/model/checkpoint_linear.py's fused and act-order layers
against the float weight they stand for."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.model.checkpoint_linear import CheckpointLinear
from llmserve.engine.model.kept_weights import KeptWeight, act_order, int_weight
from llmserve.kernels import cpu_wq

pytestmark = pytest.mark.usefixtures("one_torch_thread")

if cpu_wq.unavailable() is not None:
    pytest.skip(f"cpu_wq kernel: {cpu_wq.unavailable()}", allow_module_level=True)

ISAS = ["avx2"] + (["avx512"] if cpu_wq.has_avx512() else [])


def _weight(kind: str, n: int, k: int, group: int, signed: bool, seed: int) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor | None
]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, -(-k // group), generator=g) * 0.02 + 0.001
    if kind == "fp8":
        return (torch.randn(n, k, generator=g) * 60).to(torch.float8_e4m3fn), scale, None
    if kind == "fp4":  # e2m1 codes; MXFP4's scales are powers of two, any float is read alike
        return torch.randint(0, 16, (n, k), generator=g).to(torch.uint8), scale, None
    low, high = {
        "int4": (-8, 8) if signed else (0, 16),
        "int8": (-128, 128) if signed else (0, 256),
    }[kind]
    q = torch.randint(low, high, (n, k), generator=g)
    zero = None if signed else torch.randint(low, high, (n, -(-k // group)), generator=g).float()
    return q, scale, zero


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kind", ["int4", "int8", "fp8", "fp4"])
@pytest.mark.parametrize("signed", [True, False])
def test_kernel_matches_its_reference_at_every_row_count(kind: str, signed: bool, isa: str) -> None:
    """N = 40 (padded to 48), K = 120 in groups of 32 (the last one partial): 1-4 rows
    (registers), 5 and 16 (buffered tile), 130 (widened weight, torch's GEMM); a signed int4
    weight with no zero point is stored shifted."""
    q, scale, zero = _weight(kind, 40, 120, 32, signed, seed=len(kind) + signed)
    packed = cpu_wq.pack_wq(kind, q, scale, zero, 32)
    bias = torch.randn(40)
    for rows in (1, 3, 4, 5, 16, 130):
        x = torch.randn(rows, 120)
        values = cpu_wq.fp4_values(q) if kind == "fp4" else q
        want = cpu_wq.wq_linear_reference(x, values, scale, zero, 32, bias)
        got = cpu_wq.wq_linear(x, packed, bias, isa=isa)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=f"{rows} rows")


@pytest.mark.parametrize("isa", ISAS)
def test_every_fp8_value_widens_exactly(isa: str) -> None:
    """All 254 finite e4m3fn bytes, subnormals and both zeros included."""
    raw = torch.arange(256, dtype=torch.uint8)
    raw = raw[(raw & 0x7F) != 0x7F]
    q = torch.cat([raw, raw[:2]]).repeat(16, 1).view(torch.float8_e4m3fn)  # [16, 256]
    packed = cpu_wq.pack_wq("fp8", q, torch.ones(16, 1), None, 256)
    out = torch.empty(16, 256)
    cpu_wq._module().wq_widen(
        packed.q, packed.scales, packed.offsets, 2, 256, out, cpu_wq.ISAS[isa]
    )
    assert torch.equal(out, q.float())


@pytest.mark.parametrize("isa", ISAS)
def test_every_fp4_code_widens_exactly(isa: str) -> None:
    """All 16 e2m1 codes in both nibbles of a byte (channels j and j + 8), times power-of-two
    scales from 2^-127 (a subnormal) to 2^127, as MXFP4's e8m0 gives them."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(16, 2)  # [16, 32]
    codes[8:] = codes[8:].flip(1)
    exponents = torch.arange(16) * 16 - 127
    exponents[-1] = 127
    scale = torch.ldexp(torch.ones(16, 1), exponents.view(16, 1))
    packed = cpu_wq.pack_wq("fp4", codes, scale, None, 32)
    out = torch.empty(16, 32)
    cpu_wq._module().wq_widen(packed.q, packed.scales, packed.offsets, 3, 32, out, cpu_wq.ISAS[isa])
    assert torch.equal(out, cpu_wq.fp4_values(codes) * scale)


def test_values_outside_the_kind_are_refused() -> None:
    with pytest.raises(ValueError, match=r"int4 values span \[-3, 20\]"):
        cpu_wq.pack_wq("int4", torch.tensor([[-3, 20] * 16]), torch.ones(1, 1), None, 32)


def test_act_order_groups_become_contiguous_runs() -> None:
    g_idx = torch.tensor([1, 0, 1, 0, 2, 2])
    fits, perm = act_order(g_idx, 2, 6)
    assert fits and perm is not None and perm.tolist() == [1, 3, 0, 2, 4, 5]
    assert act_order(torch.tensor([0, 0, 1, 1]), 2, 4) == (True, None)
    assert act_order(torch.tensor([0, 0, 0, 1]), 2, 4)[0] is False  # a group of 3: not kept


def test_fused_act_order_and_mixed_parts_equal_their_float_weight() -> None:
    """q/k/v-like parts: two sharing one act-order permutation (one kernel call), a third with
    its own (a call of its own), one signed and symmetric, the others unsigned with zeros."""
    k, group = 64, 16
    g = torch.Generator().manual_seed(3)
    shared = torch.randperm(k, generator=g) // group
    own = torch.randperm(k, generator=g) // group
    parts: list[KeptWeight] = []
    for n, g_idx, signed in ((32, shared, True), (16, shared, False), (16, own, False)):
        q, scale, zero = _weight("int4", n, k, group, signed, seed=n + signed)
        kept = int_weight(4, q, scale, zero, group, g_idx)
        assert kept is not None
        parts.append(kept)
    layer = CheckpointLinear(parts, torch.randn(64))
    assert len(layer.segments) == 2
    weight = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(3, k)
    want = torch.nn.functional.linear(x, weight, layer.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
