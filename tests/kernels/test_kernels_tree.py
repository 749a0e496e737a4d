"""prefill_attention.cu's token-tree mask (speculation's trees, engine/features/token_tree.py) on
the CPU emulator (tests/kernel_emu/), against kernels/reference.py's tree attention: a request
verifying a tree after a context beside a plain chunk and a decode row, both block_m instances,
over a pool of q's dtype and an FP8 one."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmserve.engine.features import token_tree as tt
from llmserve.kernels import reference as ref
from tests.kernel_checks import assert_close, make_pool, nan_like
from tests.kernel_emu import emu
from tests.kernels.test_kernels_emulated import CACHES, launched
from tests.kernels.test_kernels_emulated import emulator as emulator
from tests.kernels.test_kernels_emulated import kc as kc

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Node 0..6: two chains from the root and leaves beside them; 7 nodes after 60 known tokens (the
# tree straddles key tiles of 32 and 64), one scheduled token before them.
PARENTS = [-1, 0, 1, -1, 3, 0, 2]


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("block_m", [64, 128])
def test_prefill_tree_mask(kc: ModuleType, emulator: emu.Emulator, block_m: int, cache: str):
    dtype, head_dim, bs, group, num_kv = torch.float16, 64, 16, 2, 2
    known, n = 60, len(PARENTS)
    # (queries, seq_len, tree): the tree row (its last known token, then the nodes), a chunk of
    # 9 after 20, a decode row
    rows = [(1 + n, known + n, True), (9, 29, False), (1, 12, False)]
    seq_lens = [s for _, s, _ in rows]
    cache_dtype, k_scale, v_scale = CACHES[cache] or (dtype, 1.0, 1.0)
    k, v, tables = make_pool(
        seq_lens, bs, num_kv, head_dim, cache_dtype, 7, "cpu", k_scale, v_scale
    )
    cu = [0]
    for num_q, _, _ in rows:
        cu.append(cu[-1] + num_q)
    q = torch.randn(cu[-1], num_kv * group, head_dim).to(dtype) * 3
    bits = [0] + tt.node_bits(PARENTS) + [0] * 10
    out = nan_like(q)
    kc.paged_prefill_attention(
        q, k, v, tables, torch.tensor(seq_lens, dtype=torch.int32),
        torch.tensor(cu, dtype=torch.int32), head_dim**-0.5, k_scale, v_scale, block_m=block_m,
        out=out, tree_bits=torch.tensor(bits, dtype=torch.int64),
        tree_start=torch.tensor([known, 1 << 30, 1 << 30], dtype=torch.int32),
    )  # fmt: skip
    trees = [tt.row_attention(known, known - 1, PARENTS), None, None]
    with sdpa_kernel(SDPBackend.MATH):
        want = ref.paged_attention(
            q.double(), torch.nan_to_num(k.double()) * k_scale,
            torch.nan_to_num(v.double()) * v_scale, tables.long(), seq_lens, cu, head_dim**-0.5,
            trees=trees,
        )  # fmt: skip
    assert_close(out, want, dtype, f"tree block_m {block_m} {cache}")
    assert len(launched(emulator, "paged_prefill_kernel")) == 1


def test_tree_args_checked(kc: ModuleType) -> None:
    q = torch.zeros(3, 2, 64, dtype=torch.float16)
    k, v, tables = make_pool([3], 16, 1, 64, torch.float16)
    lens, cu = torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    bits, start = torch.zeros(3, dtype=torch.int64), torch.tensor([1], dtype=torch.int32)
    with pytest.raises(ValueError, match="tree_bits and tree_start come together"):
        kc.paged_prefill_attention(q, k, v, tables, lens, cu, 0.1, tree_bits=bits)
    with pytest.raises(ValueError, match="window=8 with a token tree"):
        kc.paged_prefill_attention(
            q, k, v, tables, lens, cu, 0.1, window=8, tree_bits=bits, tree_start=start
        )
