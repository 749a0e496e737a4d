"""Stop strings: find them in streamed text, never stream them, never stream past them.

Text that could be the start of a stop string is held back until the next delta decides:

    released text | held (a prefix of some stop string) | next delta ...
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stop: list[str]):
        self.stop = [s for s in stop if s]
        self.held = ""
        self.matched: str | None = None  # the stop string hit (the earliest in the text)

    def feed(self, text: str) -> tuple[str, bool]:
        """Add a delta; return (text safe to stream, whether a stop string was hit). After a hit
        the released text ends just before the stop string and the rest is dropped."""
        if not self.stop:
            return text, False
        pending = self.held + text
        hits = [(i, s) for s in self.stop if (i := pending.find(s)) >= 0]
        if hits:
            self.held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return pending[:at], True
        keep = self._partial_suffix_len(pending)
        self.held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep], False

    def _partial_suffix_len(self, text: str) -> int:
        longest = min(len(text), max(len(s) for s in self.stop) - 1)
        for k in range(longest, 0, -1):
            if any(s.startswith(text[-k:]) for s in self.stop):
                return k
        return 0

    def flush(self) -> str:
        """Held text, released when the request ends for another reason."""
        text, self.held = self.held, ""
        return text
