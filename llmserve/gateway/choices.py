"""Fan-out: a request with n choices (or several prompts) becomes one scheduler request per choice,
through the shared request path (gateway/core.py); their messages come back merged, in arrival
order. The prefix cache shares the prompt's blocks between a prompt's choices; each choice
draws with its own seed (`choice_seed`).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

from llmserve.gateway.core import GatewayCore
from llmserve.gateway.quotas import Admission
from llmserve.gateway.validation import ValidRequest
from llmserve.protos import api_pb2, scheduler_pb2

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Choice:
    index: int  # in the response: prompt_index * n + sample_index
    prompt_index: int
    sample_index: int
    valid: ValidRequest
    request_id: str  # the scheduler's


def choice_seed(seed: int, sample_index: int) -> int:
    """Sample 0 keeps the request's seed (so n=1 is unchanged); sample i > 0 draws with its own
    seed derived from it (splitmix64), so choices differ and stay reproducible."""
    if sample_index == 0:
        return seed
    z = (seed + sample_index * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def make_choices(valids: list[ValidRequest], n: int, response_id: str) -> list[Choice]:
    return [
        Choice(p * n + i, p, i, _seeded(valid, i), f"{response_id}-{p * n + i}")
        for p, valid in enumerate(valids)
        for i in range(n)
    ]


def _seeded(valid: ValidRequest, sample_index: int) -> ValidRequest:
    """valid with choice sample_index's seed (itself when unseeded or sample 0)."""
    if sample_index == 0 or not valid.sampling.HasField("seed"):
        return valid
    submit = scheduler_pb2.SubmitRequest()
    submit.CopyFrom(valid.submit)
    submit.sampling.seed = choice_seed(valid.sampling.seed, sample_index)
    return replace(valid, submit=submit)


Messages = AsyncGenerator[tuple[Choice, api_pb2.GenerateResponse], None]


async def run_choices(
    core: GatewayCore,
    choices: list[Choice],
    carrier: object,
    arrival: float,
    operation: str,
    admission: Admission | None = None,
) -> Messages:
    """Every choice's messages as they arrive, until all have finished. The first error of any
    choice is raised. However this generator ends (finished, error, closed, cancelled), no choice
    is left running upstream, and admission (the request's quota reservation) is released. Each
    choice is traced as its own request (carrier: the HTTP headers, for a caller's traceparent;
    arrival: when the HTTP request came in)."""
    if admission is not None:
        admission.handed_over = True  # released below, however this generator ends
    queue: asyncio.Queue[tuple[Choice, api_pb2.GenerateResponse | Exception]] = asyncio.Queue()

    async def pump(choice: Choice) -> None:
        trace = core.telemetry.start(carrier, choice.request_id, "http", arrival)
        trace.operation = operation  # before validated(): the request span records it
        trace.validated(choice.valid, None)
        try:
            async for msg in core.generate(choice.valid, choice.request_id, trace, admission):
                queue.put_nowait((choice, msg))
        except Exception as err:
            queue.put_nowait((choice, err))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        num_running = len(choices)
        while num_running:
            choice, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            num_running -= bool(item.finish_reason)
            yield choice, item
    finally:
        for task in tasks:
            task.cancel()  # cancels the choice's Submit call; the scheduler frees its blocks
        if admission is not None:
            # Once the choices' tasks have ended: they count what they used on it.
            await asyncio.gather(*tasks, return_exceptions=True)
            admission.release()


async def first_messages(
    stream: Messages, num_choices: int
) -> list[tuple[Choice, api_pb2.GenerateResponse]]:
    """Read stream until every choice has sent a message (so it was admitted)."""
    messages = []
    started: set[int] = set()
    while len(started) < num_choices:
        choice, msg = await anext(stream)
        messages.append((choice, msg))
        started.add(choice.index)
    return messages


async def all_messages(
    stream: Messages,
) -> dict[int, list[api_pb2.GenerateResponse]]:
    """Every choice's messages, by choice index."""
    messages: dict[int, list[api_pb2.GenerateResponse]] = defaultdict(list)
    async for choice, msg in stream:
        messages[choice.index].append(msg)
    return messages
