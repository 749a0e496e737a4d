"""Per-step cost of the step contract's conversions: the scheduler's plan to engine.proto's
StepPlan (scheduler/service/convert.py) and the message to the engine's plan data
(engine/contract/convert.py), on plans made by the real Scheduler. CPU only; run from the repository
root:

    python -m bench.studies.plan_conversion [--rows 256] [--repeat 2000]

Prints, per plan shape, the best of 5 timings of each conversion in microseconds per step.
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

from llmserve.engine.contract.convert import plan_from_proto
from llmserve.protos import common_pb2, engine_pb2
from llmserve.scheduler.config import SchedulerConfig
from llmserve.scheduler.plan import StepPlan
from llmserve.scheduler.request import Request
from llmserve.scheduler.scheduler import Scheduler
from llmserve.scheduler.service.convert import plan_to_proto

BLOCK_SIZE = 16
PROMPT = 100


def decode_plan(num_rows: int, num_speculative_tokens: int = 0) -> StepPlan:
    """A decode step of num_rows running requests (one in BLOCK_SIZE crossing into a new block),
    with lookahead slots when num_speculative_tokens > 0."""
    config = SchedulerConfig(max_num_seqs=num_rows, max_num_batched_tokens=num_rows * 2 * PROMPT)
    s = Scheduler(
        config, num_rows * 64, BLOCK_SIZE, 4096, 32000, (2,),
        num_speculative_tokens=num_speculative_tokens,
    )  # fmt: skip
    for i in range(num_rows):
        length = PROMPT + i % BLOCK_SIZE
        s.add(Request(f"r{i}", i + 1, [7] * length, common_pb2.SamplingParams(), 512))
    plan = s.schedule()  # the prefill
    s.update(plan, [5] * len(plan.rows))
    plan = s.schedule()
    assert len(plan.running) == num_rows and not plan.new_requests
    return plan


def prefill_plan(num_rows: int) -> StepPlan:
    """A step admitting num_rows new requests of PROMPT tokens."""
    config = SchedulerConfig(max_num_seqs=num_rows, max_num_batched_tokens=num_rows * PROMPT)
    s = Scheduler(config, num_rows * 64, BLOCK_SIZE, 4096, 32000, (2,))
    for i in range(num_rows):
        s.add(Request(f"r{i}", i + 1, [7 + i] * PROMPT, common_pb2.SamplingParams(), 512))
    plan = s.schedule()
    assert len(plan.new_requests) == num_rows
    return plan


def best_us(fn: Callable[[], object], repeat: int) -> float:
    return min(timeit.repeat(fn, number=repeat, repeat=5)) / repeat * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=2000)
    args = parser.parse_args()
    shapes = {
        f"decode x{args.rows}": decode_plan(args.rows),
        f"decode x{args.rows}, lookahead": decode_plan(args.rows, num_speculative_tokens=4),
        "prefill x16": prefill_plan(16),
    }
    print(f"{'plan':<28} {'plan_to_proto us':>17} {'plan_from_proto us':>19}")
    for name, plan in shapes.items():
        msg = plan_to_proto(plan)
        wire = engine_pb2.StepPlan.FromString(msg.SerializeToString())
        to_us = best_us(lambda plan=plan: plan_to_proto(plan), args.repeat)
        from_us = best_us(lambda wire=wire: plan_from_proto(wire), args.repeat)
        print(f"{name:<28} {to_us:>17.1f} {from_us:>19.1f}")


if __name__ == "__main__":
    main()
