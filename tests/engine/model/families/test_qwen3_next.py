"""Qwen3-Next (gated DeltaNet layers with a recurrent state per request in a scheduler-owned
slot, gated full attention, MoE with a shared expert) against transformers on a tiny random
checkpoint of Qwen3NextConfig (tests/moe_models.py): every position of a whole prompt and of a
prompt fed in chunks carrying the state, the scheduled script (chunked prefill, preemptions and
recompute, two requests of one prompt as n = 2 makes them, decode), the prefix cache off without
state snapshots and its hits restored from them with, what the family refuses."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from llmserve.common.families import family_refusal
from llmserve.common.model_config import ModelSourceError, load_model_config
from llmserve.common.step_plan import NewRequest, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.mirror import MirrorMismatch
from llmserve.engine.kv.state import StateBatch
from llmserve.engine.model.ops import AttentionContext
from llmserve.engine.parallel.ranks import run_group_locally
from llmserve.engine.step.engine import Engine
from llmserve.scheduler.request import Request
from tests.engine.model.families.test_families import TOLERANCE, Loaded, run_script
from tests.engine.model.test_model import BLOCK_SIZE, NUM_BLOCKS, prompt, rel_err, shuffled_blocks
from tests.factories import sampling
from tests.moe_models import make_tiny_moe

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Loaded:
    return Loaded(make_tiny_moe(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next", seed=2))


def forward_rows(
    engine: Engine, rows: list[tuple[list[int], int, int, list[int]]], slots: list[int] | None
) -> list[torch.Tensor]:
    """One forward of rows (token_ids, start, end, block_table), each row's state in the
    engine's pool at slots[i] (None: no pool, every row from zeros); each row's logits."""
    bs = BLOCK_SIZE
    input_ids, positions, kv_slots, cu, seq_lens = [], [], [], [0], []
    for token_ids, start, end, table in rows:
        input_ids += token_ids[start:end]
        positions += range(start, end)
        kv_slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
        cu.append(cu[-1] + end - start)
        seq_lens.append(end)
    width = max(len(t) for *_, t in rows)
    ctx = AttentionContext(
        slot_mapping=torch.tensor(kv_slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for *_, t in rows]),
        seq_lens=seq_lens,
        cu_seqlens_q=cu,
        kv_caches=engine.runner.kv_caches,
        state=None if slots is None else StateBatch(engine.state_pool, slots),
    )
    hidden = engine.model(torch.tensor(input_ids), torch.tensor(positions), ctx)
    logits = engine.model.compute_logits(hidden)
    return [logits[cu[i] : cu[i + 1]] for i in range(len(rows))]


def test_registry_reads_the_family_and_sizes_the_pools(model: Loaded) -> None:
    config = load_model_config(model.path)
    assert config.family == "qwen3_next" and config.partial_rotary_factor == 0.25
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert (config.num_state_layers, config.num_kv_layers) == (3, 1)
    assert config.state_layout is not None
    assert config.state_layout.conv_shape == (2 * 32 + 32, 3)  # q, k (2 x 16) and v (4 x 8)
    assert config.state_layout.recurrent_shape == (4, 16, 8)
    info, pool = model.engine.info, model.engine.state_pool
    assert pool is not None and info.num_state_slots == pool.num_slots == info.max_num_seqs
    assert tuple(pool.recurrent.shape) == (3, info.max_num_seqs, 4, 16, 8)
    # only the full-attention layer holds KV: 1 layer x K and V x 2 heads x 16 x 4 bytes
    assert info.kv_block_bytes == BLOCK_SIZE * 2 * 2 * 16 * 4
    assert config.moe is not None and config.moe.shared_intermediate_size == 48


def test_whole_prompt_and_chunks_carrying_the_state(model: Loaded) -> None:
    """Every position within 1e-4 of transformers': whole; in chunks of 7, 1 (a decode row:
    the recurrent form) and 20, each starting from the state the last one left in the slot,
    two requests sharing each step in slots 1 and 3."""
    engine = model.engine
    engine.reset()
    a, b = prompt(45, seed=1), prompt(38, seed=4)
    want_a, want_b = model.hf_logits(a), model.hf_logits(b)
    (whole,) = forward_rows(engine, [(a, 0, len(a), shuffled_blocks(11)[:6])], [0])
    assert rel_err(whole, want_a) < TOLERANCE
    blocks = shuffled_blocks(12)
    tables = blocks[:6], blocks[6:12]  # disjoint
    bounds = [0, 7, 8, 28, 45]
    got_a, got_b = [], []
    for s, e in itertools.pairwise(bounds):
        rows = [(a, s, e, tables[0]), (b, s, min(e, len(b)), tables[1])]
        la, lb = forward_rows(engine, rows, [1, 3])
        got_a.append(la)
        got_b.append(lb)
    assert rel_err(torch.cat(got_a), want_a) < TOLERANCE
    assert rel_err(torch.cat(got_b), want_b) < TOLERANCE


def test_the_state_matters(model: Loaded) -> None:
    """Chunks that start from zeros instead of the slot's state move the logits away."""
    engine = model.engine
    tokens, table = prompt(45, seed=1), shuffled_blocks(12)[:6]
    chunks = [
        forward_rows(engine, [(tokens, s, min(s + 9, 45), table)], None)[0] for s in range(0, 45, 9)
    ]
    assert rel_err(torch.cat(chunks), model.hf_logits(tokens)) > 1e-2


def script_requests() -> list[Request]:
    """Five greedy requests of 30-46 tokens sharing a 16-token prefix, two of one prompt (as
    n = 2 sends them), 6 tokens out each."""
    shared = prompt(16, seed=3)
    prompts = [shared + prompt(14 + 4 * i, seed=10 + i) for i in range(4)]
    prompts.insert(1, prompts[0])  # n = 2: the same prompt twice
    greedy = sampling(temperature=0.0)
    return [
        Request(f"r{i}", i + 1, p, greedy, 6, ignore_eos=True)  # type: ignore[arg-type]
        for i, p in enumerate(prompts)
    ]


def run_requests(engine: Engine, requests: list[Request]) -> Any:
    """The script: 40-token steps (chunked prefills) in 14 blocks of 8 (preemptions), the
    prefix cache asked for (and off)."""
    return run_script(engine, requests, 14, max_num_batched_tokens=40, enable_prefix_caching=True)


def check_rows(model: Loaded, requests: list[Request], rows: dict[int, Any]) -> None:
    """Every sampled row within 1e-4 of transformers' logits and its greedy token."""
    for request in requests:
        got = torch.stack([torch.as_tensor(r) for r in rows[request.seq_id]])
        start = len(request.prompt_token_ids) - 1
        want = model.hf_logits(request.token_ids[:-1])[start:]
        assert rel_err(got, want) < TOLERANCE, request.request_id
        assert got.argmax(-1).tolist() == request.token_ids[start + 1 :]
    assert requests[0].token_ids == requests[1].token_ids


def test_scheduled_script_matches_hf(model: Loaded) -> None:
    """script_requests through the real scheduler and contract (run_requests): chunked
    prefills, preemptions and recomputes, no prefix-cache hit (refused), each request in a slot
    of its own; check_rows."""
    engine = model.engine
    engine.reset()
    requests = script_requests()
    slots: dict[int, set[int]] = {}
    original = engine.mirror.apply

    def watch(plan: StepPlanData, *args: Any) -> Any:
        for new in plan.new_requests:
            slots.setdefault(new.seq_id, set()).add(new.state_slot)
        return original(plan, *args)

    engine.mirror.apply = watch  # type: ignore[method-assign]
    script = run_requests(engine, requests)
    sched = script.sched
    assert script.num_partial_prefills > 0 and sched.counters.num_preemptions > 0
    assert sched.counters.num_prefix_cache_hit_tokens == 0 and not sched.enable_prefix_caching
    assert sched.state_slots.num_free_slots == sched.state_slots.num_slots
    assert all(slots.values())
    assert set().union(*slots.values()) <= set(range(engine.info.max_num_seqs))
    check_rows(model, requests, script.rows)


def _script_on_rank(engine: Engine, parallel: Any) -> tuple[Any, ...]:
    """On each rank of a group: the script; (the requests' tokens, the driver's rows as lists
    (other ranks: none), the preemptions, the rank's state pool's recurrent shape)."""
    requests = script_requests()
    script = run_requests(engine, requests)
    rows = {k: [r.tolist() for r in v] for k, v in script.rows.items()}
    return (
        [r.token_ids for r in requests],
        rows if parallel.topology.is_driver else {},
        script.sched.counters.num_preemptions,
        tuple(engine.state_pool.recurrent.shape),
    )


def check_group_script(model: Loaded, num_kv_blocks: int = NUM_BLOCKS) -> list[tuple[int, ...]]:
    """The script on T = 2 x P = 2 (four gloo ranks): transformers' logits and greedy tokens on
    the driver, the same tokens on every rank, preemptions on; each rank's state pool shape
    without its slot count (sorted), for the caller to check its split."""
    config = EngineConfig(
        model=str(model.path), device="cpu", num_kv_blocks=num_kv_blocks, block_size=BLOCK_SIZE,
        tensor_parallel_size=2, pipeline_parallel_size=2, num_threads=1, seed=0,
    )  # fmt: skip
    ranks = run_group_locally(config, _script_on_rank, timeout=300)
    tokens = ranks[0][0]
    rows = next(rank[1] for rank in ranks if rank[1])  # the driver's
    assert ranks[0][2] > 0 and all(rank[0] == tokens for rank in ranks)
    assert all(rank[3][1] == config.max_num_seqs for rank in ranks)
    requests = script_requests()
    for request, ids in zip(requests, tokens, strict=True):
        request.token_ids = ids
    check_rows(model, requests, rows)
    return sorted((rank[3][0], *rank[3][2:]) for rank in ranks)


def test_tensor_and_pipeline_parallel_match_hf(model: Loaded) -> None:
    """T = 2 x P = 2, four gloo ranks (each rank 1 of the 2 DeltaNet key heads with its 2 value
    heads, its conv channels of q, k and v and its states; 2 of the 4 attention heads; 4 of the
    8 experts; stage 0 two DeltaNet layers, stage 1 the third and the attention layer, each with
    its own pools): the script gives transformers' logits and greedy tokens on the driver, the
    same tokens on every rank."""
    pools = check_group_script(model, num_kv_blocks=96)
    # 2 of the 4 value heads a rank; 2 state layers a stage, 1 at the last
    assert pools == [(1, 2, 16, 8)] * 2 + [(2, 2, 16, 8)] * 2


def test_a_prefix_cache_hit_is_refused_by_the_mirror(model: Loaded) -> None:
    """A new request that says some of its tokens are computed (a prefix-cache hit) fails the
    step, naming the reason: its state could not be restored."""
    engine = model.engine
    engine.reset()
    new = NewRequest(1, prompt(20, seed=1), 20, sampling(), [0, 1, 2], 8, 12, state_slot=0)
    with pytest.raises(MirrorMismatch, match="a request with a recurrent state computes from"):
        engine.step(StepPlanData(1, [], [new]))


def test_what_the_family_refuses(model: Loaded) -> None:
    """Speculative decoding (the state would need rolling back) and quantization at start by
    name; a prefill or decode engine role (a KV transfer carries no state); a LoRA adapter when
    loaded. CUDA graphs are off, the reason in the start line (graph_capture.uses_graphs)."""
    for feature, words in [
        ("speculative_decoding", "rejected proposal"),
        ("quantization", "routed experts"),
    ]:
        why = family_refusal("qwen3_next", [feature])
        assert why is not None and "Qwen3NextForCausalLM" in why and words in why, feature
    with pytest.raises(ModelSourceError, match=r"engine_role=prefill: .* recurrent state"):
        Engine(EngineConfig(model=str(model.path), device="cpu", engine_role="prefill"))
    from llmserve.engine.step.graph_capture import uses_graphs

    kernels = SimpleNamespace(graph_safe=True, name="cuda")
    gpu_model = SimpleNamespace(ops=kernels, config=model.engine.model.config)
    using, why = uses_graphs(EngineConfig(), torch.device("cuda"), gpu_model, None)  # type: ignore[arg-type]
    assert not using and why.startswith("state layers")
    lora = r"qwen3_next \(Qwen3NextForCausalLM\) does not support lora"
    with pytest.raises(ValueError, match=lora):
        model.engine.adapters.add("a", "/nonexistent")


def test_the_state_pool_comes_out_of_the_kv_budget(model: Loaded) -> None:
    """Without --num-kv-blocks, max_num_seqs slots of 3 layers x (96 x 3 + 4 x 16 x 8) float32
    values (9,600 bytes) take ceil(4 x 9,600 / 2,048) = 19 of the budget's KV blocks (8 tokens x
    256 bytes); a budget they would empty is refused, naming the slots."""
    engine = model.engine
    saved = engine.config, engine.num_blocks
    try:
        engine.config = dataclasses.replace(engine.config, num_kv_blocks=0, max_num_seqs=4)
        engine.num_blocks = 100
        pool = engine._allocate_state_pool()
        assert pool is not None and pool.num_slots == 4 and engine.num_blocks == 100 - 19
        assert pool.nbytes == 4 * 9600
        engine.num_blocks = 19
        with pytest.raises(RuntimeError, match=r"state pool \(4 slots x 9600 bytes\) leaves no"):
            engine._allocate_state_pool()
    finally:
        engine.config, engine.num_blocks = saved


@torch.inference_mode()
def test_decode_rows_through_the_delta_kernel_on_the_emulator(model: Loaded) -> None:
    """The GPU path (StateKernelOps: kernels/gated_delta.cu for the DeltaNet layers' decode
    rows, on the kernel emulator) beside the CPU's torch ops, both bf16: a prefill of two
    requests (20 and 7 tokens, slots 3 and 1), then 3 decode steps of both. Hidden states and
    the fp32 recurrent pool within 1% (relative L2; 0.0 measured on the emulator); one launch
    per DeltaNet layer per decode step, none in the prefill (chunks stay on the torch chunked
    form). And the ops pass select_ops's self-check at this model's widths."""
    from llmserve.engine.kv.cache import allocate_kv_cache, layer_views
    from llmserve.engine.kv.state import StatePool
    from llmserve.engine.model.ops import ReferenceOps, StateKernelOps, self_check
    from llmserve.engine.model.weights import build_model, load_weights
    from tests.kernel_emu import emu

    config = load_model_config(model.path)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    net = build_model(config, load_weights(model.path, config), 256, bf16, cpu)
    prompts, tables, slots = [prompt(20, seed=5), prompt(7, seed=6)], [[4, 1, 6], [2, 7, 0]], [3, 1]
    results = {}
    with emu.installed_or_skip() as emulator:
        for ops in (ReferenceOps(), StateKernelOps()):
            net.set_ops(ops)
            kv = layer_views(allocate_kv_cache(config, 8, BLOCK_SIZE, bf16, cpu))
            pool = StatePool(config, 4, bf16, cpu)
            tokens = [list(p) for p in prompts]
            hidden, launches = [], []
            for step in range(4):
                starts = [0, 0] if step == 0 else [len(t) - 1 for t in tokens]
                ctx = _context(kv, pool, tokens, starts, tables, slots)
                emulator.launches.clear()
                ids = torch.tensor([x for t, s in zip(tokens, starts, strict=True) for x in t[s:]])
                pos = torch.tensor(
                    [p for t, s in zip(tokens, starts, strict=True) for p in range(s, len(t))]
                )
                hidden.append(net(ids, pos, ctx))
                launches.append(len(emulator.launches))
                for t in tokens:
                    t.append((t[-1] * 7 + step) % config.vocab_size)
            results[ops.name] = hidden, pool.recurrent.clone(), launches
        assert self_check(StateKernelOps(), config, bf16, cpu, BLOCK_SIZE) is None
    net.set_ops(ReferenceOps())
    (want, want_pool, none), (got, got_pool, launched) = results.values()
    assert none == [0, 0, 0, 0] and launched == [0, 3, 3, 3]  # 3 DeltaNet layers
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert rel_err(g.float(), w.float()) < 1e-2, step
    assert rel_err(got_pool, want_pool) < 1e-2


def _context(
    kv: list, pool: Any, tokens: list[list[int]], starts: list[int], tables: list[list[int]],
    slots: list[int],
) -> AttentionContext:  # fmt: skip
    """A step of each request's tokens from starts[i] on, its KV at tables[i], its state in
    slot slots[i]."""
    kv_slots, cu, seq_lens = [], [0], []
    for t, s, table in zip(tokens, starts, tables, strict=True):
        kv_slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(s, len(t))]
        cu.append(cu[-1] + len(t) - s)
        seq_lens.append(len(t))
    return AttentionContext(
        slot_mapping=torch.tensor(kv_slots), block_tables=torch.tensor(tables),
        seq_lens=seq_lens, cu_seqlens_q=cu, kv_caches=kv, state=StateBatch(pool, slots),
    )  # fmt: skip


def test_from_a_gguf_as_llama_cpps_converter_writes_it(model: Loaded, tmp_path: Path) -> None:
    """The tiny model written as llama.cpp's converter writes `qwen3next` (tests/qwen3_next_gguf:
    in_proj_qkvz split, A_log as -exp, norms as 1 + w, ...): the same shape read back, and
    every position of a prompt, prefilled whole then one decode row from its slot, within 1e-4
    of transformers' logits, its greedy token at each."""
    from tests.qwen3_next_gguf import write_qwen3_next_gguf

    path = write_qwen3_next_gguf(model.path, tmp_path / "qwen3_next.gguf")
    hf_config, config = load_model_config(model.path), load_model_config(path)
    for field in ("family", "layer_types", "gated_delta_net", "moe", "partial_rotary_factor"):
        assert getattr(config, field) == getattr(hf_config, field), field
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=96,
                                 block_size=BLOCK_SIZE))  # fmt: skip
    tokens, table = prompt(30, seed=7), shuffled_blocks(5)[:4]
    want = model.hf_logits(tokens)
    (head,) = forward_rows(engine, [(tokens, 0, 29, table)], [2])
    (last,) = forward_rows(engine, [(tokens, 29, 30, table)], [2])
    got = torch.cat((head, last))
    assert rel_err(got, want) < TOLERANCE
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()


def test_prefix_cache_hits_restore_a_state_snapshot(model: Loaded) -> None:
    """check_snapshot_hits on Qwen3-Next's DeltaNet layers."""
    check_snapshot_hits(model.path, model.hf_logits)


def check_snapshot_hits(path: Path, hf_logits: Any) -> None:
    """--state-snapshot-slots: a request computes its 45-token prompt in a chunk cut at its
    last full block (40) and the engine snapshots its state there; two later requests (a longer
    prompt sharing 44 tokens, and the same prompt, as a retry sends it) hit 40 tokens each,
    restored from that snapshot, and their logits (within 1e-4) and greedy tokens equal
    transformers' (hf_logits: token ids -> every position's logits)."""
    engine = Engine(
        EngineConfig(model=str(path), device="cpu", num_kv_blocks=96, block_size=BLOCK_SIZE,
                     max_num_seqs=2, state_snapshot_slots=2)
    )  # fmt: skip
    assert engine.info.num_state_snapshot_slots == 2
    assert engine.state_pool is not None and engine.state_pool.conv.shape[1] == 4
    first = prompt(45, seed=5)
    prompts = [first, first[:44] + prompt(10, seed=6), first]
    greedy = sampling(temperature=0.0)
    requests = [
        Request(f"r{i}", i + 1, p, greedy, 4, ignore_eos=True)  # type: ignore[arg-type]
        for i, p in enumerate(prompts)
    ]
    restores: dict[int, tuple[int, int]] = {}
    original = engine.mirror.apply

    def watch(plan: StepPlanData, *args: Any) -> Any:
        for new in plan.new_requests:
            restores[new.seq_id] = (new.num_computed_tokens, new.state_restore_from)
        return original(plan, *args)

    engine.mirror.apply = watch  # type: ignore[method-assign]
    # one request at a time, so each later one finds the snapshot its predecessor took
    script = run_script(engine, requests, 40, max_num_batched_tokens=64, max_num_seqs=1)
    sched = script.sched
    assert sched.enable_prefix_caching
    assert restores == {1: (0, 0), 2: (40, 2), 3: (40, 2)}
    assert sched.counters.num_prefix_cache_hit_tokens == 80
    assert sched.state_slots.snapshots.num_hits == 2
    for request in requests:
        got = torch.stack([torch.as_tensor(r) for r in script.rows[request.seq_id]])
        start = len(request.prompt_token_ids) - 1
        want = hf_logits(request.token_ids[:-1])[start:]
        assert rel_err(got, want) < TOLERANCE, request.request_id
        assert got.argmax(-1).tolist() == request.token_ids[start + 1 :]
