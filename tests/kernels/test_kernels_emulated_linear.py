"""CPU checks of kernels/gated_delta.cu (Qwen3-Next's gated delta-rule decode step) and
kernels/ssd_step.cu (Mamba-2's selective-state decode step) on the kernel emulator of
tests/kernel_emu/, launched through kernels/cuda.py's real wrappers and compared with their
references (gated_delta_reference.py, ssd_step_reference.py) by per-row relative L2 error.

Each case is the smallest that reaches the kernel's paths: a partial last CTA, a skipped row
(slot out of range) whose output must stay unwritten, both index types. Skips without g++ or
off Linux (the emulator needs both)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from llmserve.kernels import gated_delta_reference as ref
from llmserve.kernels import ssd_step_reference as ssd_ref
from tests.kernel_emu import emu

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def emulator() -> Iterator[emu.Emulator]:
    with emu.installed_or_skip() as emulator:
        yield emulator


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().flatten(1), want.double().flatten(1)
    return float(((got - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-30)).max())


@pytest.mark.parametrize(
    ("dtype", "index_dtype", "l2norm"),
    [(torch.bfloat16, torch.int32, True), (torch.float16, torch.int64, False)],
)
def test_gated_delta_step_matches_reference(
    emulator: emu.Emulator, dtype: torch.dtype, index_dtype: torch.dtype, l2norm: bool
) -> None:
    import llmserve.kernels.cuda as kc

    torch.manual_seed(0)
    rows, heads, dk, dv, slots = 3, 2, 40, 160, 4
    q, k = (torch.randn(rows, heads, dk).to(dtype) for _ in range(2))
    v = torch.randn(rows, heads, dv).to(dtype)
    g = -torch.rand(rows, heads)  # log decay in (-1, 0]
    beta = torch.rand(rows, heads)
    state = torch.randn(slots, heads, dk, dv) * 0.1
    slot_ids = torch.tensor([2, -1, 0], dtype=index_dtype)
    want_state = state.clone()
    want = ref.gated_delta_step(q, k, v, g, beta, want_state, slot_ids,
                                torch.zeros(rows, heads, dv, dtype=dtype), l2norm)  # fmt: skip
    out = torch.full((rows, heads, dv), float("nan"), dtype=dtype)
    emulator.launches.clear()
    kc.gated_delta_step(q, k, v, g, beta, state, slot_ids, out, l2norm)
    assert [(launch.grid, launch.block) for launch in emulator.launches] == [
        ((rows, heads, 2), (128, 1, 1))
    ]
    tol = 1e-2 if dtype == torch.bfloat16 else 5e-3
    used = [0, 2]
    assert _rel_err(out[used], want[used]) <= tol
    assert out[1].isnan().all(), "the skipped row's output was written"
    assert _rel_err(state, want_state) <= 1e-5, "the fp32 state differs from the reference"


def test_gated_delta_step_names_bad_argument(emulator: emu.Emulator) -> None:
    import llmserve.kernels.cuda as kc

    q = torch.zeros(1, 1, 300, dtype=torch.float16)
    v = torch.zeros(1, 1, 8, dtype=torch.float16)
    f = torch.zeros(1, 1)
    with pytest.raises(ValueError, match=r"q.shape\[2\]=300 \(dk\) must be in 1..256"):
        kc.gated_delta_step(q, q, v, f, f, torch.zeros(1, 1, 300, 8), torch.zeros(1,
                            dtype=torch.int32), v.clone())  # fmt: skip


def test_reference_matches_transformers_qwen3_next() -> None:
    """The reference is transformers' recurrence at length 1 (so the kernel is checked against
    the model's own arithmetic, not a second reading of the paper)."""
    modeling = pytest.importorskip(
        "transformers.models.qwen3_next.modeling_qwen3_next",
        reason="this transformers has no Qwen3-Next",
    )
    torch.manual_seed(0)
    b, h, dk, dv = 2, 3, 16, 24
    q, k, v = torch.randn(b, 1, h, dk), torch.randn(b, 1, h, dk), torch.randn(b, 1, h, dv)
    g, beta, s0 = -torch.rand(b, 1, h), torch.rand(b, 1, h), torch.randn(b, h, dk, dv) * 0.1
    want_out, want_state = modeling.torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, s0.clone(), True, use_qk_l2norm_in_kernel=True
    )
    state, out = s0.clone(), torch.zeros(b, h, dv)
    ref.gated_delta_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state,
                         torch.arange(b), out)  # fmt: skip
    torch.testing.assert_close(out, want_out[:, 0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, want_state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("dtype", "index_dtype"), [(torch.bfloat16, torch.int64), (torch.float16, torch.int32)]
)
def test_ssd_step_matches_reference(
    emulator: emu.Emulator, dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    """Mamba-2's step: heads sharing a group's B and C (4 heads, 2 groups), head_dim 6 (a
    partial CTA of 4 channels), d_state 40 (lanes past 32), a skipped row, dt both sides of
    softplus's threshold."""
    import llmserve.kernels.cuda as kc

    torch.manual_seed(1)
    rows, heads, groups, head_dim, d_state, slots = 3, 4, 2, 6, 40, 3
    x = torch.randn(rows, heads, head_dim).to(dtype)
    dt = torch.tensor([[-3.0, 0.5, 21.0, 1.0]] * rows)
    dt_bias, a, d = torch.randn(heads) * 0.1, -torch.rand(heads) * 0.1, torch.randn(heads)
    b, c = (torch.randn(rows, groups, d_state).to(dtype) for _ in range(2))
    state = torch.randn(slots, heads, head_dim, d_state)
    slot_ids = torch.tensor([1, 5, 0], dtype=index_dtype)
    want_state = state.clone()
    want = ssd_ref.ssd_step(x, dt, dt_bias, a, b, c, d, want_state, slot_ids,
                            torch.zeros_like(x))  # fmt: skip
    out = torch.full_like(x, float("nan"))
    emulator.launches.clear()
    kc.ssd_step(x, dt, dt_bias, a, b, c, d, state, slot_ids, out)
    assert [(launch.grid, launch.block) for launch in emulator.launches] == [
        ((rows, heads, 2), (128, 1, 1))
    ]
    tol = 1e-2 if dtype == torch.bfloat16 else 5e-3
    assert _rel_err(out[[0, 2]], want[[0, 2]]) <= tol
    assert out[1].isnan().all(), "the skipped row's output was written"
    assert _rel_err(state, want_state) <= 1e-5, "the fp32 state differs from the reference"


def test_ssd_step_names_bad_groups(emulator: emu.Emulator) -> None:
    import llmserve.kernels.cuda as kc

    x = torch.zeros(1, 3, 4, dtype=torch.float16)
    f2, f1 = torch.zeros(1, 3), torch.zeros(3)
    bc = torch.zeros(1, 2, 8, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"b.shape\[1\]=2 \(groups\) must divide"):
        kc.ssd_step(x, f2, f1, f1, bc, bc, f1, torch.zeros(1, 3, 4, 8),
                    torch.zeros(1, dtype=torch.int32), x.clone())  # fmt: skip
