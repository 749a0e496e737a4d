"""compose.yaml, proved without Docker: it validates against the Compose specification's schema,
its wiring is consistent (health-ordered start-up, metrics targets, telemetry pipeline), and the
services run exactly as its commands and environment say (CPU profile, addresses rewritten to
loopback, the OTLP endpoint pointed at a receiver in the test) and answer a streamed request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

from common.net import wait_until_serving  # noqa: E402
from llmserve.bench.otlp import OtlpReceiver  # noqa: E402
from llmserve.client import Client, make_request  # noqa: E402
from tests.stack import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "tests" / "data" / "compose-spec.schema.json"
LLMSERVE = ("gateway", "scheduler", "engine", "engine-cpu")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_compose_matches_the_specification(compose: dict[str, Any]) -> None:
    jsonschema.validate(compose, json.loads(SCHEMA.read_text()))


def test_schema_rejects_a_typo(compose: dict[str, Any]) -> None:
    """The schema is strict enough to catch a misspelt key (so the test above means something)."""
    broken = json.loads(json.dumps(compose))
    broken["services"]["gateway"]["healthchek"] = broken["services"]["gateway"].pop("healthcheck")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(SCHEMA.read_text()))


def test_compose_wiring(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(LLMSERVE) | {"otel-collector", "jaeger", "prometheus"} <= set(services)
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert dep in services, f"{name} depends on unknown {dep}"
            assert not services[dep].get("profiles"), f"{name} depends on profiled {dep}"
    # One engine per profile, both reachable as "engine"; the GPU one reserves a GPU.
    assert services["engine"]["profiles"] == ["gpu"]
    assert services["engine-cpu"]["profiles"] == ["cpu"]
    for name in ("engine", "engine-cpu"):
        assert services[name]["networks"]["default"]["aliases"] == ["engine"]
    gpu = services["engine"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert _flag(services["engine"]["command"], "--device") == "cuda"
    assert _flag(services["engine-cpu"]["command"], "--device") == "cpu"
    # Start-up follows health: every llmserve service is checked with `llmserve health` on its
    # own port, and the gateway waits for a healthy scheduler (healthy = engine connected).
    for name in LLMSERVE:
        svc = services[name]
        test = svc["healthcheck"]["test"]
        assert test[:3] == ["CMD", "llmserve", "health"]
        assert test[-1] == f"localhost:{_flag(svc['command'], '--port')}"
    assert services["gateway"]["depends_on"]["scheduler"]["condition"] == "service_healthy"
    assert _flag(services["scheduler"]["command"], "--engine-address") == "engine:50053"
    assert _flag(services["gateway"]["command"], "--scheduler-address") == "scheduler:50052"
    # Every llmserve service exports OTLP to the collector and has its own service name.
    for name in LLMSERVE:
        env = services[name]["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
        assert env["OTEL_SERVICE_NAME"] == f"llmserve-{name.removesuffix('-cpu')}"


def test_prometheus_scrapes_every_metrics_port(compose: dict[str, Any]) -> None:
    services = compose["services"]
    config = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {
        t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]
    }
    for name in ("gateway", "scheduler", "engine"):
        port = _flag(services[name]["command"], "--metrics-port")
        assert f"{name}:{port}" in targets
        assert port in services[name]["expose"]
    assert "otel-collector:8889" in targets
    mounts = services["prometheus"]["volumes"]
    assert "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in mounts


def test_collector_pipelines_are_complete() -> None:
    config = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    for kind in ("traces", "metrics"):
        pipeline = config["service"]["pipelines"][kind]
        for section in ("receivers", "processors", "exporters"):
            for name in pipeline[section]:
                assert name in config[section], f"{kind} pipeline names undefined {name}"
    assert config["exporters"]["otlp/jaeger"]["endpoint"] == "jaeger:4317"


def test_dockerfile_copies_every_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    for package in ("llmserve", "protos", "gateway", "scheduler", "engine", "kernels"):
        assert f"COPY {package}/ {package}/" in text
    assert 'ENTRYPOINT ["llmserve"]' in text


# -- the services, run as compose.yaml says --------------------------------------------------------


def _rewrite(command: list[str], ports: dict[str, int], hosts: dict[str, str]) -> list[str]:
    """compose's command with host names and ports made loopback and free. ports: grpc, metrics,
    http; hosts: "scheduler:50052" -> "127.0.0.1:<port>"."""
    out = [hosts.get(arg, "127.0.0.1" if arg == "0.0.0.0" else arg) for arg in command]
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
    services = compose["services"]
    order = ("engine-cpu", "scheduler", "gateway")
    ports = {
        name: {"grpc": free_port(), "metrics": free_port(), "http": free_port()} for name in order
    }
    hosts = {
        "engine:50053": f"127.0.0.1:{ports['engine-cpu']['grpc']}",
        "scheduler:50052": f"127.0.0.1:{ports['scheduler']['grpc']}",
    }
    receiver = OtlpReceiver().start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in order:
            argv = _rewrite(services[name]["command"], ports[name], hosts)
            env = dict(
                os.environ, PYTHONUNBUFFERED="1", **_environment(services[name], receiver.endpoint)
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
        for name in order:
            test = services[name]["healthcheck"]["test"][2:]  # after CMD llmserve
            test[-1] = f"127.0.0.1:{ports[name]['grpc']}"
            result = subprocess.run([sys.executable, "-m", "llmserve.cli", *test], cwd=ROOT)
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
