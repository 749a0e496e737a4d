"""The engine's LoRA adapters: a host-memory cache of checked adapters (least recently used out,
--max-cpu-loras) in front of the device slot table (engine/features/lora.py, --max-loras).

Which adapter sits in which slot is the scheduler's decision, carried by the plan
(StepPlanData.lora_loads); the cache only saves reading a file again. AddLora checks an adapter
and caches it, so that a bad one is refused when it is registered, by name, not when a request
first uses it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from llmserve.common.families import family_refusal
from llmserve.common.log import get_logger
from llmserve.common.model_config import ModelConfig
from llmserve.common.step_plan import LoraLoad
from llmserve.engine.config import EngineConfig
from llmserve.engine.features.lora import LoraSlots, cpu_lora_ready, kernel_self_check
from llmserve.engine.features.lora_files import LoraAdapter, LoraError, read_adapter
from llmserve.engine.model.ops import LayerOps
from llmserve.engine.parallel.groups import ModelShard

log = get_logger("engine")


class Adapters:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        shard: ModelShard,
        dtype: torch.dtype,
        device: torch.device,
        ops: LayerOps | None = None,
    ):
        """ops: the model's backend; with the CUDA kernels (KernelOps), kernels/lora.cu is
        checked against its reference here, and a kernel that fails or disagrees stops the
        engine with the reason (as the int8 kernel does), before any request runs."""
        if ops is not None and ops.name == "cuda":
            why = kernel_self_check(ops.lib.lora_add, dtype, device)
            if why is not None:
                raise RuntimeError(f"--max-loras {config.max_loras} on the CUDA kernels: {why}")
        if device.type == "cpu" and dtype == torch.float32:
            # Built here, before the engine serves: a first build (about 20 s of g++) inside a
            # step would stall it long enough for the scheduler to count the engine down.
            ready = cpu_lora_ready()
            log.info("cpu lora kernel", batch_invariant=ready)
        self.model_config = model_config
        self.max_rank = config.max_lora_rank
        self.capacity = config.max_cpu_loras
        self.slots = LoraSlots(
            model_config, shard, config.max_loras, config.max_lora_rank, dtype, device
        )
        self.cache: OrderedDict[str, LoraAdapter] = OrderedDict()

    def add(self, name: str, path: str) -> LoraAdapter:
        """Read and check the adapter at path (LoraError naming it and the reason), and keep it
        in the host cache as the most recently used, dropping the least recently used one past
        --max-cpu-loras. An adapter of the same name is replaced."""
        if not name:
            raise LoraError("an adapter needs a name (lora_name)")
        why = family_refusal(self.model_config.family, ["lora"])
        if why is not None:
            raise LoraError(f"adapter {name}: {why}")
        adapter = read_adapter(name, path, self.model_config, self.max_rank)
        self.cache.pop(name, None)
        self.cache[name] = adapter
        while len(self.cache) > self.capacity:
            dropped, _ = self.cache.popitem(last=False)
            log.info("lora dropped from the host cache", lora_name=dropped)
        return adapter

    def remove(self, name: str) -> None:
        """Drop name from the host cache (the slots are the plan's: a slot holding it keeps it
        until the scheduler places another adapter there)."""
        self.cache.pop(name, None)

    def place(self, load: LoraLoad) -> None:
        """Put load.lora_name in slot load.slot: from the host cache when it holds that adapter
        for that path, else read from load.path (and cached). Raises LoraError."""
        adapter = self.cache.get(load.lora_name)
        if adapter is None or (load.path and adapter.path != load.path):
            adapter = self.add(load.lora_name, load.path)
        else:
            self.cache.move_to_end(load.lora_name)
        self.slots.place(load.slot, adapter)

    def place_all(self, loads: list[LoraLoad]) -> dict[int, str]:
        """Place each of a plan's loads; {slot: why} for those that failed (the slot is emptied:
        the requests planned under it are refused with the reason)."""
        failed: dict[int, str] = {}
        for load in loads:
            try:
                self.place(load)
            except (LoraError, ValueError) as err:
                log.error("lora load failed", lora_name=load.lora_name, error=str(err))
                if 1 <= load.slot <= self.slots.max_loras:
                    self.slots.clear(load.slot)
                failed[load.slot] = str(err)
        return failed
