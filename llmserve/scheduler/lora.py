"""Which LoRA adapters run in each step, and in which of the engine's device slots they sit.

The engine has max_loras slots (EngineInfo.max_loras); a step holds requests of at most that
many distinct adapters (the base model is free). The scheduler mirrors the slot table and alone
changes it, by listing loads in the plan. `begin_step` picks the step's adapters, least recently
served first, so none starves; a new adapter takes an empty slot, else the least recently
served one no request of this step uses. A request runs on the adapter version it was admitted
under: slots, loads and the prefix cache are keyed by the version (`name`, `name@2`, ...).
See docs/lora.md#how-a-step-runs and #replacing-an-adapter.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from llmserve.common.step_plan import LoraLoad

# Adapter names: letters, digits, '.', '_', '-', optionally one '/' (as "org/name"); no path
# climbing, no spaces or control characters (names are listed to every client and logged).
LORA_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
MAX_LORA_NAME_CHARS = 64


def check_lora_name(name: str) -> str | None:
    """Why name cannot name an adapter (None: it can)."""
    if not LORA_NAME.fullmatch(name) or len(name) > MAX_LORA_NAME_CHARS or ".." in name:
        return (
            f"lora_name={name[:80]!r}: an adapter name is 1-{MAX_LORA_NAME_CHARS} letters, "
            "digits, '.', '_' or '-' (one '/' allowed, as in org/name; no '..')"
        )
    return None


@dataclass
class LoraTable:
    max_loras: int = 0
    # Registered adapters: name -> PEFT directory of its current version. `removed`: unloaded
    # by the operator; new requests are refused, those admitted before keep running.
    paths: dict[str, str] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)
    # name -> its current version (1 at the first load); every version's key -> its directory
    # (kept: a request admitted under an old version runs on it to the end).
    versions: dict[str, int] = field(default_factory=dict)
    key_paths: dict[str, str] = field(default_factory=dict)
    # slots[k]: the adapter in slot k + 1 ("" empty), as the engine will hold it once the loads
    # planned so far have run.
    slots: list[str] = field(default_factory=list)
    last_served: dict[str, int] = field(default_factory=dict)
    # The step being planned: its adapters, the adapters running requests may use (None: any),
    # and the loads not yet put in a plan.
    step: set[str] = field(default_factory=set)
    allowed: set[str] | None = None
    loads: list[LoraLoad] = field(default_factory=list)
    step_id: int = 0

    def resize(self, max_loras: int) -> None:
        """Adopt an engine with max_loras slots, all empty (a new engine holds none)."""
        self.max_loras = max_loras
        self.slots = [""] * max_loras
        self.loads.clear()

    def next_key(self, name: str, path: str, replace: bool = False) -> str:
        """The key `register(name, path, replace)` will serve name under: its current one when
        the same directory is loaded again, a new version's when replacing."""
        if name not in self.versions:
            return name
        if replace or self.paths[name] != path:
            return version_key(name, self.versions[name] + 1)
        return self.key_of(name)

    def register(self, name: str, path: str, replace: bool = False) -> str:
        """Serve adapter name from path (again, if it was removed); its key. A name served from
        another directory, or with replace, gets a new version: requests admitted from now on run
        on it, those admitted before keep theirs (the caller refuses a replacement not asked
        for: scheduler/service/service.py's LoadLora)."""
        key = self.next_key(name, path, replace)
        if name not in self.versions or key != self.key_of(name):
            self.versions[name] = self.versions.get(name, 0) + 1
        self.key_paths[key] = path
        self.paths[name] = path
        self.removed.discard(name)
        return key

    def key_of(self, name: str) -> str:
        """The key requests of adapter name ("": the base) admitted now run under."""
        return version_key(name, self.versions[name]) if name else ""

    def unregister(self, name: str) -> None:
        """Refuse new requests for name; those already admitted keep it (the slot is reused
        only once no step needs it)."""
        self.removed.add(name)

    def is_servable(self, name: str) -> bool:
        return name in self.paths and name not in self.removed

    def begin_step(self, step_id: int, demand: list[str]) -> None:
        """Start planning step step_id. demand: the adapter keys of the running requests that
        may run, oldest request first ("" for the base)."""
        self.step = set()
        order = list(dict.fromkeys(name for name in demand if name))
        self.allowed = None
        if len(order) > self.max_loras:
            chosen = sorted(
                order,
                key=lambda n: (self.last_served.get(n, 0), n not in self.slots, order.index(n)),
            )
            self.allowed = set(chosen[: self.max_loras])
        self.step_id = step_id

    def admit(self, name: str, running: bool) -> bool:
        """Whether a request of adapter key name ("": the base) may be in this step; if so its
        adapter is in the step from now on, loaded into a slot if it is not resident."""
        if not name or name in self.step:
            return True
        if running and self.allowed is not None and name not in self.allowed:
            return False
        if len(self.step) >= self.max_loras:
            return False
        if name not in self.slots:
            free = [k for k, held in enumerate(self.slots) if held not in self.step]
            if not free:
                return False
            k = min(
                free, key=lambda k: (self.slots[k] != "", self.last_served.get(self.slots[k], 0))
            )
            self.slots[k] = name
            self.loads.append(LoraLoad(k + 1, name, self.key_paths[name]))
        self.step.add(name)
        self.last_served[name] = self.step_id
        return True

    def slot_of(self, name: str) -> int:
        """The slot a request of adapter key name runs under (0: the base)."""
        return self.slots.index(name) + 1 if name else 0

    def take_loads(self) -> list[LoraLoad]:
        """The loads planned since the last plan, for the plan being made."""
        loads, self.loads = self.loads, []
        return loads


def version_key(name: str, version: int) -> str:
    """Adapter name's key at version: the name for the first, name@N after."""
    return name if version == 1 else f"{name}@{version}"
