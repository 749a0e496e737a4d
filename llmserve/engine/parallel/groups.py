"""Tensor and pipeline parallelism on torch.distributed (NCCL between GPUs, gloo on CPUs).

An engine group is T x P ranks, one process each: T ranks split every layer of a stage, P
stages split the layers. Rank 0, the driver, is in the last stage: it samples, broadcasts the
tokens, and is the only rank that talks gRPC to the scheduler.

    rank:   0 .. T-1        T .. 2T-1      ...   (P-1)T .. PT-1
    stage:  P-1 (last)      P-2                  0 (embeddings, first layers)

The driver forwards each plan to every rank on a gloo control group as it arrives; any rank's
loss ends the whole group, which restarts as one (engine/parallel/ranks.py starts the ranks).
See docs/parallelism.md#tensor-and-pipeline-parallelism.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from llmserve.common.log import get_logger
from llmserve.common.model_config import ModelConfig

log = get_logger("engine")

# A step's collectives fail after this long without their peers (a hung or vanished rank); the
# control group, where ranks wait for the next plan, waits as long as the server is idle.
STEP_TIMEOUT = timedelta(minutes=5)
CONTROL_TIMEOUT = timedelta(days=7)
DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class Topology:
    """Where one rank sits in a T x P group."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def stage(self) -> int:
        return self.pp_size - 1 - self.rank // self.tp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def rank_at(self, stage: int, tp_rank: int) -> int:
        return (self.pp_size - 1 - stage) * self.tp_size + tp_rank

    def stage_ranks(self, stage: int) -> list[int]:
        return [self.rank_at(stage, t) for t in range(self.tp_size)]


def split_layers(num_layers: int, pp_size: int, stage: int) -> range:
    """Stage `stage`'s layers: contiguous, as even as can be, the earlier stages taking the extra
    ones (the last stage also runs the LM head and sampling)."""
    base, extra = divmod(num_layers, pp_size)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class TPGroup:
    """The ranks of one stage, which split each layer between them. size 1: every op is a no-op."""

    def __init__(self, rank: int = 0, size: int = 1, group: Any = None):
        self.rank, self.size, self.group = rank, size, group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the stage's ranks, in place."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x side by side along the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class ModelShard:
    """The part of the model one rank holds: its stage's layers, split T ways."""

    tp: TPGroup
    layers: range
    num_layers: int

    @property
    def first(self) -> bool:
        """Holds the embeddings."""
        return self.layers.start == 0

    @property
    def last(self) -> bool:
        """Holds the final norm and the LM head."""
        return self.layers.stop == self.num_layers

    @property
    def is_whole(self) -> bool:
        return self.tp.size == 1 and self.first and self.last


def whole_model(num_layers: int) -> ModelShard:
    return ModelShard(TPGroup(), range(num_layers), num_layers)


def shard_config(config: ModelConfig, shard: ModelShard) -> ModelConfig:
    """The shape one rank's attention, MLP and KV pool see: its heads, MLP width and layers
    (their layer_types too, numbered from the stage's first: the model itself reads the whole
    config by the whole model's layer numbers)."""
    t = shard.tp.size
    layers = shard.layers
    delta_net = config.gated_delta_net.split(t) if config.gated_delta_net is not None else None
    mamba2 = config.mamba2.split(t) if config.mamba2 is not None else None
    layout = config.state_layout
    if delta_net is not None or mamba2 is not None:  # a hybrid's state: this rank's heads
        layout = (delta_net or mamba2).layout()  # type: ignore[union-attr]
    return replace(
        config,
        num_heads=config.num_heads // t,
        num_kv_heads=config.num_kv_heads // t,
        intermediate_size=config.intermediate_size // t,
        num_layers=len(layers),
        layer_types=config.layer_types[layers.start : layers.stop],
        gated_delta_net=delta_net,
        mamba2=mamba2,
        state_layout=layout,
    )


class Parallel:
    """This process's membership of an engine group, once joined: its topology, its stage's
    tensor-parallel group, and the channels between ranks (plans, activations, tokens)."""

    def __init__(
        self,
        topology: Topology,
        rendezvous: str,
        device: torch.device,
        num_layers: int,
        ranks_on_node: int = 1,
    ) -> None:
        """Join the group (blocks until all world_size ranks have). rendezvous: where the ranks
        meet, an init_method (tcp://node0:port, or file:///path on one node); ranks_on_node:
        how many share this machine (and its memory)."""
        self.topology = t = topology
        self.device = device
        self.ranks_on_node = ranks_on_node
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=rendezvous,
            world_size=t.world_size,
            rank=t.rank,
            timeout=STEP_TIMEOUT,
        )
        # Every rank creates every group, in the same order (torch.distributed's rule).
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        stage_groups = [dist.new_group(t.stage_ranks(s)) for s in range(t.pp_size)]
        self.tp = TPGroup(t.tp_rank, t.tp_size, stage_groups[t.stage])
        self.shard = ModelShard(self.tp, split_layers(num_layers, t.pp_size, t.stage), num_layers)
        self.control_lock = threading.Lock()
        self.pending_sends: list[Any] = []
        log.info(
            "joined the engine group",
            rank=t.rank,
            world_size=t.world_size,
            tp_rank=t.tp_rank,
            stage=t.stage,
            layers=f"{self.shard.layers.start}-{self.shard.layers.stop - 1}",
            backend=backend,
        )

    # -- set-up ----------------------------------------------------------------------------------

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (e.g. KV blocks: the pool is one block space)."""
        x = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.control)
        return int(x.item())

    # -- the control channel: the driver's plans, resets and stops, in order ----------------------

    def send_control(self, kind: str, payload: bytes = b"") -> None:
        """Driver: hand a message to every other rank (returns once they all have it)."""
        assert self.topology.is_driver
        with self.control_lock:
            dist.broadcast_object_list([(kind, payload)], src=0, group=self.control)

    def receive_control(self) -> tuple[str, bytes]:
        """Other ranks: the driver's next message (blocks while the server is idle)."""
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        kind, payload = box[0]
        return str(kind), bytes(payload)

    # -- activations between stages ---------------------------------------------------------------

    def send_activations(self, carried: torch.Tensor) -> None:
        """This stage's output (stacked hidden and residual) to the next stage's rank of the same
        tp rank, without waiting for it to arrive (the previous step's send is waited for
        first: the buffer must live until then)."""
        t = self.topology
        self._wait_sends()
        carried = carried.contiguous()
        self.pending_sends = [carried, dist.isend(carried, t.rank_at(t.stage + 1, t.tp_rank))]

    def receive_activations(
        self, num_tokens: int, hidden_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """The previous stage's output for a step of num_tokens tokens: [2, num_tokens,
        hidden_size] (hidden, residual)."""
        t = self.topology
        carried = torch.empty(2, num_tokens, hidden_size, dtype=dtype, device=self.device)
        dist.recv(carried, t.rank_at(t.stage - 1, t.tp_rank))
        return carried

    def _wait_sends(self) -> None:
        if self.pending_sends:
            self.pending_sends[1].wait()
            self.pending_sends = []

    # -- sampled tokens: the driver's, to every rank ----------------------------------------------

    def share_tokens(self, sampled: torch.Tensor) -> Any:
        """Broadcast the driver's sampled tokens into every rank's `sampled` (same shape);
        returns the pending work (wait() before reading them) on the other ranks, None on the
        driver (sent)."""
        if self.topology.is_driver:
            dist.broadcast(sampled, src=0)
            return None
        return dist.broadcast(sampled, src=0, async_op=True)

    def close(self) -> None:
        self._wait_sends()
        if dist.is_initialized():
            dist.destroy_process_group()


def threads_per_rank(ranks_on_node: int) -> int:
    """CPU threads each rank of a node gets: the cores shared evenly, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // ranks_on_node)
