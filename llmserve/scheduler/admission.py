"""Admission: whether a request can ever run on a Scheduler (its limits, vocabulary, adapter
and queue), checked before it is queued; the refusal names the field and the limit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmserve.scheduler.request import Request

if TYPE_CHECKING:
    from llmserve.scheduler.scheduler import Scheduler


class AdmissionError(Exception):
    """A request refused at admission. `code` is a gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def check_admissible(s: Scheduler, request: Request) -> None:
    """Raise AdmissionError if request can never run on s or s's queue is full."""
    num_prompt = request.num_prompt_tokens
    if num_prompt == 0:
        raise AdmissionError("INVALID_ARGUMENT", "prompt_token_ids is empty")
    for name, ids in (
        ("prompt_token_ids", request.prompt_token_ids),
        ("stop_token_ids", sorted(request.stop_token_ids)),
    ):
        bad = [t for t in ids if not 0 <= t < s.vocab_size]
        if bad:
            raise AdmissionError(
                "INVALID_ARGUMENT",
                f"{name} contains {bad[0]}, outside the vocabulary [0, {s.vocab_size})",
            )
    if request.max_tokens < 1:
        raise AdmissionError("INVALID_ARGUMENT", f"max_tokens={request.max_tokens} must be >= 1")
    total = num_prompt + request.max_tokens
    what = f"prompt ({num_prompt} tokens) + max_tokens ({request.max_tokens}) = {total}"
    if total > s.max_model_len:
        raise AdmissionError("INVALID_ARGUMENT", f"{what} exceeds max_model_len={s.max_model_len}")
    capacity = s.block_manager.num_blocks * s.block_size
    if total > capacity:
        raise AdmissionError(
            "INVALID_ARGUMENT",
            f"{what} exceeds the KV cache's capacity of {capacity} tokens "
            f"({s.block_manager.num_blocks} blocks x {s.block_size})",
        )
    _check_lora(s, request)
    if s.num_waiting >= s.config.max_waiting:
        raise AdmissionError(
            "RESOURCE_EXHAUSTED",
            f"queue full: {s.num_waiting} requests waiting (max_waiting="
            f"{s.config.max_waiting}); retry after a short delay",
        )


def _check_lora(s: Scheduler, request: Request) -> None:
    """NOT_FOUND for an adapter that is not registered (or was unloaded)."""
    name = request.lora_name
    if name and not s.loras.is_servable(name):
        known = sorted(n for n in s.loras.paths if s.loras.is_servable(n))
        listed = ", ".join(known[:10]) + (f", and {len(known) - 10} more" * (len(known) > 10))
        raise AdmissionError(
            "NOT_FOUND", f"adapter {name!r} is not loaded (adapters: {listed or 'none'})"
        )
