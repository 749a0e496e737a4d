"""Batched LoRA in the engine, in-process: PEFT adapters made here (random A and B, ranks 4, 8
and 16, different target modules, one rsLoRA) on a tiny random Llama; greedy tokens against
transformers + peft in float32; a batch mixing the base and three adapters (chunked prefill)
gives each request its tokens alone; the segmented products' two layouts against a per-token
reference; adapters refused at load by name and reason; the host cache's LRU."""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from llmserve.common.step_plan import LoraLoad, NewRequest, RunningColumns, StepPlanData
from llmserve.engine.config import EngineConfig
from llmserve.engine.contract.convert import plan_from_proto
from llmserve.engine.features.lora import LoraBatch
from llmserve.engine.features.lora_files import LoraError
from llmserve.engine.step.engine import Engine
from llmserve.kernels.lora_reference import lora_padded, lora_segments
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto
from tests.factories import TINY_VOCAB, make_lora_adapter, make_tiny_llama, sampling

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK_SIZE = 8
GREEDY = sampling(temperature=0.0)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "r4-qv": {"rank": 4, "target_modules": ["q_proj", "v_proj"], "seed": 1},
    "r8-all-rslora": {"rank": 8, "target_modules": ALL, "seed": 2, "use_rslora": True},
    "r16-kogud": {
        "rank": 16,
        "target_modules": ["k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "seed": 3,
        "alpha": 8,
    },
}
PROMPTS = [[(7 * i + 3 * j) % (TINY_VOCAB - 3) + 3 for j in range(6 + 9 * i)] for i in range(4)]
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def base(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("loras")
    return {name: make_lora_adapter(base, root / name, **spec) for name, spec in ADAPTERS.items()}


@pytest.fixture(scope="module")
def engine(base: Path, adapters: dict[str, Path]) -> Engine:
    config = EngineConfig(
        model=str(base), device="cpu", num_kv_blocks=64, block_size=BLOCK_SIZE,
        max_loras=3, max_lora_rank=16, max_cpu_loras=3,
    )  # fmt: skip
    engine = Engine(config)
    for name, path in adapters.items():
        engine.add_lora(name, str(path))
    return engine


class PeftReference:
    """transformers + peft in float32 with every adapter loaded once: greedy tokens under one
    adapter (or the base: None), recomputing the whole sequence for each token."""

    def __init__(self, base: Path, adapters: dict[str, Path]):
        from peft import PeftModel
        from transformers import LlamaForCausalLM

        model: Any = LlamaForCausalLM.from_pretrained(base, dtype=torch.float32)
        names = list(adapters)
        model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(adapters[name], adapter_name=name)
        self.model = model.eval()

    @torch.no_grad()
    def greedy(self, adapter: str | None, prompt: list[int]) -> list[int]:
        tokens = list(prompt)
        context: Any = contextlib.nullcontext()
        if adapter is None:
            context = self.model.disable_adapter()
        else:
            self.model.set_adapter(adapter)
        with context:
            for _ in range(NUM_TOKENS):
                logits = self.model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
        return tokens[len(prompt) :]


class GreedyDriver:
    """Plays the scheduler for a fixed set of requests (prompt, lora slot): every block up
    front, prefill in chunks of `chunk` tokens, then one token per step until NUM_TOKENS."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.step_id = 0

    def run(
        self,
        requests: list[tuple[list[int], int]],
        loads: list[LoraLoad] | None = None,
        chunk: int = 1000,
    ) -> tuple[list[list[int]], list[str]]:
        """Each request's first NUM_TOKENS generated tokens (all run until the last has its),
        and the refusal reasons of the steps."""
        self.engine.reset()
        self.step_id = 0
        n = len(requests)
        per_seq = -(-(max(len(p) for p, _ in requests) + NUM_TOKENS) // BLOCK_SIZE)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
        tokens = [list(p) for p, _ in requests]
        computed = [0] * n
        outputs: list[list[int]] = [[] for _ in range(n)]
        reasons: list[str] = []
        while any(len(o) < NUM_TOKENS for o in outputs) and len(reasons) == 0:
            scheduled = [min(chunk, len(t) - c) for t, c in zip(tokens, computed, strict=True)]
            plan = self._plan(requests, tokens, tables, computed, scheduled, loads or [])
            out = self.engine.step(plan)
            reasons += out.refusal_reasons
            for i, token in enumerate(out.sampled_token_ids):
                computed[i] += scheduled[i]
                if token >= 0:
                    tokens[i].append(token)
                    outputs[i].append(token)
        return [o[:NUM_TOKENS] for o in outputs], reasons

    def _plan(
        self,
        requests: list[tuple[list[int], int]],
        tokens: list[list[int]],
        tables: list[list[int]],
        computed: list[int],
        scheduled: list[int],
        loads: list[LoraLoad],
    ) -> StepPlanData:
        self.step_id += 1
        slots = [slot for _, slot in requests]
        if self.step_id == 1:
            new = [
                NewRequest(i + 1, tokens[i], len(tokens[i]), GREEDY, tables[i], 0, s, slot)
                for i, (s, slot) in enumerate(zip(scheduled, slots, strict=True))
            ]
            return StepPlanData(1, [], new, lora_loads=loads)
        n = len(requests)
        running = RunningColumns(
            seq_ids=list(range(1, n + 1)),
            num_scheduled_tokens=scheduled,
            num_computed_tokens=list(computed),
            num_new_blocks=[0] * n,
            new_block_ids=[],
            lora_slot=slots if any(slots) else [],
        )
        return StepPlanData(self.step_id, [], [], running)


@pytest.fixture(scope="module")
def expected(base: Path, adapters: dict[str, Path]) -> dict[str | None, list[int]]:
    """transformers + peft's greedy tokens: the base for PROMPTS[0], adapter k for PROMPTS[k+1]."""
    reference = PeftReference(base, adapters)
    result = {None: reference.greedy(None, PROMPTS[0])}
    for k, name in enumerate(adapters):
        result[name] = reference.greedy(name, PROMPTS[k + 1])
    return result


def loads_for(adapters: dict[str, Path]) -> list[LoraLoad]:
    return [LoraLoad(k + 1, name, str(path)) for k, (name, path) in enumerate(adapters.items())]


def test_each_adapter_alone_matches_peft(
    engine: Engine, adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    driver = GreedyDriver(engine)
    (base_tokens,), _ = driver.run([(PROMPTS[0], 0)])
    assert base_tokens == expected[None]
    for k, name in enumerate(adapters):
        (tokens,), reasons = driver.run([(PROMPTS[k + 1], k + 1)], loads_for(adapters))
        assert not reasons
        assert tokens == expected[name], name
        # Guards the comparison: the adapter changes what the base model says.
        (plain,), _ = driver.run([(PROMPTS[k + 1], 0)])
        assert plain != tokens, f"{name} does not change the greedy tokens"


def test_base_and_three_adapters_in_one_batch(
    engine: Engine, adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    """One batch: the base and each adapter, prompts prefilled in chunks of 5 tokens (prefill
    and decode rows of several adapters in the same steps), each request its tokens alone."""
    driver = GreedyDriver(engine)
    requests = [(PROMPTS[i], i) for i in range(4)]
    outputs, reasons = driver.run(requests, loads_for(adapters), chunk=5)
    assert not reasons
    assert outputs == [expected[None], *(expected[name] for name in adapters)]
    # Rows reordered, slots swapped: the tokens follow the adapter, not the row or slot.
    swapped = [LoraLoad(3 - k, name, str(p)) for k, (name, p) in enumerate(adapters.items())]
    reordered = [(PROMPTS[3], 1), (PROMPTS[0], 0), (PROMPTS[1], 3)]
    outputs, _ = driver.run(reordered, swapped)
    assert outputs == [expected["r16-kogud"], expected[None], expected["r4-qv"]]


def test_padded_and_segment_layouts_match_per_token_reference() -> None:
    """lora_padded and lora_segments against out[t] = B_s (A_s x[t]) token by token, for a
    three-part projection with slots of different ranks and a base row between them; the
    padded layout with its slots as an index tensor, a slice and every slot."""
    torch.manual_seed(0)
    num_slots, max_rank, dim, outs = 3, 8, 16, [12, 6, 6]
    a = torch.randn(num_slots, max_rank, 3, dim)
    b = [torch.randn(num_slots, max_rank, o) for o in outs]
    a[1, 4:] = 0  # slot 2 has rank 4
    token_slots = [2, 2, 0, 1, 1, 1, 1, 1, 3, 0]  # 0: base
    x = torch.randn(len(token_slots), dim)
    reference = torch.zeros(len(token_slots), sum(outs))
    for t, slot in enumerate(token_slots):
        if slot:
            parts = [b[p][slot - 1].t() @ (a[slot - 1, :, p] @ x[t]) for p in range(3)]
            reference[t] = torch.cat(parts)
    segments = [[0, 1], [3, 4, 5, 6, 7], [8]]
    flat = [t for s in segments for t in s]

    def added(update: torch.Tensor, tokens: list[int] = flat) -> torch.Tensor:
        return torch.zeros_like(reference).index_add_(0, torch.tensor(tokens), update)

    update = lora_segments(x[flat], a, b, [(1, 0, 2), (0, 2, 7), (2, 7, 8)], max_rank)
    torch.testing.assert_close(added(update), reference, rtol=1e-5, atol=1e-4)
    gather = torch.tensor([0, 1, 0, 0, 0, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0])
    positions = torch.tensor([0, 1, 5, 6, 7, 8, 9, 10])
    update = lora_padded(x, a, b, torch.tensor([1, 0, 2]), gather, positions, max_rank)
    torch.testing.assert_close(added(update), reference, rtol=1e-5, atol=1e-4)
    # Every slot in order (select None), and a run of slots (a slice): the tables in place.
    gather = torch.tensor([3, 4, 5, 6, 7, 0, 1, 0, 0, 0, 8, 0, 0, 0, 0])
    positions = torch.tensor([5, 6, 0, 1, 2, 3, 4, 10])
    update = lora_padded(x, a, b, None, gather, positions, max_rank)
    torch.testing.assert_close(added(update, [0, 1, 3, 4, 5, 6, 7, 8]), reference)
    gather = torch.tensor([3, 4, 5, 6, 7, 0, 1, 0, 0, 0])  # slots 1 and 2 only
    update = lora_padded(x, a, b, slice(0, 2), gather, positions[:7], max_rank)
    without_slot_3 = reference.clone()
    without_slot_3[8] = 0
    torch.testing.assert_close(added(update, [0, 1, 3, 4, 5, 6, 7]), without_slot_3)


def test_layout_choice_and_batch_rows(engine: Engine, adapters: dict[str, Path]) -> None:
    """LoraSlots.batch groups rows by slot: decode rows padded, a long prefill segment beside
    short ones per segment; the base rows are left out, the step's rank is its adapters'
    highest."""
    assert engine.adapters is not None
    slots = engine.adapters.slots
    for load in loads_for(adapters):
        engine.adapters.place(load)
    decode = slots.batch([1, 0, 3, 1], [1, 1, 1, 1])
    assert isinstance(decode, LoraBatch) and decode.padded
    assert decode.tokens.tolist() == [0, 3, 2] and decode.rank == 16
    mixed = slots.batch([1, 2, 0, 3], [40, 1, 3, 1])
    assert mixed is not None and not mixed.padded
    assert mixed.tokens.tolist() == [*range(40), 40, 44] and mixed.rank == 16
    assert mixed.segment_list == [(0, 0, 40), (1, 40, 41), (2, 41, 42)]
    small = slots.batch([1, 2, 0], [3, 2, 1])
    assert small is not None and small.rank == 8 and small.padded
    assert slots.batch([0, 0], [5, 1]) is None
    # The padded layout's slots: an index tensor, a run of them (read in place), or all; the
    # copies skipped where they would be the identity.
    assert isinstance(decode.select, torch.Tensor) and decode.select.tolist() == [0, 2]
    assert small.select == slice(0, 2) and not small.every_row
    whole = slots.batch([1, 2, 3], [1, 1, 1])
    assert whole is not None and whole.select is None and whole.every_row
    assert whole.gather is None and whole.positions is None
    assert decode.gather is not None and decode.gather.tolist() == [0, 3, 2, 0]


def test_refused_adapters_name_the_adapter_and_reason(
    engine: Engine,
    base: Path,
    adapters: dict[str, Path],
    tmp_path: Path,
    tiny_model: Callable[..., Path],
) -> None:
    source = adapters["r4-qv"]

    def variant(name: str) -> Path:
        return Path(shutil.copytree(source, tmp_path / name))

    too_big = make_lora_adapter(base, tmp_path / "r32", rank=32, target_modules=["q_proj"], seed=5)
    lacking = variant("lacking")
    settings = json.loads((lacking / "adapter_config.json").read_text())
    settings["target_modules"] = ["q_proj", "c_attn"]
    (lacking / "adapter_config.json").write_text(json.dumps(settings))
    corrupt = variant("corrupt")
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    dora = variant("dora")
    settings = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**settings, "use_dora": True}))
    other_base = make_tiny_llama(tmp_path / "wider", hidden_size=96, with_tokenizer=False)
    wrong_shape = make_lora_adapter(
        other_base, tmp_path / "wide-lora", rank=4, target_modules=["q_proj"], seed=6
    )
    cases = {
        "too-big": (too_big, "rank r=32 exceeds --max-lora-rank=16"),
        "lacking": (lacking, "targets modules the model lacks: c_attn"),
        "corrupt": (corrupt, "is corrupt"),
        "dora": (dora, "use_dora=True is not supported"),
        "wrong-shape": (wrong_shape, "an adapter for another base model"),
        "missing": (tmp_path / "nowhere", "has no adapter_config.json"),
    }
    for name, (path, reason) in cases.items():
        with pytest.raises(LoraError) as err:
            engine.add_lora(name, str(path))
        assert str(err.value).startswith(f"adapter {name}: ") and reason in str(err.value)
    # The engine keeps serving: a request under a good adapter still runs.
    (tokens,), reasons = GreedyDriver(engine).run([(PROMPTS[1], 1)], loads_for(adapters))
    assert not reasons and len(tokens) == NUM_TOKENS


def test_a_failed_plan_load_refuses_its_rows_alone(
    engine: Engine, adapters: dict[str, Path], expected: dict[str | None, list[int]], tmp_path: Path
) -> None:
    """An adapter the host cache does not hold and whose file is gone by the time a plan loads
    it: the requests under its slot are refused with the reason, the others run."""
    gone = Path(shutil.copytree(adapters["r4-qv"], tmp_path / "gone"))
    engine.add_lora("gone", str(gone))
    assert engine.adapters is not None
    engine.adapters.remove("gone")
    shutil.rmtree(gone)
    loads = [LoraLoad(1, "gone", str(gone)), LoraLoad(2, "r4-qv", str(adapters["r4-qv"]))]
    outputs, reasons = GreedyDriver(engine).run([(PROMPTS[0], 1), (PROMPTS[1], 2)], loads)
    assert len(reasons) == 1 and reasons[0].startswith("adapter gone: ")
    assert outputs[1][:1] == expected["r4-qv"][:1]


def test_host_cache_drops_least_recently_used(
    engine: Engine, adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    """max_cpu_loras=3: a fourth adapter drops the least recently used one; a plan placing the
    dropped one reads it from its path again, with the same tokens."""
    assert engine.adapters is not None
    cache = engine.adapters.cache
    for name, path in adapters.items():
        engine.add_lora(name, str(path))
    engine.adapters.place(LoraLoad(1, "r4-qv", str(adapters["r4-qv"])))  # now most recent
    engine.add_lora("extra", str(adapters["r16-kogud"]))
    assert list(cache) == ["r16-kogud", "r4-qv", "extra"]
    assert "r8-all-rslora" not in cache
    (tokens,), _ = GreedyDriver(engine).run(
        [(PROMPTS[2], 2)], [LoraLoad(2, "r8-all-rslora", str(adapters["r8-all-rslora"]))]
    )
    assert tokens == expected["r8-all-rslora"]
    assert list(cache)[-1] == "r8-all-rslora" and len(cache) == 3


def _adapters_on_rank(
    loads: list[LoraLoad], requests: list[tuple[list[int], int]], engine: Engine, parallel: Any
) -> list[list[int]]:
    """On each rank of a group: the base and adapters in one batch (each rank reads the adapters
    from their paths: the plan's loads reach every rank)."""
    outputs, reasons = GreedyDriver(engine).run(requests, loads, chunk=5)
    assert not reasons, reasons
    return outputs


def test_tensor_parallel_group_gives_each_request_its_tokens(
    base: Path, adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    """T = 2 on gloo: A and B split as their base layers (B by rows for q, k, v, gate, up; A by
    columns for o and down), the same tokens as transformers + peft on one process."""
    from llmserve.engine.parallel.ranks import run_group_locally

    config = EngineConfig(
        model=str(base), device="cpu", num_kv_blocks=64, block_size=BLOCK_SIZE,
        tensor_parallel_size=2, num_threads=1, max_loras=3, max_lora_rank=16, max_cpu_loras=3,
    )  # fmt: skip
    requests = [(PROMPTS[i], i) for i in range(4)]
    work = functools.partial(_adapters_on_rank, loads_for(adapters), requests)
    got = run_group_locally(config, work, timeout=240)
    want = [expected[None], *(expected[name] for name in adapters)]
    assert got[0] == want
    assert got[1] == want  # the other rank's mirror saw the driver's tokens


def serve(
    engine: Engine,
    adapters: dict[str, Path],
    depth: int,
    max_loras: int,
    num_blocks: int,
    only: list[int] | None = None,
    num_tokens: int = NUM_TOKENS,
    **config: Any,
) -> tuple[dict[int, list[int]], Scheduler, int]:
    """The base and each adapter's request (PROMPTS) through the real Scheduler and the engine,
    up to `depth` steps in flight, the scheduler holding max_loras slots and num_blocks blocks
    (fewer than the engine has: preemption), through the protobuf contract; only: the indices
    of PROMPTS to run (default all). Returns the outputs by seq id, the scheduler, and how many
    tokens the engine proposed."""
    engine.reset()
    info = engine.info
    s = Scheduler(
        SchedulerConfig(**config).adopt(info.max_num_seqs, info.max_num_batched_tokens),
        num_blocks, info.block_size, info.max_model_len, info.vocab_size, info.eos_token_ids,
        num_speculative_tokens=info.num_speculative_tokens,
    )  # fmt: skip
    s.loras.resize(max_loras)
    for name, path in adapters.items():
        s.loras.register(name, str(path))
    names = ["", *adapters]
    for i, prompt in enumerate(PROMPTS):
        if only is not None and i not in only:
            continue
        request = Request(f"r{i}", i + 1, prompt, GREEDY, num_tokens, ignore_eos=True)
        request.lora_name = names[i]
        s.add(request)
    outputs: dict[int, list[int]] = {}
    in_flight: deque[tuple[Any, Any]] = deque()
    num_draft_tokens = 0
    for _ in range(2000):
        if not s.has_work and not in_flight:
            return outputs, s, num_draft_tokens
        if len(in_flight) < depth and s.has_work:
            plan = s.schedule()
            if not plan.is_empty:
                in_flight.append((plan, engine.launch(plan_from_proto(plan_to_proto(plan)))))
                continue
        plan, step = in_flight.popleft()
        out = engine.finish(step)
        assert not out.refused_seq_ids, out.refusal_reasons
        num_draft_tokens += sum(out.num_draft_tokens)
        num_sampled, num_draft = out.num_sampled_tokens or None, out.num_draft_tokens or None
        for o in s.update(plan, out.sampled_token_ids, out.logprobs, None, num_sampled, num_draft):
            outputs.setdefault(o.request.seq_id, []).append(o.token_id)
        s.check_integrity()
    raise AssertionError("did not finish")


def test_scheduler_and_engine_chunked_preempting_overlapped(
    engine: Engine, adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    """Three adapters over two slots (the scheduler rotates them), prefill in chunks of 8
    tokens, a pool too small for all four requests (preemption, recompute under the same
    adapter), two steps in flight: each request gets its tokens alone."""
    want = [expected[None], *(expected[name] for name in adapters)]
    got, scheduler, _ = serve(
        engine, adapters, 2, max_loras=2, num_blocks=8, max_num_batched_tokens=8
    )
    assert [got[i + 1] for i in range(4)] == want
    assert scheduler.counters.num_preemptions > 0


def test_speculative_decoding_keeps_each_adapters_tokens(
    base: Path, adapters: dict[str, Path], expected: dict[str | None, list[int]]
) -> None:
    """ngram speculation: proposals are verified under each row's adapter, so every request
    gets the tokens it gets without speculation."""
    config = EngineConfig(
        model=str(base), device="cpu", num_kv_blocks=64, block_size=BLOCK_SIZE,
        max_loras=3, max_lora_rank=16, speculative_method="ngram", num_speculative_tokens=3,
        ngram_min=1,
    )  # fmt: skip
    engine = Engine(config)
    for name, path in adapters.items():
        engine.add_lora(name, str(path))
    got, _, num_draft_tokens = serve(engine, adapters, 1, max_loras=3, num_blocks=64)
    assert num_draft_tokens > 0, "nothing was proposed: the test shows nothing"
    assert [got[i + 1] for i in range(4)] == [expected[None], *(expected[n] for n in adapters)]


def test_adapted_requests_are_batch_invariant(engine: Engine, adapters: dict[str, Path]) -> None:
    """float32, 40 tokens each: every request (the base and each adapter) alone, then all four
    together over two slots with prefill in chunks of 8, a pool too small for them (preemption,
    recompute) and two steps in flight: token-identical. A row's adapter update is computed alone
    in a fixed order (kernels/cpu_lora.cpp): its neighbours cannot change its rounding."""
    alone: dict[int, list[int]] = {}
    for i in range(4):
        got, _, _ = serve(engine, adapters, 1, max_loras=3, num_blocks=64, only=[i], num_tokens=40)
        alone[i + 1] = got[i + 1]
    together, scheduler, _ = serve(
        engine, adapters, 2, max_loras=2, num_blocks=12, num_tokens=40, max_num_batched_tokens=8
    )
    assert scheduler.counters.num_preemptions > 0
    assert together == alone


def test_a_rows_adapter_update_does_not_depend_on_its_neighbours(
    engine: Engine, adapters: dict[str, Path]
) -> None:
    """LoraBatch.add, row by row: the update of one token under adapter slot 1 is bit-identical
    alone, beside another token of the same adapter (BLAS rounds a 2-row product differently
    from a 1-row one), beside other adapters' and base rows, in a prefill segment, and with a
    higher-rank adapter in the step."""
    assert engine.adapters is not None
    slots = engine.adapters.slots
    for load in loads_for(adapters):
        engine.adapters.place(load)
    hidden = slots.a["qkv_proj"].shape[-1]
    width = sum(part.shape[-1] for part in slots.b["qkv_proj"])
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(1, hidden, generator=gen)

    def update(row_slots: list[int], row_tokens: list[int], at: int) -> torch.Tensor:
        x = torch.randn(sum(row_tokens), hidden, generator=gen)
        x[at] = target[0]
        out = torch.zeros(x.shape[0], width)
        batch = slots.batch(row_slots, row_tokens)
        assert batch is not None
        batch.add(0, "qkv_proj", x, out)
        return out[at]

    alone = update([1], [1], 0)
    assert alone.abs().sum() > 0
    for row_slots, row_tokens, at in [
        ([1, 1], [1, 1], 0),  # the same adapter's decode row beside it
        ([2, 1, 0, 1], [1, 1, 1, 1], 1),  # other adapters and the base
        ([1, 3], [12, 1], 5),  # inside a prefill segment, with the rank-16 adapter
        ([0, 1, 2], [3, 7, 40], 9),  # a long segment: the per-segment layout
    ]:
        assert torch.equal(update(row_slots, row_tokens, at), alone), (row_slots, row_tokens)
