"""kernels/lora.cu through kernels/lora.py on the CPU emulator (tests/kernel_emu), against
kernels/lora_reference.py (the CPU engine's path) and float64, under the emulated kernels' rules
(tests/kernel_checks): per-row relative error <= 1e-2 (bf16) or 5e-3 (fp16); rows without an
adapter left bit for bit. Skips without g++ or off Linux, as tests/kernels/test_kernels_emulated.py
does."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from llmserve.engine.features.lora import LoraSlots, kernel_self_check
from llmserve.engine.features.lora_files import LoraAdapter, module_shapes
from llmserve.engine.kv.cache import allocate_kv_cache
from llmserve.engine.model.ops import KernelOps, ReferenceOps
from llmserve.engine.model.weights import build_model
from llmserve.engine.parallel.groups import whole_model
from llmserve.kernels import lora_reference as lora_ref
from tests.engine.test_gpu_plumbing import CPU, context, rel_err, tiny_config
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

    torch.manual_seed(28)
    emulator.launches.clear()
    yield kcuda


def tables(
    ranks: list[int], max_rank: int, in_features: int, widths: list[int], dtype: torch.dtype
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Slot tables as engine/features/lora.py holds them: slot i of rank ranks[i], zero past it."""
    a = torch.randn(len(ranks), max_rank, len(widths), in_features) * in_features**-0.5
    b = [torch.randn(len(ranks), max_rank, w) for w in widths]
    for slot, rank in enumerate(ranks):
        a[slot, rank:] = 0
        for bp in b:
            bp[slot, rank:] = 0
    return a.to(dtype), [bp.to(dtype) for bp in b]


def float64_update(
    x: torch.Tensor, slot_ids: list[int], a: torch.Tensor, b: list[torch.Tensor]
) -> torch.Tensor:
    """Row by row, part by part, in float64: B_s (A_s x[t]) (zero for a row without a slot)."""
    out = torch.zeros(x.shape[0], sum(bp.shape[2] for bp in b), dtype=torch.float64)
    for t, s in enumerate(slot_ids):
        if 0 <= s < a.shape[0]:
            parts = [
                bp[s].double().t() @ (a[s, :, p].double() @ x[t].double()) for p, bp in enumerate(b)
            ]
            out[t] = torch.cat(parts)
    return out


# in 264: 33 chunks of 8, so lane 0 of each shrink warp loops twice; part widths 1040, 16, 24:
# the first needs two expand CTAs (1024 columns each), the others leave most threads idle.
# Slots of rank 4, 8 and 16 in a max-rank-16 table; rows: the base (-1), an id past the slots
# (also no adapter), and the three slots interleaved, as a step's rows come.
IN, WIDTHS, RANKS, MAX_RANK = 264, [1040, 16, 24], [4, 8, 16], 16
SLOT_IDS = [2, -1, 0, 1, 1, 2, 3, 0, -1, 2]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_lora_add_mixed_batch(
    kc: ModuleType, emulator: emu.Emulator, dtype: torch.dtype, index_dtype: torch.dtype
) -> None:
    a, b = tables(RANKS, MAX_RANK, IN, WIDTHS, dtype)
    x = torch.randn(len(SLOT_IDS), IN).to(dtype)
    base = (torch.randn(len(SLOT_IDS), sum(WIDTHS)) * 0.1).to(dtype)
    ids = torch.tensor(SLOT_IDS, dtype=index_dtype)
    expect = lora_ref.lora_add(x, base.clone(), ids, a, b, MAX_RANK)
    got = kc.lora_add(x, base.clone(), ids, a, b, MAX_RANK)
    ctype, itype = kc._CTYPES[dtype], kc._INDEX_CTYPES[index_dtype]
    grids = [(launch.expr, launch.grid) for launch in emulator.launches]
    assert grids == [
        (f"lora_shrink_kernel<{ctype}, {itype}>", (len(SLOT_IDS), 3 * MAX_RANK // 4, 1)),
        (f"lora_expand_kernel<{ctype}, {itype}>", (len(SLOT_IDS), 2, 3)),
    ]
    adapted = [t for t, s in enumerate(SLOT_IDS) if 0 <= s < len(RANKS)]
    untouched = [t for t in range(len(SLOT_IDS)) if t not in adapted]
    assert torch.equal(got[untouched], base[untouched]), "rows without an adapter must not move"
    assert_close(got[adapted], expect[adapted], dtype, "lora_add vs reference")
    want = base.double() + float64_update(x, SLOT_IDS, a, b)
    assert_close(got[adapted], want[adapted], dtype, "lora_add vs float64")
    assert (got[adapted] - base[adapted]).float().norm() > 10 * base[adapted].float().norm()


def test_lora_add_uses_the_steps_rank(kc: ModuleType) -> None:
    """rank below the table's max_rank: only the first rank rows of A and B are read (slots of
    rank 4 and 8 give the same result at rank 8 as at 16), one part, fp16, a strided x."""
    a, b = tables([4, 8], MAX_RANK, 64, [32], torch.float16)
    wide = torch.randn(6, 72).half()
    x = wide[:, :64]  # row stride 72: a multiple of 8, not the row's length
    ids = torch.tensor([1, 0, -1, 1, 0, 0], dtype=torch.int32)
    at8 = kc.lora_add(x, torch.zeros(6, 32).half(), ids, a, b, 8)
    at16 = kc.lora_add(x, torch.zeros(6, 32).half(), ids, a, b, 16)
    assert torch.equal(at8, at16)
    expect = lora_ref.lora_add(x, torch.zeros(6, 32).half(), ids, a, b, 8)
    assert_close(at8[[0, 1, 3, 4, 5]], expect[[0, 1, 3, 4, 5]], torch.float16, "rank 8")
    assert not at8[2].any()


def test_lora_add_checks(kc: ModuleType) -> None:
    a, b = tables([4], 4, 16, [8, 8], torch.float16)
    x, out = torch.randn(3, 16).half(), torch.zeros(3, 16).half()
    ids = torch.zeros(3, dtype=torch.int64)
    assert kc.lora_add(x, out, ids, a, b, 4).shape == (3, 16)
    with pytest.raises(ValueError, match=r"out.shape\[1\]=8 must be the parts' widths' sum 16"):
        kc.lora_add(x, out[:, :8], ids, a, b, 4)
    with pytest.raises(ValueError, match=r"rank=5 must be in 1..4"):
        kc.lora_add(x, out, ids, a, b, 5)
    with pytest.raises(ValueError, match=r"slot_ids.dtype=torch.float32"):
        kc.lora_add(x, out, ids.float(), a, b, 4)
    with pytest.raises(ValueError, match=r"a.shape\[2\]=2 must be 1"):
        kc.lora_add(x, out[:, :8], ids, a, b[:1], 4)
    with pytest.raises(ValueError, match=r"b\[1\].dtype=torch.bfloat16"):
        kc.lora_add(x, out, ids, a, [b[0], b[1].bfloat16()], 4)
    with pytest.raises(ValueError, match=r"in=12 and every out_p \[8, 8\] must be multiples of 8"):
        kc.lora_add(x[:, :12], out, ids, a[..., :12].contiguous(), b, 4)
    assert kc.lora_add(x[:0], out[:0], ids[:0], a, b, 4).shape == (0, 16)


def random_adapter(name: str, rank: int, modules: tuple[str, ...], seed: int) -> LoraAdapter:
    """A checked adapter as engine/features/lora_files.py makes one, random A and B, every layer."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(TINY.num_layers):
        for module in modules:
            out_features, in_features = module_shapes(TINY)[module]
            a = torch.randn(rank, in_features, generator=gen) * in_features**-0.5
            weights[(layer, module)] = (a, torch.randn(out_features, rank, generator=gen) * 0.3)
    return LoraAdapter(name, name, rank, 1.0, modules, weights)


TINY = tiny_config()
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.inference_mode()
def test_model_with_adapters_through_the_kernels(emulator: emu.Emulator) -> None:
    """A tiny model's forward with adapters of ranks 4, 8 and 16 (all projections; q and v
    only) and base rows, through engine.ops.KernelOps (kernels/lora.cu on the decode step)
    against ReferenceOps (the torch products): a chunked prefill step, then a decode step of
    the four requests, hidden states within 2% (bf16) and the adapters' effect well above it."""
    model = build_model(TINY, None, 256, torch.bfloat16, CPU, dummy_seed=3)
    shard = whole_model(TINY.num_layers)
    slots = LoraSlots(TINY, shard, 3, 16, torch.bfloat16, CPU)
    slots.place(1, random_adapter("r4", 4, ALL, 1))
    slots.place(2, random_adapter("r8-qv", 8, ("q_proj", "v_proj"), 2))
    slots.place(3, random_adapter("r16", 16, ALL, 3))
    row_slots, tables = [2, 0, 3, 1], [[5, 2], [7, 0], [1, 3], [4, 6]]
    lengths = [9, 4, 6, 3]
    prompts = [[(i * 31 + 7 * r) % 259 for i in range(n)] for r, n in enumerate(lengths)]
    steps = [
        ([t for p in prompts for t in p], [i for n in lengths for i in range(n)],
         [(0, n) for n in lengths]),
        ([11, 12, 13, 14], lengths, [(n, n + 1) for n in lengths]),
    ]  # fmt: skip
    pools = {
        name: allocate_kv_cache(TINY, 8, 16, torch.bfloat16, CPU)
        for name in ("torch", "cuda", "base")
    }
    kernel_steps = []
    try:
        for input_ids, positions, rows in steps:
            out = {}
            for name, ops in (("torch", ReferenceOps()), ("cuda", KernelOps()), ("base", None)):
                model.set_ops(ops or ReferenceOps())
                ctx = context(pools[name], rows, tables)
                counts = [end - start for start, end in rows]
                ctx.lora = slots.batch(row_slots, counts) if ops is not None else None
                emulator.launches.clear()
                out[name] = model(torch.tensor(input_ids), torch.tensor(positions), ctx)
                if name == "cuda":
                    used = {launch.expr.split("<")[0] for launch in emulator.launches}
                    assert ("lora_shrink_kernel" in used) == ctx.lora.padded, rows
                    kernel_steps.append(ctx.lora.padded)
            assert rel_err(out["cuda"], out["torch"]) < 2e-2, rows
            assert rel_err(out["base"], out["torch"]) > 0.1, "the adapters must change the output"
        assert kernel_steps[-1], "the decode step runs the kernels"
    finally:
        model.set_ops(ReferenceOps())


def test_engine_start_up_check(emulator: emu.Emulator) -> None:
    """engine.lora.kernel_self_check: the kernels pass; one that adds nothing is caught."""
    import llmserve.kernels.cuda as kcuda

    assert kernel_self_check(kcuda.lora_add, torch.bfloat16, CPU) is None

    def adds_nothing(x: torch.Tensor, out: torch.Tensor, *args: object) -> torch.Tensor:
        return out

    why = kernel_self_check(adds_nothing, torch.bfloat16, CPU)
    assert why is not None and why.startswith("lora self-check: kernels.cuda.lora_add differs")
