"""Structured output's waiting room: constrained requests held out of the waiting line until the
engine has compiled their grammar, so that a compile (milliseconds, or seconds for the first,
which also builds the vocabulary) never runs inside a step that other requests share.

    add ---> held (unsent) --plan's grammar_compiles--> held (sent) --result's
             compiled_seq_ids--> waiting line --> admitted as usual

A constraint the engine has reported compiled before (the same text, kept in `compiled_keys`, as
many as the engine caches) skips the room: it is in the engine's cache. Should the engine have
evicted it since, the engine compiles it from the request's first step (its prefill), which
waits for it: a few milliseconds, not a stall of seconds. An engine reset forgets the keys and
lists every held request's grammar again for the new engine. The scheduler never reads the
constraint: it is passed on as it came, and keyed by its serialized bytes.
"""

from __future__ import annotations

from collections import OrderedDict

from llmserve.scheduler.request import Request

# As many constraints as the engine caches compiled (engine/features/grammar.py's
# MAX_CACHED_GRAMMARS).
MAX_COMPILED_KEYS = 256


def _key(request: Request) -> bytes:
    return request.sampling.structured_output.SerializeToString(deterministic=True)


class GrammarWait:
    """The held requests by seq id, in arrival order, and which of them were listed to the
    engine."""

    def __init__(self) -> None:
        self.held: dict[int, Request] = {}
        self.unsent: list[Request] = []
        self.compiled_keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.held)

    def must_hold(self, request: Request) -> bool:
        """Whether request needs its grammar compiled before it may be admitted."""
        if not request.sampling.HasField("structured_output"):
            return False
        key = _key(request)
        if key in self.compiled_keys:
            self.compiled_keys.move_to_end(key)
            return False
        return True

    def hold(self, request: Request) -> None:
        """Keep request here until the engine reports its grammar compiled."""
        self.held[request.seq_id] = request
        self.unsent.append(request)

    def take_unsent(self) -> list[Request]:
        """The held requests whose grammar the next plan lists (each once)."""
        unsent, self.unsent = self.unsent, []
        return unsent

    @property
    def awaiting_engine(self) -> bool:
        """Whether a held request's grammar was sent and not yet reported."""
        return len(self.unsent) < len(self.held)

    def release(self, seq_ids: list[int]) -> list[Request]:
        """The held requests of seq_ids (the engine compiled their grammar), no longer held;
        ids of requests not held (ended meanwhile) are ignored."""
        released = [r for i in seq_ids if (r := self.held.pop(i, None)) is not None]
        for request in released:
            self.compiled_keys[_key(request)] = None
            if len(self.compiled_keys) > MAX_COMPILED_KEYS:
                self.compiled_keys.popitem(last=False)
        return released

    def remove(self, request: Request) -> bool:
        """Drop request if held (it ended); whether it was."""
        if self.held.pop(request.seq_id, None) is None:
            return False
        if request in self.unsent:
            self.unsent.remove(request)
        return True

    def reset(self) -> None:
        """A new engine: it has compiled nothing; every held request is listed again."""
        self.compiled_keys.clear()
        self.unsent = list(self.held.values())
