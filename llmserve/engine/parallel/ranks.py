"""The processes of an engine group (engine/parallel/groups.py): `llmserve engine` with T x P > 1
ranks runs `run_node`, which starts this node's other ranks as child processes (`python -m
engine.ranks`, their settings through stdin) and becomes its node's first rank: on node 0 the
driver, which serves the Step stream (engine/contract/service.py); elsewhere a rank that executes
the driver's plans. Node R of --nnodes N holds ranks R*k .. (R+1)*k-1. The group lives and dies as
one (a child's exit ends its node, a failed collective ends a rank), and whoever supervises
the processes starts them again: docs/parallelism.md#across-machines.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from llmserve.common.log import get_logger
from llmserve.common.model_config import check_parallel_sizes, load_model_config, resolve_model_path
from llmserve.engine.config import EngineConfig
from llmserve.engine.parallel.groups import (
    DEFAULT_MASTER_PORT,
    Parallel,
    Topology,
    threads_per_rank,
)

log = get_logger("engine")


@dataclass(frozen=True)
class RankPlace:
    """Where one rank runs: its global rank, its index on its node, the node's rank count, and
    the rendezvous (torch.distributed's init_method)."""

    rank: int
    local_rank: int
    ranks_on_node: int
    rendezvous: str


def node_places(config: EngineConfig) -> list[RankPlace]:
    """This node's ranks, its first one first. One node meets through a file and talks over
    loopback (nothing listens on the network); several meet at tcp://master_addr:master_port."""
    per_node = config.world_size // config.nnodes
    first = config.node_rank * per_node
    if config.nnodes == 1 and not config.master_port:
        directory = tempfile.mkdtemp(prefix="llmserve-group-")
        rendezvous = f"file://{directory}/rendezvous"
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    else:
        port = config.master_port or DEFAULT_MASTER_PORT
        rendezvous = f"tcp://{config.master_addr}:{port}"
    return [RankPlace(first + i, i, per_node, rendezvous) for i in range(per_node)]


def _remove_rendezvous(place: RankPlace) -> None:
    """Delete the directory of a one-node group's rendezvous file (node_places made it)."""
    if place.rendezvous.startswith("file://"):
        shutil.rmtree(Path(place.rendezvous.removeprefix("file://")).parent, True)


def rank_config(config: EngineConfig, place: RankPlace) -> EngineConfig:
    """On a CPU, each rank of a node gets its share of the cores (unless --num-threads says)."""
    if config.num_threads or config.device == "cuda":
        return config
    if config.device == "auto" and torch.cuda.is_available():
        return config
    return replace(config, num_threads=threads_per_rank(place.ranks_on_node))


def rank_device(config: EngineConfig, place: RankPlace) -> torch.device:
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda: torch sees no CUDA device")
        torch.cuda.set_device(place.local_rank)
        return torch.device("cuda", place.local_rank)
    return torch.device("cpu")


def check_group(config: EngineConfig) -> None:
    """Raise ValueError when the model does not split T x P ways (before any rank starts)."""
    model_config = load_model_config(resolve_model_path(config.model))
    why = check_parallel_sizes(
        model_config, config.tensor_parallel_size, config.pipeline_parallel_size
    )
    if why:
        raise ValueError(why)


def join_group(config: EngineConfig, place: RankPlace) -> tuple[EngineConfig, Parallel]:
    """Join the group as place.rank (blocks until every rank has): the rank's config and its
    membership."""
    config = rank_config(config, place)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = rank_device(config, place)
    num_layers = load_model_config(resolve_model_path(config.model)).num_layers
    topology = Topology(config.tensor_parallel_size, config.pipeline_parallel_size, place.rank)
    return config, Parallel(topology, place.rendezvous, device, num_layers, place.ranks_on_node)


def run_node(config: EngineConfig) -> int:
    """Run this node's part of the engine group until SIGTERM / SIGINT (node 0: serving the
    Step stream) or until any rank of the group dies. Returns the exit code the process must
    end with, through os._exit (0: it stopped as asked; 1: it failed), as a rank child does:
    a normal interpreter exit runs the process group's C++ destructors while gloo's threads
    still wait on peers that are gone, and those abort the process ("terminate called without
    an active exception", SIGABRT)."""
    from llmserve.engine.step.engine import Engine

    check_group(config)
    places = node_places(config)
    children = [_spawn(config, place) for place in places[1:]]
    watcher = _ChildWatcher(children, places[1:])
    code = 1
    try:
        rank_config_, parallel = join_group(config, places[0])
        engine = Engine(rank_config_, parallel)
        if parallel.topology.is_driver:
            from llmserve.engine.contract.service import serve

            serve(engine, config, group=parallel)
        else:
            run_rank(engine, parallel)
        code = 0
    except BaseException:
        log.exception("engine rank failed", rank=places[0].rank)
    finally:
        watcher.stopping = True
        for child in children:
            if child.stdin is not None:
                child.stdin.close()
        _remove_rendezvous(places[0])
    return code


def run_rank(engine: object, parallel: Parallel) -> None:
    """A rank other than the driver: execute the driver's plans, in order, until it says stop.
    A plan the mirror refuses is refused by the driver too (same mirror), which ends that Step
    stream: the plans forwarded after it, which the driver never runs, are skipped until the
    reset that starts the next stream (running one would wait forever for the driver's part)."""
    from llmserve.engine.contract.convert import plan_from_proto
    from llmserve.engine.contract.mirror import MirrorMismatch
    from llmserve.engine.step.engine import Engine
    from llmserve.protos import engine_pb2

    assert isinstance(engine, Engine)
    refused = False
    while True:
        kind, payload = parallel.receive_control()
        if kind == "plan" and not refused:
            plan = plan_from_proto(engine_pb2.StepPlan.FromString(payload))
            try:
                engine.launch(plan)
            except MirrorMismatch as err:
                log.warning("plan disagrees with the mirror", step_id=plan.step_id, error=str(err))
                refused = True
        elif kind == "reset":
            engine.reset()
            refused = False
        elif kind == "stop":
            return


def run_group_locally(
    config: EngineConfig, work: Callable[[Any, Parallel], Any], timeout: float = 300.0
) -> list[Any]:
    """Start config's T x P ranks as child processes of this one (one node, meeting over
    loopback), build each rank's Engine, run work(engine, parallel) on every rank and return
    what each returned, by rank (tests and benchmarks; `work` must be picklable: a module-level
    function). Raises RuntimeError naming the rank that failed or did not answer."""
    # forkserver with the engine preloaded: each rank is a fork of a process that has imported
    # torch and the engine once (but run nothing, so no thread pool is forked), not a fresh
    # interpreter importing them again (~3 s of CPU per rank). `serve` starts its ranks as
    # fresh processes instead (_spawn).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["llmserve.engine.step.engine"])
    results = ctx.Queue()
    places = node_places(replace(config, nnodes=1, node_rank=0, master_port=0))
    procs = [
        ctx.Process(target=_run_work, args=(config, place, work, results), daemon=True)
        for place in places
    ]
    for proc in procs:
        proc.start()
    got: dict[int, Any] = {}
    try:
        while len(got) < len(procs):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise RuntimeError(f"ranks {sorted(set(range(len(procs))) - set(got))} did not "
                                   f"answer in {timeout} s") from None  # fmt: skip
            if not ok:
                raise RuntimeError(f"rank {rank} failed: {value}")
            got[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        _remove_rendezvous(places[0])
    return [got[r] for r in range(len(procs))]


def _run_work(
    config: EngineConfig, place: RankPlace, work: Callable[[Any, Parallel], Any], results: Any
) -> None:
    from llmserve.engine.step.engine import Engine

    try:
        rank_config_, parallel = join_group(config, place)
        value = work(Engine(rank_config_, parallel), parallel)
        results.put((place.rank, True, value))
        parallel.close()
    except BaseException as err:
        results.put((place.rank, False, repr(err)))


class _ChildWatcher:
    """Ends this process (exit 1) as soon as one of its rank children exits, unless it is
    stopping: the group restarts as one."""

    def __init__(self, children: list[subprocess.Popen[bytes]], places: list[RankPlace]):
        self.stopping = False
        for child, place in zip(children, places, strict=True):
            threading.Thread(
                target=self._watch, args=(child, place), name=f"rank-{place.rank}", daemon=True
            ).start()

    def _watch(self, child: subprocess.Popen[bytes], place: RankPlace) -> None:
        code = child.wait()
        if self.stopping:
            return
        log.error(
            "an engine rank exited; ending the group so that it restarts as one",
            rank=place.rank,
            exit_code=code,
        )
        os._exit(1)


def _spawn(config: EngineConfig, place: RankPlace) -> subprocess.Popen[bytes]:
    from llmserve.common.flags import to_json

    proc = subprocess.Popen(
        [sys.executable, "-m", "llmserve.engine.parallel.ranks"],
        stdin=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdin is not None
    line = json.dumps({"config": to_json(config), "place": asdict(place)})
    proc.stdin.write(line.encode() + b"\n")
    proc.stdin.flush()  # kept open: its end (we exited) ends the child
    return proc


def _child_main() -> None:
    """A rank child: read its settings, watch stdin (EOF: the parent is gone, so are we), join
    the group and execute plans. Any failure ends it (exit 1): the group restarts."""
    from llmserve.common.flags import from_json
    from llmserve.common.log import bind, configure

    settings = json.loads(sys.stdin.readline())
    config = from_json({"EngineConfig": EngineConfig}, settings["config"])
    place = RankPlace(**settings["place"])

    def watch() -> None:
        sys.stdin.read()
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    configure("engine")
    bind(rank=place.rank)
    try:
        from llmserve.engine.step.engine import Engine

        rank_config_, parallel = join_group(config, place)
        run_rank(Engine(rank_config_, parallel), parallel)
    except BaseException:
        log.exception("engine rank failed", rank=place.rank)
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    _child_main()
