"""deploy/kubernetes, proved without a cluster: every manifest of each overlay (and the Secret the
kustomization generates) validates offline against the Kubernetes schemas (kubernetes-validate,
strict: an unknown field is an error); the LeaderWorkerSet, a custom resource those schemas lack,
has its pod templates validated as PodTemplates. And the manifests agree with the CLI: every
llmserve container's args parse, its probes and ports are the ports its args give, the gateway
finds the schedulers through a headless Service, each scheduler its engine, every token path is
the mounted Secret, and engines request GPUs.

A multi-node engine's args name the pod's place through the LeaderWorkerSet's variables
($(LWS_LEADER_ADDRESS), $(LWS_WORKER_INDEX)): they are parsed with stand-ins, and each pod asks
for as many GPUs as its node runs ranks (T x P / nnodes).

The pd overlay (prefill / decode disaggregation): a scheduler whose engines are in other pods
names each by its StatefulSet pod's DNS name, <statefulset>-<ordinal>.<headless service>, an
engine of the role its flag says, on the port it listens on, and is the only scheduler; every
engine pod is named once; a decode engine's KV transfer port is a container port and the host it
reports, $(POD_IP), comes from the downward API, as any $(VAR) in args must come from the
container's env."""

from __future__ import annotations

import argparse
import base64
import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from llmserve.cli import build_parser
from llmserve.common.net import LIVENESS_SERVICE
from llmserve.gateway.config import DNS_PREFIX

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("statefulset", "multinode", "pd")
K8S_VERSION = "1.32.0"
TOKEN_SECRET = "llmserve-internal-token"
# What the LeaderWorkerSet controller puts in a pod's environment, as a pod of group 0 sees it.
LWS_STAND_INS = {"$(LWS_LEADER_ADDRESS)": "llmserve-replica-0.llmserve-replica",
                 "$(LWS_WORKER_INDEX)": "1"}  # fmt: skip
LWS_KEYS = {"size", "restartPolicy", "leaderTemplate", "workerTemplate"}
# Variables the container's own env defines (checked in test_every_variable_in_args_is_defined).
ENV_STAND_INS = {"$(POD_IP)": "10.0.0.7"}


def _kustomization(directory: Path) -> list[dict[str, Any]]:
    """The objects `kubectl apply -k directory` creates, as kustomize builds them (resources,
    recursively; the Secret generator with a stand-in token)."""
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects += _kustomization(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for generator in spec.get("secretGenerator", []):
        assert spec["generatorOptions"]["disableNameSuffixHash"], "pods name the Secret exactly"
        keys = [Path(f).name for f in generator["files"]]
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": generator["name"]},
                "type": generator["type"],
                "data": {k: base64.b64encode(b"stand-in-token").decode() for k in keys},
            }
        )
    return objects


@pytest.fixture(scope="module", params=OVERLAYS)
def objects(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return _kustomization(KUBE / request.param)


def _pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    if obj["kind"] == "LeaderWorkerSet":
        lws = spec["leaderWorkerTemplate"]
        return [lws["leaderTemplate"], lws["workerTemplate"]]
    return [spec["template"]] if "template" in spec else []


def _validate(obj: dict[str, Any]) -> None:
    if obj["kind"] != "LeaderWorkerSet":
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        return
    assert obj["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert set(obj["spec"]) == {"replicas", "leaderWorkerTemplate"}
    assert set(obj["spec"]["leaderWorkerTemplate"]) == LWS_KEYS
    for template in _pod_templates(obj):
        as_core = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}}
        kubernetes_validate.validate({**as_core, "template": template}, K8S_VERSION, strict=True)


def test_every_manifest_validates(objects: list[dict[str, Any]]) -> None:
    kinds = sorted(o["kind"] for o in objects)
    assert {"Deployment", "Service", "Secret", "ConfigMap"} <= set(kinds)
    assert "StatefulSet" in kinds or "LeaderWorkerSet" in kinds
    for obj in objects:
        _validate(obj)


def test_validation_catches_a_misspelt_field(objects: list[dict[str, Any]]) -> None:
    """Strict validation rejects an unknown field (so the test above means something), in a
    LeaderWorkerSet's pod templates too."""
    for obj in objects:
        templates = _pod_templates(obj)
        if not templates:
            continue
        broken = copy.deepcopy(obj)
        container = _pod_templates(broken)[-1]["spec"]["containers"][0]
        container["readinessProbes"] = container.pop("readinessProbe", {})
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(broken)


# -- the manifests agree with the CLI --------------------------------------------------------------


def _llmserve_containers(obj: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod template, container) of each container running our image."""
    return [
        (t, c)
        for t in _pod_templates(obj)
        for c in t["spec"]["containers"]
        if c["image"].startswith("llmserve:")
    ]


def _parse(container: dict[str, Any]) -> argparse.Namespace:
    """The container's args as `llmserve` parses them (the LeaderWorkerSet's variables replaced
    by stand-ins)."""
    args = []
    for arg in container["args"]:
        for name, value in {**LWS_STAND_INS, **ENV_STAND_INS}.items():
            arg = arg.replace(name, value)
        args.append(arg)
    try:
        return build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{container['name']}: llmserve refuses {args}")


def _port(probe: dict[str, Any]) -> int:
    return int(probe["grpc"]["port"])


def test_probes_and_ports_are_the_ones_the_args_give(objects: list[dict[str, Any]]) -> None:
    checked = 0
    for obj in [o for o in objects if _pod_templates(o)]:
        for template, container in _llmserve_containers(obj):
            args = _parse(container)
            service = args.command
            ports = {p["containerPort"] for p in container.get("ports", [])}
            if "port" in vars(args) and container.get("readinessProbe"):
                assert _port(container["readinessProbe"]) == args.port
                assert container["readinessProbe"]["grpc"].get("service", "") == ""
                liveness = container["livenessProbe"]["grpc"]
                assert liveness["port"] == args.port
                # The engine's "" is SERVING whenever it is up; the others' says "ready".
                wanted = "" if service == "engine" else LIVENESS_SERVICE
                assert liveness.get("service", "") == wanted, container["name"]
                assert {args.port, args.metrics_port} <= ports
                checked += 1
            if service == "engine" and "startupProbe" in container:
                assert _port(container["startupProbe"]) == args.port
            if service == "engine" and args.engine_role == "decode":  # prefill engines send here
                assert args.kv_transfer_port and args.kv_transfer_port in ports
            if service == "gateway":
                assert args.http_port in ports
            annotations = template["metadata"].get("annotations", {})
            if annotations.get("prometheus.io/scrape") == "true" and service == "scheduler":
                assert int(annotations["prometheus.io/port"]) == args.metrics_port
    assert checked >= 3  # gateway, scheduler, engine


def _services(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}


def _labels_match(selector: dict[str, str], template: dict[str, Any], obj: dict[str, Any]) -> bool:
    """Whether a Service's selector picks template's pods (an LWS adds its own labels to the
    leader: its name and worker-index 0)."""
    labels = dict(template["metadata"].get("labels", {}))
    if obj["kind"] == "LeaderWorkerSet" and template is _pod_templates(obj)[0]:
        labels["leaderworkerset.sigs.k8s.io/name"] = obj["metadata"]["name"]
        labels["leaderworkerset.sigs.k8s.io/worker-index"] = "0"
    return all(labels.get(k) == v for k, v in selector.items())


def _addresses(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """An address flag's values: single-valued (a str) or repeatable (a list; None: not given)."""
    return [value] if isinstance(value, str) else list(value or [])


def _stable_pod(objects: list[dict[str, Any]], address: str) -> tuple[str, int, argparse.Namespace]:
    """(StatefulSet, ordinal, its engine's args) of the pod address names by its stable DNS
    name, <statefulset>-<ordinal>.<service>[.<namespace>...]:<port>: a pod the StatefulSet has,
    through its headless Service, listening there."""
    host, _, port = address.rpartition(":")
    pod, service_name = host.split(".")[:2]
    sets = {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}
    name, _, ordinal = pod.rpartition("-")
    assert name in sets, f"{address}: no StatefulSet {name}"
    spec = sets[name]["spec"]
    assert spec["serviceName"] == service_name, f"{address}: pods of {name} are under another name"
    assert 0 <= int(ordinal) < spec["replicas"], f"{address}: {name} has {spec['replicas']} pods"
    service = _services(objects)[service_name]
    assert service["spec"]["clusterIP"] == "None"  # headless: a DNS record per pod
    assert _labels_match(service["spec"]["selector"], spec["template"], sets[name])
    (engine,) = [_parse(c) for _, c in _llmserve_containers(sets[name])]
    assert engine.command == "engine" and engine.port == int(port), address
    return name, int(ordinal), engine


def test_the_gateway_reaches_every_scheduler_and_each_its_engine(
    objects: list[dict[str, Any]],
) -> None:
    services = _services(objects)
    containers = [(o, t, c, _parse(c)) for o in objects for t, c in _llmserve_containers(o)]
    (gateway,) = [a for *_, a in containers if a.command == "gateway"]
    schedulers = [(o, t, a) for o, t, _, a in containers if a.command == "scheduler"]
    assert schedulers
    for address in gateway.scheduler_address:
        assert address.startswith(DNS_PREFIX), "replicas come and go: look them up"
        name, port = address.removeprefix(DNS_PREFIX).rsplit(":", 1)
        service = services[name]
        assert service["spec"]["clusterIP"] == "None"  # headless: DNS lists every pod
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        for obj, template, args in schedulers:
            assert _labels_match(service["spec"]["selector"], template, obj)
            assert service_port["targetPort"] == args.port
    remote: set[tuple[str, int]] = set()  # engine pods a scheduler reaches in other pods
    for obj, template, args in schedulers:
        # The engine beside it in the pod, on the port the scheduler dials.
        engines = [_parse(c) for c in template["spec"]["containers"] if c["args"][0] == "engine"]
        if engines:
            assert [f"127.0.0.1:{e.port}" for e in engines] == _addresses(args.engine_address)
            continue
        # Engines in pods of their own (pd): an engine serves one scheduler at a time.
        assert len(schedulers) == 1 and obj["kind"] == "Deployment"
        assert obj["spec"]["replicas"] == 1 and obj["spec"]["strategy"]["type"] == "Recreate"
        roles = {"decode": args.engine_address, "prefill": args.prefill_engine_address}
        assert all(_addresses(v) for v in roles.values())
        for role, values in roles.items():
            for address in _addresses(values):
                name, ordinal, engine = _stable_pod(objects, address)
                assert engine.engine_role == role, f"{address} runs a {engine.engine_role} engine"
                remote.add((name, ordinal))
    # A LeaderWorkerSet's workers serve no gRPC: the Service must not pick them.
    for obj in [o for o in objects if o["kind"] == "LeaderWorkerSet"]:
        worker = _pod_templates(obj)[1]
        assert not _labels_match(services["llmserve-replica"]["spec"]["selector"], worker, obj)
    if not remote:
        return
    # Every engine pod named (each flag once per engine).
    every = {
        (o["metadata"]["name"], i)
        for o in objects
        if o["kind"] == "StatefulSet" and all(_parse(c).command == "engine"
                                               for _, c in _llmserve_containers(o))
        for i in range(o["spec"]["replicas"])
    }  # fmt: skip
    assert len(every) == 4  # 2 prefill, 2 decode
    assert remote == every


def test_every_variable_in_args_is_defined(objects: list[dict[str, Any]]) -> None:
    """Kubernetes leaves an undefined $(VAR) in args as it is: each one is the LeaderWorkerSet's
    (in its templates) or in the container's env; $(POD_IP) from the downward API's pod IP."""
    used = 0
    for obj in objects:
        for _, container in _llmserve_containers(obj):
            env = {e["name"]: e for e in container.get("env", [])}
            for arg in container["args"]:
                for var in re.findall(r"\$\((\w+)\)", arg):
                    if obj["kind"] == "LeaderWorkerSet" and f"$({var})" in LWS_STAND_INS:
                        continue
                    assert var in env, f"{container['name']}: $({var}) is in no env"
                    assert f"$({var})" in ENV_STAND_INS, f"no stand-in for $({var})"
                    used += 1
                    if var == "POD_IP":
                        field = env[var]["valueFrom"]["fieldRef"]["fieldPath"]
                        assert field == "status.podIP"
    if any(o["metadata"]["name"] == "llmserve-decode" for o in objects):
        assert used == 1  # the decode engines' --kv-transfer-host


def test_token_otel_and_gpus(objects: list[dict[str, Any]]) -> None:
    services = _services(objects)
    (secret,) = [o for o in objects if o["kind"] == "Secret"]
    assert secret["metadata"]["name"] == TOKEN_SECRET
    collector_ports = {p["port"] for p in services["llmserve-otel-collector"]["spec"]["ports"]}
    for obj in objects:
        for template, container in _llmserve_containers(obj):
            args = _parse(container)
            token = args.internal_token
            assert token.startswith("@"), "never the token itself in a manifest"
            mount = Path(token[1:]).parent
            volumes = {v["name"]: v for v in template["spec"]["volumes"]}
            (mounted,) = [m for m in container["volumeMounts"] if Path(m["mountPath"]) == mount]
            assert mounted["readOnly"]
            assert volumes[mounted["name"]]["secret"]["secretName"] == TOKEN_SECRET
            assert Path(token[1:]).name in secret["data"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            host, port = env["OTEL_EXPORTER_OTLP_ENDPOINT"].removeprefix("http://").split(":")
            assert host == "llmserve-otel-collector" and int(port) in collector_ports
            if args.command == "engine":
                resources = container["resources"]
                gpus = resources["limits"]["nvidia.com/gpu"]
                assert int(gpus) >= 1 and resources["requests"]["nvidia.com/gpu"] == gpus
                assert args.device == "cuda"
                ranks = args.tensor_parallel_size * args.pipeline_parallel_size // args.nnodes
                assert int(gpus) == ranks, f"{args.nnodes} nodes of {ranks} ranks, {gpus} GPUs"
            if args.command == "engine" and args.nnodes > 1:
                assert obj["kind"] == "LeaderWorkerSet", "a multi-node engine is a group of pods"
                size = obj["spec"]["leaderWorkerTemplate"]["size"]
                assert args.nnodes == size, f"--nnodes={args.nnodes}, {size} pods a group"
