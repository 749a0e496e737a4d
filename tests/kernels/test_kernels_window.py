"""kernels/*.cu's sliding window, soft-capping and attention sinks on the CPU emulator
(tests/kernel_emu/), against kernels/reference.py: decode (one and several splits) and prefill
(both block_m instances, chunks with context), over a pool of q's dtype and an FP8 one. The
blocks wholly before every query's window are replaced in the block tables by a NaN-filled
block, as if freed and reused: a kernel that read them, even masked, would put NaN into the
output. Sinks (gpt-oss) are drawn around the scores' size, so that they move the outputs by more
than the tolerance."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmserve.kernels import reference as ref
from tests.kernel_checks import assert_close, make_pool, nan_like
from tests.kernel_emu import emu
from tests.kernels.test_kernels_emulated import CACHES, launched
from tests.kernels.test_kernels_emulated import emulator as emulator
from tests.kernels.test_kernels_emulated import kc as kc

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def poison_before_window(
    tables: torch.Tensor, first_keys: Sequence[int], block_size: int
) -> torch.Tensor:
    """tables, each row's blocks wholly before first_keys[b] pointing at a NaN-filled block."""
    pad = int(tables[0, -1])  # make_pool pads rows with a block nobody owns: all NaN
    poisoned = tables.clone()
    for b, first in enumerate(first_keys):
        poisoned[b, : max(first, 0) // block_size] = pad
    return poisoned


def expected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: list[int],
    cu: list[int],
    scales: tuple[float, float],
    window: int,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    kk = torch.nan_to_num(k.double(), nan=0.0) * scales[0]
    vv = torch.nan_to_num(v.double(), nan=0.0) * scales[1]
    with sdpa_kernel(SDPBackend.MATH):
        return ref.paged_attention(
            q.double(), kk, vv, tables.long(), seq_lens, cu, q.shape[-1] ** -0.5,
            window=window, softcap=softcap, sinks=None if sinks is None else sinks.double(),
        )  # fmt: skip


def make_sinks(num_heads: int, with_sinks: bool) -> torch.Tensor | None:
    """float32 [num_heads] logits in [-1, 3): rows whose scores stay below them lose most of
    their mass to the sink, rows above them little (seeded by the caller's torch.manual_seed)."""
    return torch.rand(num_heads) * 4 - 1 if with_sinks else None


# (dtype, head_dim, block_size, group, num_kv_heads, seq_lens, num_splits, window, softcap[,
# sinks])
DECODE_CASES: dict[str, tuple] = {
    # 130 tokens, window 37: tiles 5-8 read (keys 93-129), blocks 0-4 poisoned; 40 and 7
    # tokens: the window reaches back into / past the start; one split.
    "window-one-split": (torch.float16, 64, 16, 4, 2, [130, 40, 7], 1, 37, None),
    # 3 splits over the window's tiles only; soft-capped scores (cap 2: the scores exceed it).
    "window-softcap-three-splits": (torch.bfloat16, 64, 32, 2, 1, [200, 33, 96], 3, 50, 2.0),
    # soft-capping alone, the whole context.
    "softcap-only": (torch.float16, 128, 16, 8, 1, [70, 5], 2, None, 1.5),
    # Token-level KV: every slot before the window poisoned, tiles straddling the window's start.
    "window-token-level": (torch.float16, 64, 1, 4, 2, [130, 40, 7], 2, 37, None),
    # gpt-oss: sinks with a window, normalised in the CTA (one split) and in the merge (3).
    "sinks-window-one-split": (torch.bfloat16, 64, 16, 4, 2, [130, 40, 7], 1, 37, None, True),
    "sinks-three-splits": (torch.float16, 64, 16, 2, 2, [200, 33, 1], 3, None, None, True),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_window_softcap(kc: ModuleType, emulator: emu.Emulator, case: str, cache: str):
    dtype, head_dim, bs, group, num_kv, seq_lens, splits, window, cap, *with_sinks = DECODE_CASES[
        case
    ]
    cache_dtype, k_scale, v_scale = CACHES[cache] or (dtype, 1.0, 1.0)
    k, v, tables = make_pool(
        seq_lens, bs, num_kv, head_dim, cache_dtype, 7, "cpu", k_scale, v_scale
    )
    if window is not None:
        tables = poison_before_window(tables, [n - window for n in seq_lens], bs)
    q = torch.randn(len(seq_lens), num_kv * group, head_dim).to(dtype) * 3
    sinks = make_sinks(num_kv * group, bool(with_sinks))
    out = nan_like(q)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    kc.paged_decode_attention(
        q, k, v, tables, lens, head_dim**-0.5, k_scale, v_scale,
        num_splits=splits, out=out, window=window, softcap=cap, sinks=sinks,
    )  # fmt: skip
    cu = list(range(len(seq_lens) + 1))
    want = expected(q, k, v, tables, seq_lens, cu, (k_scale, v_scale), window, cap, sinks)
    assert_close(out, want, dtype, f"decode {case} {cache}")
    (main,) = launched(emulator, "paged_decode_kernel")
    assert main.grid[2] == splits
    assert len(launched(emulator, "paged_decode_merge_kernel")) == (splits > 1)


# (dtype, head_dim, block_size, group, num_kv_heads, chunks (new, context), block_m, window, cap
# [, sinks])
PREFILL_CASES: dict[str, tuple] = {
    # a whole prompt longer than the window, a chunk after context, a decode row, a long chunk
    # after a long context: later row tiles skip more key tiles than the first.
    "bm64-window": (
        torch.float16,
        64,
        16,
        1,
        2,
        [(40, 0), (20, 62), (1, 5), (70, 126)],
        64,
        29,
        None,
    ),
    "bm128-window-softcap": (torch.bfloat16, 64, 16, 4, 1, [(33, 0), (20, 62)], 128, 24, 2.0),
    "bm64-softcap-only": (torch.float16, 128, 32, 2, 1, [(17, 30), (9, 0)], 64, None, 1.5),
    # gpt-oss: sinks over a window (rows of 4 heads per kv head) and over the whole context.
    "bm128-window-sinks": (torch.bfloat16, 64, 16, 4, 2, [(33, 0), (1, 40)], 128, 24, None, True),
    "bm64-sinks": (torch.float16, 64, 16, 2, 1, [(20, 30), (9, 0)], 64, None, None, True),
}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_window_softcap(kc: ModuleType, emulator: emu.Emulator, case: str, cache: str):
    dtype, head_dim, bs, group, num_kv, chunks, block_m, window, cap, *with_sinks = PREFILL_CASES[
        case
    ]
    seq_lens = [n + c for n, c in chunks]
    cache_dtype, k_scale, v_scale = CACHES[cache] or (dtype, 1.0, 1.0)
    k, v, tables = make_pool(
        seq_lens, bs, num_kv, head_dim, cache_dtype, 7, "cpu", k_scale, v_scale
    )
    if window is not None:  # the first query of each chunk sits at its context's length
        tables = poison_before_window(tables, [c - window + 1 for _, c in chunks], bs)
    cu = [0]
    for n, _ in chunks:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], num_kv * group, head_dim).to(dtype) * 3
    sinks = make_sinks(num_kv * group, bool(with_sinks))
    out = nan_like(q)
    kc.paged_prefill_attention(
        q, k, v, tables, torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32), head_dim**-0.5, k_scale, v_scale,
        block_m=block_m, out=out, window=window, softcap=cap, sinks=sinks,
    )  # fmt: skip
    want = expected(q, k, v, tables, seq_lens, cu, (k_scale, v_scale), window, cap, sinks)
    assert_close(out, want, dtype, f"prefill {case} {cache}")
    assert len(launched(emulator, "paged_prefill_kernel")) == 1


def test_window_and_softcap_checks(kc: ModuleType) -> None:
    k, v, tables = make_pool([20], 16, 1, 64, torch.float16)
    q = torch.randn(1, 1, 64).to(torch.float16)
    lens = torch.tensor([20], dtype=torch.int32)
    with pytest.raises(ValueError, match="window=0 must be at least 1"):
        kc.paged_decode_attention(q, k, v, tables, lens, 0.1, window=0)
    with pytest.raises(ValueError, match=r"softcap=-1\.0 must be positive"):
        kc.paged_decode_attention(q, k, v, tables, lens, 0.1, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sinks.dtype=torch.float16 is not supported"):
        kc.paged_decode_attention(q, k, v, tables, lens, 0.1, sinks=torch.zeros(1).half())
    with pytest.raises(ValueError, match=r"sinks.shape\[0\]=2 must be 1"):
        kc.paged_decode_attention(q, k, v, tables, lens, 0.1, sinks=torch.zeros(2))
