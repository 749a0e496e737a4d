"""The engine's recurrent-state slots, owned here as blocks are owned by the block manager:
hybrid linear-attention models (Qwen3-Next's gated DeltaNet layers, Mamba-2 hybrids) keep one
fixed-size state per running request (every state layer's conv and SSM / delta-rule state),
in slot `state_slot` of the engine's state pool (docs/architecture.md#state-slots).

A request takes a slot when it is admitted and gives it back when it finishes, is aborted or is
preempted (it is recomputed from its tokens, so its state is rebuilt). With no slots (a model
without state layers) nothing here is used and every request's slot stays None.
"""

from __future__ import annotations

from collections import deque

from llmserve.scheduler.request import Request, RequestStatus


class StateSlots:
    """Slots 0 .. num_slots - 1, free ones handed out lowest first after a reset, then in the
    order they were freed (a FIFO, so a slot just freed is the last reused)."""

    def __init__(self, num_slots: int = 0):
        assert num_slots >= 0
        self.num_slots = num_slots
        self.free_slots: deque[int] = deque(range(num_slots))

    @property
    def enabled(self) -> bool:
        """Whether the model has state layers (each running request then needs a slot)."""
        return self.num_slots > 0

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    def can_allocate(self) -> bool:
        """Whether one more request can run: always without state layers."""
        return not self.enabled or bool(self.free_slots)

    def allocate(self, request: Request) -> None:
        """Give request a free slot (none without state layers). Assumes can_allocate()."""
        assert request.state_slot is None, f"{request.request_id} holds slot {request.state_slot}"
        if self.enabled:
            request.state_slot = self.free_slots.popleft()

    def free(self, request: Request) -> None:
        """Take request's slot back, if it holds one."""
        if request.state_slot is not None:
            slot = request.state_slot
            assert slot not in self.free_slots, f"state slot {slot} freed twice"
            self.free_slots.append(request.state_slot)
            request.state_slot = None

    def check_integrity(self, requests: list[Request]) -> None:
        """Every slot is free or held by exactly one of requests, never both; only running
        requests hold one."""
        held = [r.state_slot for r in requests if r.state_slot is not None]
        for r in requests:
            if r.state_slot is not None:
                assert r.status == RequestStatus.RUNNING, (
                    f"{r.request_id} ({r.status}) holds a slot"
                )
        assert len(held) == len(set(held)), f"a state slot held twice: {sorted(held)}"
        assert not set(held) & set(self.free_slots), "a state slot both held and free"
        assert len(held) + len(self.free_slots) == self.num_slots, (
            f"{len(held)} held + {len(self.free_slots)} free state slots != {self.num_slots}"
        )
        assert all(0 <= s < self.num_slots for s in held), f"state slot out of range: {held}"
