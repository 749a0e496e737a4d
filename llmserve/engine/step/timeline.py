"""Each step's span on the GPU's clock, for measuring how busy the GPU is between steps.

Off unless LLMSERVE_STEP_TIMELINE=PATH is set and the engine runs on a GPU. Then the runner
records a CUDA event just before a step's first kernel is enqueued (its host-side preparation
done) and another after its last (sampling); once both have completed, one JSON line is appended
to PATH:

    {"step_id": 7, "num_seqs": 256, "num_tokens": 256, "decode_only": true,
     "start_ms": 1234.567, "end_ms": 1245.678}

times in ms since the engine's first event. What lies between one step's end and the next one's
start is GPU idle time (the host planning, the gRPC round trip, the next step's preparation);
time inside a span counts as busy, so the busy fraction is an upper bound where a step's own
launches leave gaps (eager prefill steps; a replayed decode graph leaves none).
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, Any

import torch

ENV_VAR = "LLMSERVE_STEP_TIMELINE"


class NullTimeline:
    """Records nothing (the default)."""

    def begin(self) -> None:
        pass

    def end(self, step_id: int, num_seqs: int, num_tokens: int, decode_only: bool) -> None:
        pass

    def close(self) -> None:
        pass


class StepTimeline:
    """CUDA events around every step, written out as JSON lines once they have completed (the
    events of a step are read at a later step, or at close, so recording never synchronizes)."""

    def __init__(self, path: str):
        self.file: IO[str] = open(path, "a")  # noqa: SIM115 - held for the engine's lifetime
        self.origin = torch.cuda.Event(enable_timing=True)
        self.origin.record()
        self.start: torch.cuda.Event | None = None
        self.pending: deque[tuple[dict[str, Any], torch.cuda.Event, torch.cuda.Event]] = deque()

    def begin(self) -> None:
        self.start = torch.cuda.Event(enable_timing=True)
        self.start.record()

    def end(self, step_id: int, num_seqs: int, num_tokens: int, decode_only: bool) -> None:
        if self.start is None:
            return
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        info = {
            "step_id": step_id,
            "num_seqs": num_seqs,
            "num_tokens": num_tokens,
            "decode_only": decode_only,
        }
        self.pending.append((info, self.start, stop))
        self.start = None
        self._write(wait=False)

    def _write(self, wait: bool) -> None:
        while self.pending and (wait or self.pending[0][2].query()):
            info, start, stop = self.pending.popleft()
            stop.synchronize()
            info["start_ms"] = round(self.origin.elapsed_time(start), 4)
            info["end_ms"] = round(self.origin.elapsed_time(stop), 4)
            self.file.write(json.dumps(info) + "\n")
        self.file.flush()

    def close(self) -> None:
        self._write(wait=True)
        self.file.close()


Timeline = NullTimeline | StepTimeline


def make_timeline(device: torch.device) -> Timeline:
    path = os.environ.get(ENV_VAR)
    if not path or device.type != "cuda":
        return NullTimeline()
    return StepTimeline(path)


@dataclass(frozen=True)
class BusySummary:
    num_runs: int  # stretches of consecutive decode-only steps measured
    num_steps: int
    busy_ms: float  # sum of the steps' spans
    wall_ms: float  # sum over the stretches of (last end - first start)

    @property
    def busy_fraction(self) -> float:
        return self.busy_ms / self.wall_ms if self.wall_ms > 0 else float("nan")

    @property
    def mean_gap_ms(self) -> float:
        gaps = self.num_steps - self.num_runs
        return (self.wall_ms - self.busy_ms) / gaps if gaps > 0 else float("nan")


def read_timeline(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def steady_decode_busy(
    records: Iterable[dict[str, Any]], min_seqs: int, min_steps: int = 8, skip: int = 2
) -> BusySummary:
    """GPU busy time over wall time in steady decode: stretches of consecutive steps (by step id)
    that are decode-only with at least min_seqs requests; the first `skip` steps of a stretch
    are dropped (the step after a prefill still waits on it), and stretches left shorter than
    min_steps are ignored.

        steps:  |prefill|d|d|d|d|d|d|prefill|d|d| ...
        runs:           <-skip->|<-measured->|
    """
    runs: list[list[dict[str, Any]]] = [[]]
    for r in sorted(records, key=lambda r: r["step_id"]):
        if not (r["decode_only"] and r["num_seqs"] >= min_seqs):
            runs.append([])  # ends the stretch
        elif runs[-1] and r["step_id"] == runs[-1][-1]["step_id"] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    kept = [run[skip:] for run in runs if run and len(run) - skip >= min_steps]
    busy = sum(r["end_ms"] - r["start_ms"] for run in kept for r in run)
    wall = sum(run[-1]["end_ms"] - run[0]["start_ms"] for run in kept)
    return BusySummary(len(kept), sum(len(run) for run in kept), busy, wall)
