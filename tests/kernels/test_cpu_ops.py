"""engine.ops.CpuOps (the CPU engine's ops) against kernels/reference.py: decode-only steps take
its batched path, mixed steps the reference's; both store the step's K/V the same way."""

from __future__ import annotations

import pytest
import torch

from llmserve.engine.model.ops import AttentionContext, CpuOps, ReferenceOps

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize(
    ("seq_lens", "cu_seqlens_q"),
    [([5, 17, 33], [0, 1, 2, 3]), ([9, 40], [0, 1, 7]), ([1], [0, 1])],  # decode / mixed
)
def test_cpu_ops_match_the_reference(
    cache_dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    seq_lens: list[int],
    cu_seqlens_q: list[int],
) -> None:
    gen = torch.Generator().manual_seed(len(seq_lens) * 10 + heads)
    block_size, dim, num_blocks = 8, 16, 24
    tokens = cu_seqlens_q[-1]
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: 6 * len(seq_lens)].view(len(seq_lens), 6)
    slots = []
    for b, length in enumerate(seq_lens):
        num_q = cu_seqlens_q[b + 1] - cu_seqlens_q[b]
        for pos in range(length - num_q, length):
            slots.append(int(tables[b, pos // block_size]) * block_size + pos % block_size)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim, generator=gen).to(cache_dtype)
    q = torch.randn(tokens, heads, dim, generator=gen)
    k, v = torch.randn(2, tokens, kv_heads, dim, generator=gen)
    positions = torch.tensor([p % 50 for p in range(tokens)])
    cos_sin = torch.randn(64, dim, generator=gen)
    outputs = []
    for ops in (CpuOps(), ReferenceOps()):
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        ctx = AttentionContext(torch.tensor(slots), tables, seq_lens, cu_seqlens_q, [])
        ctx = ops.prepare(AttentionContext(**{**ctx.__dict__, "kv_caches": [(k_cache, v_cache)]}))
        q_rot, k_rot = ops.rotary(positions, q, k, cos_sin)
        out = ops.attention(q_rot, k_rot, v, k_cache, v_cache, ctx, dim**-0.5)
        outputs.append((out, q_rot, k_rot, k_cache.float(), v_cache.float()))
    for got, want in zip(*outputs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
