"""Stored responses of the Responses API (`store: true`, its default): what GET and DELETE
/v1/responses/{id} read, and the conversation a later request continues by
`previous_response_id`. In this gateway's memory only, bounded by a count and a size: the least
recently used response goes first; a gateway restart, or another gateway replica, knows none.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

from llmserve.gateway.openai_protocol import ChatMessageParam

MAX_STORED_BYTES = 256 << 20  # the responses' JSON and their conversations together


@dataclass(frozen=True)
class StoredResponse:
    """A finished response: its JSON (GET returns it as it was sent) and the conversation it
    ends (its history, its input and its output, as chat messages; instructions left out, as
    OpenAI does not carry them to the next response)."""

    body: str
    conversation: list[ChatMessageParam]

    @cached_property
    def num_bytes(self) -> int:
        return len(self.body) + sum(len(m.model_dump_json()) for m in self.conversation)


class ResponseStore:
    """Responses by id, at most max_responses of them and MAX_STORED_BYTES in all (0: none are
    kept)."""

    def __init__(self, max_responses: int, max_bytes: int = MAX_STORED_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Keep stored under response_id, dropping the least recently used to make room (a
        response larger than the whole store is not kept)."""
        size = stored.num_bytes
        if not self.max_responses or size > self.max_bytes:
            return
        self.delete(response_id)
        while self.responses and (
            len(self.responses) >= self.max_responses or self.num_bytes + size > self.max_bytes
        ):
            _, dropped = self.responses.popitem(last=False)
            self.num_bytes -= dropped.num_bytes
        self.responses[response_id] = stored
        self.num_bytes += size

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self.responses.get(response_id)
        if stored is not None:
            self.responses.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self.responses.pop(response_id, None)
        if stored is None:
            return False
        self.num_bytes -= stored.num_bytes
        return True
