"""compose.yaml and the Dockerfile, proved without Docker. compose.yaml (and its overrides
compose.replicas.yaml, compose.pd.yaml) validates against the Compose specification's schema;
under each profile every address a service is given reaches exactly one service listening there
(a decode engine's KV transfer address included), and every llmserve command and health check is
one the CLI accepts; the files the Dockerfile copies hold every package and import on their own;
and the services run exactly as compose's commands and environment say (CPU profile, addresses
rewritten to loopback, the OTLP endpoint pointed at a receiver in the test), answering a streamed
request, their health checks and /metrics, and exporting spans."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path
from typing import Any
from unittest import mock

import grpc
import jsonschema
import pytest
import yaml

from llmserve.bench.otlp import OtlpReceiver
from llmserve.cli import build_parser
from llmserve.client import Client, make_request
from llmserve.common.net import wait_until_serving
from llmserve.protos.scheduler_pb2 import GetInfoRequest
from llmserve.protos.scheduler_pb2_grpc import SchedulerStub
from tests.stack import free_port

pytestmark = pytest.mark.stack  # starts service processes (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = ROOT / "tests" / "data" / "compose-spec.schema.json"
ADDRESS_FLAGS = {
    "--engine-address": "engine",
    "--prefill-engine-address": "engine",
    "--scheduler-address": "scheduler",
}
# The engine role each scheduler flag's engines have, when the scheduler is given prefill engines.
ROLE_FLAGS = {"--engine-address": "decode", "--prefill-engine-address": "prefill"}


REPLICAS = ROOT / "compose.replicas.yaml"  # `-f compose.yaml -f compose.replicas.yaml`
PD = ROOT / "compose.pd.yaml"  # `-f compose.yaml -f compose.pd.yaml`: prefill / decode engines


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _merge(base: Any, override: Any) -> Any:
    """override on top of base as compose merges files: mappings key by key, anything else
    (a command, a volume list) replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        return {k: _merge(base[k], v) if k in base else v for k, v in override.items()} | {
            k: v for k, v in base.items() if k not in override
        }
    return override


def _with(compose: dict[str, Any], override: Path = REPLICAS) -> dict[str, Any]:
    """compose.yaml with override on top (services that `extends` one of compose.yaml's start
    from it)."""
    merged = json.loads(json.dumps(compose))
    for name, svc in yaml.safe_load(override.read_text())["services"].items():
        svc = dict(svc)
        extends = svc.pop("extends", None)
        if extends is not None:
            assert extends["file"] == "compose.yaml"
            base = compose["services"][extends["service"]]
        else:
            base = merged["services"].get(name, {})
        merged["services"][name] = _merge(json.loads(json.dumps(base)), svc)
    return merged


@pytest.mark.parametrize("path", [ROOT / "compose.yaml", REPLICAS, PD], ids=lambda p: p.name)
def test_compose_matches_the_specification(path: Path) -> None:
    jsonschema.validate(yaml.safe_load(path.read_text()), json.loads(SCHEMA.read_text()))


def test_schema_rejects_a_typo(compose: dict[str, Any]) -> None:
    """The schema is strict enough to catch a misspelt key (so the test above means something)."""
    broken = json.loads(json.dumps(compose))
    broken["services"]["gateway"]["healthchek"] = broken["services"]["gateway"].pop("healthcheck")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(SCHEMA.read_text()))


# -- wiring: what each service is told to reach is there -------------------------------------------


def _is_llmserve(svc: dict[str, Any]) -> bool:
    """Built from this repository's Dockerfile, whose entry point is `llmserve`."""
    return "build" in svc


def _args(who: str, argv: list[str], env: dict[str, Any]) -> argparse.Namespace:
    """argv as the llmserve CLI parses it under env (the container's environment)."""
    with mock.patch.dict(os.environ, {k: str(v) for k, v in env.items()}, clear=True):
        try:
            return build_parser().parse_args(argv)
        except SystemExit:
            pytest.fail(f"{who}: llmserve refuses {argv}")


def _command(name: str, svc: dict[str, Any]) -> argparse.Namespace:
    return _args(name, svc["command"], svc.get("environment", {}))


def _active(compose: dict[str, Any], profile: str) -> dict[str, dict[str, Any]]:
    """The services `docker compose --profile <profile> up` starts."""
    return {n: s for n, s in compose["services"].items() if profile in s.get("profiles", [profile])}


def _mounted(svc: dict[str, Any], target: str) -> Path:
    """The file of this repository mounted at target in svc's container."""
    for volume in svc.get("volumes", []):
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == target:
            path = ROOT / source
            assert path.is_file(), f"{source} (mounted at {target}) does not exist"
            return path
    raise AssertionError(f"nothing is mounted at {target}")


def _collector_config(svc: dict[str, Any]) -> dict[str, Any]:
    (flag,) = [a for a in svc["command"] if a.startswith("--config=")]
    return yaml.safe_load(_mounted(svc, flag.removeprefix("--config=")).read_text())


def _endpoints(config: Any) -> list[str]:
    """Every `endpoint` value in an OpenTelemetry collector config."""
    if isinstance(config, dict):
        return [
            e
            for k, v in config.items()
            for e in ([v] if k == "endpoint" and isinstance(v, str) else _endpoints(v))
        ]
    return [e for v in config for e in _endpoints(v)] if isinstance(config, list) else []


def _listening(name: str, svc: dict[str, Any]) -> set[int]:
    """The ports svc really listens on: an llmserve service's as its command says (defaults
    included), the collector's as its mounted config says, any other's as compose exposes."""
    if _is_llmserve(svc):
        args = _command(name, svc)
        if args.command == "internal-token":
            return set()
        transfers = args.kv_transfer_port if getattr(args, "engine_role", "") == "decode" else 0
        return {args.port, args.metrics_port, getattr(args, "http_port", 0), transfers} - {0}
    if name == "otel-collector":
        bound = [e for e in _endpoints(_collector_config(svc)) if e.startswith("0.0.0.0:")]
        return {int(e.rpartition(":")[2]) for e in bound}
    published = [str(p).rpartition(":")[2] for p in svc.get("ports", [])]
    return {int(p) for p in [*svc.get("expose", []), *published]}


def _reach(active: dict[str, dict[str, Any]], who: str, address: str) -> str:
    """The one active service that answers to address's host (its name or a network alias) and
    listens on its port."""
    host, _, port = address.removeprefix("http://").rpartition(":")
    found = [
        name
        for name, svc in active.items()
        if host in {name, *svc.get("networks", {}).get("default", {}).get("aliases", [])}
        and int(port) in _listening(name, svc)
    ]
    assert len(found) == 1, f"{who} -> {address} reaches {found or 'no service'}"
    return found[0]


@pytest.mark.parametrize(
    ("profile", "override"),
    [("cpu", None), ("gpu", None), ("gpu-tp", None), ("cpu", REPLICAS), ("gpu", REPLICAS),
     ("pd-cpu", PD), ("pd-gpu", PD)],
    ids=["cpu", "gpu", "gpu-tp", "cpu+replicas", "gpu+replicas", "pd-cpu", "pd-gpu"],
)  # fmt: skip
# compose.replicas.yaml adds a second replica to the cpu and gpu profiles; compose.pd.yaml has
# profiles of its own, 2 prefill and 2 decode engines under one scheduler.
def test_every_address_reaches_one_listening_service(
    compose: dict[str, Any], profile: str, override: Path | None
) -> None:
    """Under `--profile <profile>`: each scheduler reaches its engines (with prefill engines:
    each engine of the role its flag names) and the gateway the schedulers; a decode engine's KV
    transfer address reaches its own transfer port; OTLP goes to the collector's receiver and on
    to Jaeger; each health check asks its own service's gRPC port; Prometheus scrapes every
    llmserve service's metrics port; every dependency is started, and a health-gated one has a
    health check."""
    active = _active(_with(compose, override) if override else compose, profile)
    commands = {n: _command(n, s) for n, s in active.items() if _is_llmserve(s)}
    llmserve = {n: a for n, a in commands.items() if a.command != "internal-token"}
    assert {a.command for a in llmserve.values()} == {"engine", "scheduler", "gateway"}
    for name, args in llmserve.items():  # each reads the token the init service writes
        (init,) = [n for n, a in commands.items() if a.command == "internal-token"]
        assert args.internal_token == f"@{commands[init].path}", name
        assert active[name]["depends_on"][init]["condition"] == "service_completed_successfully"
        volume = commands[init].path.rpartition("/")[0]
        assert any(v.split(":")[1] == volume for v in active[name]["volumes"]), name
    for name, svc in active.items():
        for dep, spec in svc.get("depends_on", {}).items():
            assert dep in active, f"{name} depends on {dep}, which {profile} does not start"
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in active[dep], f"{name} waits for {dep}'s health"
    reached: dict[str, set[str]] = {}  # role -> the services some address reaches
    for name, args in llmserve.items():
        svc = active[name]
        disaggregated = bool(getattr(args, "prefill_engine_address", ""))
        for flag, role in ADDRESS_FLAGS.items():
            dest = flag.removeprefix("--").replace("-", "_")
            values = getattr(args, dest, None) or []  # a repeatable flag not given: None
            for value in [values] if isinstance(values, str) else values:
                target = _reach(active, f"{name} {flag}", value)
                assert llmserve[target].command == role, f"{name} {flag} reaches {target}"
                if flag in ROLE_FLAGS:  # the role the scheduler's link to it drives
                    want = ROLE_FLAGS[flag] if disaggregated else "both"
                    assert llmserve[target].engine_role == want, f"{name} {flag} -> {target}"
                reached.setdefault(role, set()).add(target)
        if getattr(args, "engine_role", "") == "decode":  # where prefill engines send its KV
            kv = f"{args.kv_transfer_host}:{args.kv_transfer_port}"
            assert args.kv_transfer_host and args.kv_transfer_port, f"{name}: fixed, named"
            assert _reach(active, f"KV transfers to {name}", kv) == name
        otlp = svc["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"]
        assert _reach(active, name, otlp) == "otel-collector"
        test = svc["healthcheck"]["test"]
        assert test[:2] == ["CMD", "llmserve"], f"{name}'s health check runs {test[:2]}"
        health = _args(f"{name} health check", test[2:], svc.get("environment", {}))
        own = f"localhost:{args.port}"
        assert (health.command, health.address) == ("health", own), f"{name}'s health check"
    outbound = [e for e in _endpoints(_collector_config(active["otel-collector"]))
                if not e.startswith("0.0.0.0:")]  # fmt: skip
    for endpoint in outbound:
        _reach(active, "otel-collector", endpoint)
    config = yaml.safe_load(
        _mounted(active["prometheus"], "/etc/prometheus/prometheus.yml").read_text()
    )
    targets = [t for job in config["scrape_configs"] for sc in job["static_configs"]
               for t in sc["targets"]]  # fmt: skip
    scraped = {_reach(active, "prometheus", t): int(t.rpartition(":")[2]) for t in targets}
    assert {n: a.metrics_port for n, a in llmserve.items()}.items() <= scraped.items()
    assert "otel-collector" in scraped
    engines = {n for n, a in llmserve.items() if a.command == "engine"}
    if override != PD:  # each scheduler reached, each reaching its own engine
        num_replicas = 2 if override == REPLICAS else 1
        assert (len(reached["scheduler"]), len(reached["engine"])) == (num_replicas, num_replicas)
        assert reached["engine"] == engines
        return
    # One scheduler given every engine (each flag once per engine): 2 prefill, 2 decode.
    assert len(reached["scheduler"]) == 1
    assert sorted(llmserve[n].engine_role for n in engines) == ["decode"] * 2 + ["prefill"] * 2
    assert reached["engine"] == engines


def test_collector_pipelines_are_complete() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    for kind in ("traces", "metrics"):
        pipeline = config["service"]["pipelines"][kind]
        for section in ("receivers", "processors", "exporters"):
            for name in pipeline[section]:
                assert name in config[section], f"{kind} pipeline names undefined {name}"


# -- the image -------------------------------------------------------------------------------------

# Imports every module of the packages named, from the image's files (cwd) or what is installed
# (sys.path); a module found anywhere else (this checkout, through the editable install) means
# the image lacks it.
IMPORT_ALL = """
import importlib, os, pkgutil, sys
packages = sys.argv[1:]
for name in packages:
    for info in pkgutil.walk_packages(importlib.import_module(name).__path__, name + "."):
        importlib.import_module(info.name)
allowed = tuple(os.path.join(os.path.abspath(p or "."), "") for p in sys.path
                if os.path.isdir(p or "."))
stray = sorted(n for n, m in list(sys.modules.items())
               if os.path.isabs(getattr(m, "__file__", None) or "")
               and not m.__file__.startswith(allowed))
sys.exit(f"imported from outside the image: {stray}" if stray else 0)
"""


def _copy_as_the_dockerfile_does(dest: Path) -> None:
    """Carry out the Dockerfile's COPY instructions from the build context (ROOT) into dest,
    which stands for its WORKDIR."""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if not line.startswith("COPY "):
            continue
        *sources, target = line.split()[1:]
        assert not any(s.startswith("--") for s in sources), f"not simulated: {line}"
        for source in sources:
            src = ROOT / source
            if src.is_dir():
                ignore = shutil.ignore_patterns("__pycache__")
                shutil.copytree(src, dest / target, ignore=ignore, dirs_exist_ok=True)
            else:
                (dest / target).mkdir(parents=True, exist_ok=True)
                shutil.copy(src, dest / target / src.name)


def test_the_image_holds_every_package(tmp_path: Path) -> None:
    """`pip install .` in the image installs the packages pyproject.toml lists from what the
    Dockerfile copied: each must be there, and every module in them imports from those files
    alone."""
    _copy_as_the_dockerfile_does(tmp_path)
    project = tomllib.loads((tmp_path / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted({p.split(".")[0].removesuffix("*") for p in include})
    missing = [p for p in packages if not (tmp_path / p / "__init__.py").is_file()]
    assert not missing, f"the Dockerfile copies no {missing}"
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, *packages],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]


# -- the services, run as compose.yaml says --------------------------------------------------------


SECRETS = "/run/llmserve"  # the volume the internal-token service writes, in the containers


def _rewrite(
    command: list[str], ports: dict[str, int], hosts: dict[str, str], secrets: Path
) -> list[str]:
    """compose's command with host names and ports made loopback and free, and the secrets
    volume a local folder. ports: grpc, metrics, http; hosts: compose's "scheduler:50052" ->
    "127.0.0.1:<port>", and every address flag's value must be one of them."""
    out = [arg.replace(SECRETS, str(secrets)) for arg in command]
    out = ["127.0.0.1" if arg == "0.0.0.0" else arg for arg in out]
    for flag in ADDRESS_FLAGS:
        if flag in out:
            i = out.index(flag) + 1
            assert out[i] in hosts, f"{flag} {out[i]} is no service's gRPC address"
            out[i] = hosts[out[i]]
    for flag, key in (("--port", "grpc"), ("--metrics-port", "metrics"), ("--http-port", "http")):
        if flag in out:
            out[out.index(flag) + 1] = str(ports[key])
    return out


def _environment(svc: dict[str, Any], otlp: str) -> dict[str, str]:
    env = {k: str(v) for k, v in svc.get("environment", {}).items()}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp
    env["OTEL_BSP_SCHEDULE_DELAY"] = "100"
    return env


def test_services_run_as_compose_says(compose: dict[str, Any], tmp_path: Path) -> None:
    """CPU profile: engine-cpu, scheduler, gateway from their compose commands and environment;
    a streamed request is answered, every health check and /metrics answers, spans from all
    three services reach the OTLP endpoint."""
    active = _active(compose, "cpu")
    order = ("engine-cpu", "scheduler", "gateway")
    assert {n for n, svc in active.items() if _is_llmserve(svc)} == {*order, "internal-token"}
    ports = {
        name: {"grpc": free_port(), "metrics": free_port(), "http": free_port()} for name in order
    }
    grpc_port = {name: _command(name, active[name]).port for name in order}
    hosts = {
        f"{host}:{grpc_port[name]}": f"127.0.0.1:{ports[name]['grpc']}"
        for name in order
        for host in [name, *active[name].get("networks", {}).get("default", {}).get("aliases", [])]
    }
    secrets = tmp_path / "secrets"
    init = _rewrite(compose["services"]["internal-token"]["command"], {}, {}, secrets)
    subprocess.run([sys.executable, "-m", "llmserve.cli", *init], cwd=ROOT, check=True)
    receiver = OtlpReceiver().start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in order:
            argv = _rewrite(active[name]["command"], ports[name], hosts, secrets)
            env = dict(
                os.environ, PYTHONUNBUFFERED="1", **_environment(active[name], receiver.endpoint)
            )
            log = open(tmp_path / f"{name}.log", "wb")  # noqa: SIM115
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "llmserve.cli", *argv],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                )
            )  # fmt: skip
        gateway = f"127.0.0.1:{ports['gateway']['grpc']}"
        logs = lambda: "\n".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log"))  # noqa: E731
        assert wait_until_serving(gateway, timeout=180), logs()
        with Client(gateway) as client:
            done = client.generate(
                make_request(text="The capital of France is", max_tokens=4, temperature=0.0)
            )
        assert done.completion_tokens == 4 and done.text
        # The internal links are closed to anyone without the token the init service wrote.
        scheduler = f"127.0.0.1:{ports['scheduler']['grpc']}"
        with grpc.insecure_channel(scheduler) as channel, pytest.raises(grpc.RpcError) as err:
            SchedulerStub(channel).GetInfo(GetInfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for name in order:
            # The health check as compose runs it inside the container, aimed at the test's port.
            check = active[name]["healthcheck"]["test"][2:]  # after CMD llmserve
            own = f"localhost:{grpc_port[name]}"
            assert own in check, f"{name}'s health check does not ask {own}: {check}"
            check[check.index(own)] = f"127.0.0.1:{ports[name]['grpc']}"
            result = subprocess.run([sys.executable, "-m", "llmserve.cli", *check], cwd=ROOT)
            assert result.returncode == 0, f"{name} health check failed"
            url = f"http://127.0.0.1:{ports[name]['metrics']}/metrics"
            body = urllib.request.urlopen(url, timeout=5).read().decode()
            assert "llmserve_" in body or "gen_ai_" in body, f"{name} /metrics is empty"
        want = {"llmserve-gateway", "llmserve-scheduler", "llmserve-engine"}
        assert receiver.wait_for(lambda spans: want <= {s.service for s in spans}), logs()
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        receiver.stop()


def test_each_gpu_engine_reserves_a_gpu_per_rank(compose: dict[str, Any]) -> None:
    """An engine on GPUs asks compose for as many as its node runs ranks (T x P / nnodes), and
    a tensor-parallel one has shared memory for NCCL between them."""
    engines = {n: s for n, s in compose["services"].items() if _is_llmserve(s)}
    checked = 0
    for name, svc in engines.items():
        args = _command(name, svc)
        if args.command != "engine" or args.device != "cuda":
            continue
        ranks = args.tensor_parallel_size * args.pipeline_parallel_size // args.nnodes
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["count"] == ranks, f"{name}: {ranks} ranks, {device['count']} GPUs"
        if ranks > 1:
            assert "shm_size" in svc, f"{name}: {ranks} ranks share no memory for NCCL"
        checked += 1
    assert checked >= 2  # the one-GPU engine and the tensor-parallel one
