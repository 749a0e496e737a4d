"""The scheduler's side of LoRA, CPU only: at most max_loras distinct adapters per step with
none starving, loads planned before (in the same plan as) the first rows that need them, slots
the engine's mirror agrees with, a prefix cache keyed by adapter, unknown and unloaded adapters
refused. Plans go through the real contract into the engine's Mirror (Harness(mirror=True))."""

from __future__ import annotations

import itertools

import pytest

from llmserve.scheduler.admission import AdmissionError
from llmserve.scheduler.plan import StepPlan
from tests.scheduler_harness import BS, Harness, make_request


def lora_request(seq_id: int, lora_name: str, num_prompt: int = 6, max_tokens: int = 4, **kw):
    request = make_request(seq_id, num_prompt, max_tokens, **kw)
    request.lora_name = lora_name
    return request


def harness(max_loras: int, names: list[str], **kwargs) -> Harness:
    h = Harness(mirror=True, **kwargs)
    h.s.loras.resize(max_loras)
    for name in names:
        h.s.loras.register(name, f"/adapters/{name}")
    return h


class EngineSlots:
    """The engine's slot table as the plans build it: checks that every row's slot holds its
    request's adapter when the row runs."""

    def __init__(self, max_loras: int):
        self.slots = [""] * max_loras
        self.num_loads = 0

    def apply(self, plan: StepPlan) -> None:
        for load in plan.lora_loads:
            assert load.path == f"/adapters/{load.lora_name}"
            self.slots[load.slot - 1] = load.lora_name
            self.num_loads += 1
        for row in plan.rows:
            name = row.request.lora_key  # the version it was admitted under
            if name:
                assert self.slots[row.lora_slot - 1] == name, (row.request.request_id, self.slots)
            else:
                assert row.lora_slot == 0


def run(h: Harness, engine: EngineSlots, max_steps: int = 300) -> list[StepPlan]:
    plans = []
    for _ in range(max_steps):
        if not h.s.has_work:
            return plans
        plan, _ = h.step()
        engine.apply(plan)
        plans.append(plan)
    raise AssertionError("scheduler did not go idle")


def test_at_most_max_loras_adapters_per_step_and_none_starves() -> None:
    names = [f"a{i}" for i in range(5)]
    h = harness(2, names, num_blocks=64, max_num_seqs=8)
    requests = [lora_request(i + 1, names[i % 5], max_tokens=6) for i in range(8)]
    requests.append(lora_request(9, "", max_tokens=6))
    h.add(*requests)
    engine = EngineSlots(2)
    plans = run(h, engine)
    assert all(h.finished[r.seq_id] for r in requests)
    assert all(len(h.outputs[r.seq_id]) == 6 for r in requests)
    steps_of: dict[int, list[int]] = {}
    for plan in plans:
        adapters = {r.request.lora_name for r in plan.rows} - {""}
        assert len(adapters) <= 2, (plan.step_id, adapters)
        for row in plan.rows:
            steps_of.setdefault(row.request.seq_id, []).append(plan.step_id)
    # Five adapters over two slots: each running request runs at least once in 3 steps.
    for seq_id, steps in steps_of.items():
        gaps = [b - a for a, b in itertools.pairwise(steps)]
        assert max(gaps, default=1) <= 3, (seq_id, steps)
    # The base request is never held back by the adapters' limit.
    base_steps = steps_of[9]
    assert base_steps == list(range(base_steps[0], base_steps[0] + len(base_steps)))


def test_a_resident_adapter_is_not_loaded_again() -> None:
    h = harness(2, ["x", "y"])
    h.add(lora_request(1, "x"), lora_request(2, "y"), lora_request(3, "x"))
    engine = EngineSlots(2)
    plans = run(h, engine)
    assert engine.num_loads == 2
    first = plans[0]
    assert sorted((load.slot, load.lora_name) for load in first.lora_loads) == [(1, "x"), (2, "y")]


def test_a_waiting_adapter_gets_a_slot_once_one_is_free() -> None:
    """Two slots held by running adapters x and y: z's request waits (the base one behind it
    too, in line order) until a slot frees; its load comes in the plan that first runs it."""
    h = harness(2, ["x", "y", "z"])
    h.add(lora_request(1, "x", max_tokens=3), lora_request(2, "y", max_tokens=6))
    h.add(lora_request(3, "z", max_tokens=2))
    engine = EngineSlots(2)
    plans = run(h, engine)
    first_z = next(p for p in plans if any(r.request.seq_id == 3 for r in p.rows))
    assert [load.lora_name for load in first_z.lora_loads] == ["z"]
    assert all(r.request.seq_id != 1 for r in first_z.rows)  # x finished: z took its slot
    assert first_z.lora_loads[0].slot == 1
    assert engine.num_loads == 3


def test_prefix_cache_is_keyed_by_adapter() -> None:
    prompt = list(range(1, 3 * BS + 2))
    h = harness(2, ["x", "y"], num_blocks=32)
    owners = {"x": 1, "": 2, "y": 3}
    for name, seq_id in owners.items():
        h.add(lora_request(seq_id, name, prompt=prompt, max_tokens=2))
    engine = EngineSlots(2)
    run(h, engine)
    # The same prompt again under each: a hit only for its own adapter's blocks.
    again = {
        name: lora_request(10 + seq_id, name, prompt=prompt, max_tokens=1)
        for name, seq_id in owners.items()
    }
    h.add(*again.values())
    hits = {}
    for request in again.values():
        cached = h.s.block_manager.find_cached_blocks(request)
        hits[request.lora_name] = cached
    assert all(len(blocks) == 3 for blocks in hits.values())
    assert len({tuple(b) for b in hits.values()}) == 3  # three different sets of blocks
    z = lora_request(20, "x", prompt=prompt, max_tokens=1)
    z.lora_name = "z"
    assert h.s.block_manager.find_cached_blocks(z) == []
    run(h, engine)
    assert all(r.num_cached_tokens == 3 * BS for r in again.values())


def test_unknown_and_unloaded_adapters_are_not_found() -> None:
    h = harness(2, ["x"])
    with pytest.raises(AdmissionError) as err:
        h.s.add(lora_request(1, "nope"))
    assert err.value.code == "NOT_FOUND" and "'nope' is not loaded" in err.value.message
    running = lora_request(2, "x", max_tokens=5)
    h.add(running)
    engine = EngineSlots(2)
    engine.apply(h.step()[0])
    h.s.loras.unregister("x")
    with pytest.raises(AdmissionError) as err:
        h.s.add(lora_request(3, "x"))
    assert err.value.code == "NOT_FOUND"
    run(h, engine)  # the running one is not pulled from under it
    assert len(h.outputs[2]) == 5
    h.s.loras.register("x", "/adapters/x")
    h.add(lora_request(4, "x"))
    run(h, engine)
    assert len(h.outputs[4]) == 4


def test_engine_reset_empties_the_slot_table() -> None:
    h = harness(1, ["x"])
    h.add(lora_request(1, "x", max_tokens=6))
    h.step()
    h.reset_engine()
    engine = EngineSlots(1)  # a new engine holds nothing: x is loaded again
    run(h, engine)
    assert engine.num_loads == 1 and len(h.outputs[1]) == 6


def test_a_replaced_adapter_serves_new_requests_and_running_ones_keep_theirs() -> None:
    """register(..., replace) is a new version: requests admitted before run on the old one to
    the end (its slot kept), later ones on the new one, and the prefix cache never mixes them."""
    prompt = list(range(1, 3 * BS + 2))
    h = harness(2, ["x"], num_blocks=32)
    old = lora_request(1, "x", prompt=prompt, max_tokens=8)
    h.add(old)
    engine = EngineSlots(2)
    engine.apply(h.step()[0])
    assert h.s.loras.next_key("x", "/adapters/x") == "x"  # the same directory: no new version
    assert h.s.loras.register("x", "/adapters/x@2", replace=True) == "x@2"
    new = lora_request(2, "x", prompt=prompt, max_tokens=8)
    h.add(new)
    assert (old.lora_key, new.lora_key) == ("x", "x@2")
    assert h.s.block_manager.find_cached_blocks(new) == []  # x's blocks are not x@2's
    run(h, engine)
    assert sorted(engine.slots) == ["x", "x@2"] and len(h.outputs[1]) == len(h.outputs[2]) == 8
    again = lora_request(3, "x", prompt=prompt, max_tokens=1)
    h.add(again)
    run(h, engine)
    assert again.lora_key == "x@2" and again.num_cached_tokens == 3 * BS


def test_adapter_names_and_the_registry_bound_are_checked() -> None:
    from llmserve.scheduler.config import SchedulerConfig
    from llmserve.scheduler.lora import check_lora_name

    assert check_lora_name("org/adapter-1.v2") is None
    for bad in ("../../etc/passwd", "/abs", "a b", "a//b", "x" * 65, "", "a/../b"):
        assert check_lora_name(bad) is not None, bad
    with pytest.raises(ValueError, match=r"lora_modules entry '\.\./x=/p': lora_name="):
        SchedulerConfig(lora_modules=("../x=/p",)).lora_paths()
    with pytest.raises(ValueError, match="names 3 adapters; max_registered_loras=2"):
        SchedulerConfig(lora_modules=("a=/a", "b=/b", "c=/c"), max_registered_loras=2).lora_paths()


def test_load_lora_refusals_come_before_any_engine_reads_the_adapter() -> None:
    import grpc

    from llmserve.protos.scheduler_pb2 import LoadLoraRequest as Load
    from llmserve.scheduler.config import SchedulerConfig
    from llmserve.scheduler.service.service import SchedulerService

    service = SchedulerService(SchedulerConfig(max_registered_loras=1))  # no server, no engine
    service.scheduler = harness(2, ["x"]).s
    assert service._refuse_lora(Load(lora_name="x", path="/adapters/x")) is None  # again: fine
    code, message = service._refuse_lora(Load(lora_name="x", path="/other"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "from /adapters/x; set replace" in message
    assert service._refuse_lora(Load(lora_name="x", path="/other", replace=True)) is None
    code, message = service._refuse_lora(Load(lora_name="y", path="/y"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_registered_loras=1" in message
    code, message = service._refuse_lora(Load(lora_name="../y", path="/y"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "lora_name='../y'" in message


def test_not_found_lists_at_most_ten_adapters() -> None:
    h = harness(2, [f"a{i:02d}" for i in range(30)])
    with pytest.raises(AdmissionError) as err:
        h.s.add(lora_request(1, "nope"))
    assert "a00, a01," in err.value.message and "a10" not in err.value.message
    assert "and 20 more" in err.value.message
