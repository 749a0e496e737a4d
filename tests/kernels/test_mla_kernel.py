"""kernels/mla_decode.cu through kernels/mla.py on the CPU emulator (tests/kernel_emu), against
kernels/reference.py's mla_decode_attention in float64, which is itself checked against the CPU
engine's path for MLA (reference.paged_attention with the latent as one kv head for both key and
value, first kv_lora_rank values kept: engine/model/families/deepseek.py). Pools are NaN-filled
outside the sequences' slots (tests/kernel_checks.make_pool). Skips without g++ or off Linux, as
tests/kernels/test_kernels_emulated.py does."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from llmserve.kernels import reference as ref
from tests.kernel_checks import assert_close, make_pool
from tests.kernel_emu import emu

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def emulator() -> Iterator[emu.Emulator]:
    with emu.installed_or_skip() as emulator:
        yield emulator


@pytest.fixture
def kc(emulator: emu.Emulator) -> Iterator[ModuleType]:
    import llmserve.kernels.cuda as kcuda

    torch.manual_seed(40)
    emulator.launches.clear()
    yield kcuda


def latent_case(
    seq_lens: list[int], block_size: int, heads: int, rank: int, rope: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [seqs, heads, rank + rope], latent pool [blocks, block_size, 1, rank + rope] NaN
    outside the sequences' slots, int32 block tables)."""
    latent, _, tables = make_pool(seq_lens, block_size, 1, rank + rope, dtype)
    q = torch.randn(len(seq_lens), heads, rank + rope).to(dtype)
    return q, latent, tables


def test_reference_is_the_engine_path() -> None:
    """mla_decode_attention == paged_attention over the latent as K and V, first rank kept."""
    torch.manual_seed(41)
    seq_lens, rank = [3, 11, 1], 16
    q, latent, tables = latent_case(seq_lens, 4, 5, rank, 8, torch.float32)
    scale = 0.3
    got = ref.mla_decode_attention(q, latent, tables, seq_lens, rank, scale)
    clean = torch.nan_to_num(latent, nan=0.0)
    engine = ref.paged_attention(q, clean, clean, tables.long(), seq_lens, [0, 1, 2, 3], scale)
    torch.testing.assert_close(got, engine[..., :rank], rtol=1e-5, atol=1e-5)


# (seq_lens, block_size, heads, rank, rope): an empty sequence, one token, partial tiles, a
# block size that is not a power of two, two head groups of 16 (the second partial), and the
# three output widths the module is built for (rank <= 128, 256, 512).
CASES = [
    ([0, 1, 17, 40], 5, 20, 24, 8),
    ([33, 2], 16, 3, 136, 16),
    ([19], 3, 2, 264, 8),
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("seq_lens", "block_size", "heads", "rank", "rope"), CASES)
def test_mla_decode_matches_reference(
    kc: ModuleType,
    dtype: torch.dtype,
    seq_lens: list[int],
    block_size: int,
    heads: int,
    rank: int,
    rope: int,
) -> None:
    q, latent, tables = latent_case(seq_lens, block_size, heads, rank, rope, dtype)
    scale = (rank + rope) ** -0.5
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = kc.mla_decode_attention(q, latent, tables, lens, rank, scale)
    expect = ref.mla_decode_attention(q.double(), latent.double(), tables, seq_lens, rank, scale)
    assert_close(out, expect, dtype, f"mla decode {seq_lens} bs {block_size} rank {rank}")
    assert (out[[i for i, n in enumerate(seq_lens) if n == 0]] == 0).all()


def test_mla_decode_rejects_bad_arguments(kc: ModuleType) -> None:
    q, latent, tables = latent_case([4], 4, 2, 16, 8, torch.float16)
    lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_lora_rank=24"):
        kc.mla_decode_attention(q, latent, tables, lens, 24, 1.0)
    with pytest.raises(ValueError, match=r"latent_cache\.shape"):
        kc.mla_decode_attention(q, latent[:, :, :, :16], tables, lens, 16, 1.0)
    with pytest.raises(ValueError, match=r"seq_lens\.dtype"):
        kc.mla_decode_attention(q, latent, tables, lens.long(), 16, 1.0)
    big = torch.zeros(1, 2, 600, dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_lora_rank=520 exceeds 512"):
        kc.mla_decode_attention(big, torch.zeros(2, 4, 1, 600, dtype=torch.float16), tables,
                                lens, 520, 1.0)  # fmt: skip


@torch.inference_mode()
@pytest.mark.parametrize("mixed", [False, True])
def test_kernel_ops_latent_attention_matches_the_torch_ops(
    kc: ModuleType, emulator: emu.Emulator, mixed: bool
) -> None:
    """engine KernelOps.latent_attention (store_kv of the latents, then the MLA kernel on a
    decode-only step; a step with a prefill chunk through the torch reference) against
    ReferenceOps' (the CPU engine's path): outputs and the written pool alike."""
    from llmserve.engine.model.attention_context import AttentionContext
    from llmserve.engine.model.ops import KernelOps, ReferenceOps

    rank, rope, heads, block_size, dtype = 24, 8, 3, 4, torch.bfloat16
    seq_lens = [9, 6] if not mixed else [9, 3]
    new = [1, 1] if not mixed else [1, 3]  # the second request's whole 3-token prompt
    pool, _, tables = make_pool(seq_lens, block_size, 1, rank + rope, dtype)
    pool = torch.nan_to_num(pool, nan=0.0)  # the reference's padded decode reads unowned slots
    slots = [
        int(tables[b, p // block_size]) * block_size + p % block_size
        for b, n in enumerate(seq_lens)
        for p in range(n - new[b], n)
    ]
    q = torch.randn(sum(new), heads, rank + rope).to(dtype)
    latent = torch.randn(sum(new), 1, rank + rope).to(dtype)
    cu = [0, new[0], new[0] + new[1]]
    out, pools = {}, {}
    for name, ops in (("torch", ReferenceOps()), ("cuda", KernelOps())):
        pools[name] = pool.clone()
        ctx = AttentionContext(torch.tensor(slots), tables, seq_lens, cu, [])
        ctx = ops.prepare(ctx)
        out[name] = ops.latent_attention(q, latent, pools[name], ctx, 0.2, rank)
    assert out["cuda"].shape == (sum(new), heads, rank)
    mla_launches = [x for x in emulator.launches if x.expr.startswith("mla_decode_kernel")]
    assert len(mla_launches) == (0 if mixed else 1)
    assert torch.equal(pools["cuda"], pools["torch"])
    assert_close(out["cuda"], out["torch"].double(), dtype, f"latent_attention mixed={mixed}")


@torch.inference_mode()
def test_a_deepseek_model_through_the_kernels_matches_the_torch_ops(
    emulator: emu.Emulator, tmp_path: Path
) -> None:
    """A tiny DeepSeek-V3 (tests/moe_models.py: q latent, interleaved rotary, yarn; rope 16 for
    the rotary kernel) through KernelOps: a ragged prefill (20 and 7 tokens), then a decode step
    of both, hidden states and the latent pool within 2% of ReferenceOps' (bf16 both), the
    decode through kernels/mla_decode.cu. The engine's start-up checks take the model: no
    kernel_limits reason, and self_check (latent_attention on a mixed and a decode-only step)
    passes."""
    from llmserve.common.model_config import load_model_config
    from llmserve.engine.kv.cache import allocate_kv_cache
    from llmserve.engine.model.ops import KernelOps, ReferenceOps, kernel_limits, self_check
    from llmserve.engine.model.weights import build_model
    from tests.engine.test_gpu_plumbing import BLOCK_SIZE, context, rel_err
    from tests.moe_models import make_tiny_moe

    path = make_tiny_moe(tmp_path, "deepseek_v3", seed=3, qk_rope_head_dim=16, hidden_size=64)
    config = load_model_config(path)
    assert kernel_limits(config, torch.bfloat16, BLOCK_SIZE) is None
    assert self_check(KernelOps(), config, torch.bfloat16, torch.device("cpu"), BLOCK_SIZE) is None
    cpu = torch.device("cpu")
    model = build_model(config, None, 256, torch.bfloat16, cpu, dummy_seed=3)
    pools = {n: allocate_kv_cache(config, 8, BLOCK_SIZE, torch.bfloat16, cpu) for n in "tc"}
    tables = [[5, 2], [7, 0]]
    prompts = [[(i * 31 + 7) % config.vocab_size for i in range(n)] for n in (20, 7)]
    steps = [
        ([*prompts[0], *prompts[1]], [*range(20), *range(7)], [(0, 20), (0, 7)]),
        ([11, 12], [20, 7], [(20, 21), (7, 8)]),
    ]
    for input_ids, positions, rows in steps:
        emulator.launches.clear()
        out = {}
        for name, ops in (("t", ReferenceOps()), ("c", KernelOps())):
            model.set_ops(ops)
            ctx = context(pools[name], rows, tables)
            out[name] = model(torch.tensor(input_ids), torch.tensor(positions), ctx)
        assert rel_err(out["c"], out["t"]) < 2e-2, rows
    assert any(x.expr.startswith("mla_decode_kernel") for x in emulator.launches)
    assert rel_err(pools["c"], pools["t"]) < 2e-2


@torch.inference_mode()
def test_self_check_catches_a_wrong_mla_kernel(
    kc: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode kernel that returns zeros fails the engine's start-up check, naming the case."""
    from llmserve.common.mla_config import MLAConfig
    from llmserve.engine.model.ops import KernelOps, self_check
    from tests.engine.test_gpu_plumbing import tiny_config

    mla = MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    config = dataclasses.replace(tiny_config(), family="deepseek_v3", head_dim=16, mla=mla)
    cpu = torch.device("cpu")
    assert self_check(KernelOps(), config, torch.bfloat16, cpu, 16) is None
    monkeypatch.setattr(kc, "mla_decode_attention", lambda q, *a, **k: q[..., :32] * 0)
    why = self_check(KernelOps(), config, torch.bfloat16, cpu, 16)
    assert why is not None and "latent_attention (decode)" in why
