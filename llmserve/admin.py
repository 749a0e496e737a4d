"""`llmserve admin ...`: the gateway's Admin service (protos/admin.proto) from the command line.

llmserve admin drain [--timeout S]      stop admitting; wait for what runs (abort it after S)
llmserve admin resume                   admit again
llmserve admin requests [--tenant T]    requests in flight on every replica
llmserve admin abort REQUEST_ID         abort one request (every replica is asked)
llmserve admin capacity                 KV blocks, queues by tenant, steps per second
llmserve admin tenants                  weights, quotas and requests in flight per tenant
llmserve admin set-weight TENANT W      a tenant's weight under the fair policy
llmserve admin set-quota TENANT [--tokens-per-minute N] [--max-concurrent N]   (0: no limit)
llmserve admin health                   the gateway, each scheduler, each engine (exit 1: not all)

Each takes --address (env LLMSERVE_ADDRESS) and --admin-key (env LLMSERVE_ADMIN_KEY), and
--json for machine output (protobuf's JSON mapping: 64-bit integers as strings). The default
tenant is spelled "default".
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llmserve.client import GatewayChannel
from llmserve.common.net import DEFAULT_GATEWAY_PORT


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers], *[[_cell(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def _cell(value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return str(value)


def _tenant(name: str) -> str:
    return name or "(default)"


def _limit(value: int) -> str:
    return str(value) if value else "-"


def _tenants_table(tenants: Sequence[Any]) -> str:
    return _table(
        ["TENANT", "WEIGHT", "TOKENS/MIN", "MAX_CONCURRENT", "IN_FLIGHT"],
        [
            [
                _tenant(t.tenant), t.weight, _limit(t.tokens_per_minute),
                _limit(t.max_concurrent_requests), t.num_in_flight,
            ]
            for t in tenants
        ],
    )  # fmt: skip


def _print_requests(response: Any) -> None:
    rows = [
        [
            e.replica, r.request_id, _tenant(r.tenant), r.state, r.priority, r.num_prompt_tokens,
            r.num_output_tokens, r.num_blocks, r.num_preemptions, r.age_s,
        ]
        for e in response.requests
        for r in [e.request]
    ]  # fmt: skip
    headers = ["REPLICA", "REQUEST_ID", "TENANT", "STATE", "PRIORITY", "PROMPT", "OUTPUT"]
    print(_table([*headers, "BLOCKS", "PREEMPTIONS", "AGE_S"], rows))


def _print_capacity(c: Any) -> None:
    rows: list[list[object]] = [
        [
            r.replica, r.ready, r.draining, r.num_blocks - r.num_free_blocks, r.num_blocks,
            r.num_running, r.num_waiting, r.steps_per_s,
        ]
        for r in c.replicas
    ]  # fmt: skip
    rows.append(
        [
            "total", sum(r.ready for r in c.replicas), "", c.num_blocks - c.num_free_blocks,
            c.num_blocks, c.num_running, c.num_waiting, c.steps_per_s,
        ]
    )  # fmt: skip
    headers = ["REPLICA", "READY", "DRAINING", "BLOCKS_USED", "BLOCKS", "RUNNING", "WAITING"]
    print(_table([*headers, "STEPS/S"], rows))
    tenants = [
        [r.replica, _tenant(t.tenant), t.weight, t.num_waiting, t.num_running, t.num_blocks]
        for r in c.replicas
        for t in r.tenants
    ]
    if tenants:
        print()
        print(_table(["REPLICA", "TENANT", "WEIGHT", "WAITING", "RUNNING", "BLOCKS"], tenants))


def _print_health(h: Any) -> int:
    rows = [[c.component, c.healthy, c.detail] for c in h.components]
    print(_table(["COMPONENT", "HEALTHY", "DETAIL"], rows))
    return 0 if all(c.healthy for c in h.components) else 1


class _Admin:
    """The Admin stub on --address, every call carrying --admin-key."""

    def __init__(self, args: argparse.Namespace):
        from llmserve.common.auth import read_secret
        from llmserve.protos import admin_pb2_grpc

        self.gateway = GatewayChannel(args.address, read_secret(args.admin_key))
        self.stub = admin_pb2_grpc.AdminStub(self.gateway.channel)
        self.timeout = getattr(args, "timeout", None)

    def __call__(self, method: str, request: Any, stream: bool = False) -> Any:
        timeout = None if stream else self.timeout
        return getattr(self.stub, method)(request, metadata=self.gateway.metadata, timeout=timeout)


def _json(message: Any) -> None:
    from google.protobuf.json_format import MessageToJson

    print(
        MessageToJson(
            message,
            preserving_proto_field_name=True,
            indent=None,
            always_print_fields_with_no_presence=True,
        )
    )


def _run(args: argparse.Namespace) -> int:
    import grpc

    admin = _Admin(args)
    try:
        return int(args.action(admin, args))
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    finally:
        admin.gateway.close()


def _drain(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import admin_pb2

    shown: tuple[int, float] | None = None  # (in flight, elapsed) of the last line printed
    for p in admin("Drain", admin_pb2.DrainRequest(timeout_s=args.timeout_s), stream=True):
        if args.json:
            _json(p)
        elif p.done:
            print(f"done: drained in {p.elapsed_s:.1f} s, {p.num_aborted} aborted at the timeout")
        elif shown is None or p.num_in_flight != shown[0] or p.elapsed_s - shown[1] >= 5.0:
            # The server reports several times a second; a line when the count changes or
            # every 5 s is enough to watch.
            print(f"draining: {p.num_in_flight} in flight after {p.elapsed_s:.1f} s", flush=True)
            shown = (p.num_in_flight, p.elapsed_s)
    return 0


def _resume(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import admin_pb2

    admin("Resume", admin_pb2.ResumeRequest())
    print("{}" if args.json else "resumed: admitting again")
    return 0


def _requests(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import admin_pb2

    response = admin("ListRequests", admin_pb2.ListRequestsRequest(tenant=args.tenant or ""))
    _json(response) if args.json else _print_requests(response)
    return 0


def _abort(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import admin_pb2

    response = admin("AbortRequest", admin_pb2.AbortRequestRequest(request_id=args.request_id))
    if args.json:
        _json(response)
    else:
        print(f"aborted {response.num_aborted} sequence(s) of {args.request_id}")
    return 0


def _capacity(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import admin_pb2

    response = admin("GetCapacity", admin_pb2.GetCapacityRequest())
    _json(response) if args.json else _print_capacity(response)
    return 0


def _tenants(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import admin_pb2

    response = admin("ListTenants", admin_pb2.ListTenantsRequest())
    _json(response) if args.json else print(_tenants_table(response.tenants))
    return 0


def _set_weight(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import admin_pb2

    request = admin_pb2.SetTenantWeightRequest(tenant=args.tenant, weight=args.weight)
    response = admin("SetTenantWeight", request)
    _json(response) if args.json else print(_tenants_table([response]))
    return 0


def _set_quota(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import admin_pb2

    if args.tokens_per_minute is None and args.max_concurrent is None:
        print("error: give --tokens-per-minute, --max-concurrent or both", file=sys.stderr)
        return 2
    request = admin_pb2.SetQuotaRequest(tenant=args.tenant)
    if args.tokens_per_minute is not None:
        request.tokens_per_minute = args.tokens_per_minute
    if args.max_concurrent is not None:
        request.max_concurrent_requests = args.max_concurrent
    response = admin("SetQuota", request)
    _json(response) if args.json else print(_tenants_table([response]))
    return 0


def _health(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import admin_pb2

    response = admin("GetHealth", admin_pb2.GetHealthRequest())
    if args.json:
        _json(response)
        return 0 if all(c.healthy for c in response.components) else 1
    return _print_health(response)


REPLACE_HELP = (
    "NAME is served already: serve PATH as its new version (requests running on the old one "
    "finish on it; without this flag, a served name is refused)"
)


def _load_lora(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import scheduler_pb2

    path = str(Path(args.path).resolve()) if Path(args.path).exists() else args.path
    request = scheduler_pb2.LoadLoraRequest(lora_name=args.name, path=path, replace=args.replace)
    response = admin("LoadLora", request)
    if args.json:
        _json(response)
    else:
        modules = ", ".join(response.target_modules)
        print(f"loaded {args.name}: rank {response.rank}, adapts {modules}")
    return 0


def _unload_lora(admin: _Admin, args: argparse.Namespace) -> int:
    from llmserve.protos import scheduler_pb2

    response = admin("UnloadLora", scheduler_pb2.UnloadLoraRequest(lora_name=args.name))
    if args.json:
        _json(response)
    else:
        print(f"unloaded {args.name} ({response.num_requests_using} request(s) keep it)")
    return 0


Action = Callable[[_Admin, argparse.Namespace], int]


def add_admin_parser(sub: Any) -> None:
    """`llmserve admin` and its commands, under the top-level parser's subparsers."""
    p = sub.add_parser("admin", help="operate a running gateway (its Admin service)")
    commands = p.add_subparsers(dest="admin_command", required=True)

    def command(
        name: str, action: Action, help_text: str, deadline: bool = True
    ) -> argparse.ArgumentParser:
        c = commands.add_parser(name, help=help_text)
        c.add_argument(
            "--address",
            default=os.environ.get("LLMSERVE_ADDRESS", f"localhost:{DEFAULT_GATEWAY_PORT}"),
            help="the gateway's gRPC address (env LLMSERVE_ADDRESS)",
        )
        c.add_argument(
            "--admin-key",
            default=os.environ.get("LLMSERVE_ADMIN_KEY") or None,
            help="the gateway's --admin-key, or @PATH of a file holding it (default: env "
            "LLMSERVE_ADMIN_KEY)",
        )
        c.add_argument("--json", action="store_true", help="print protobuf JSON")
        if deadline:
            c.add_argument("--timeout", type=float, default=30.0, help="the call's deadline, s")
        c.set_defaults(func=_run, action=action)
        return c

    c = command(
        "drain",
        _drain,
        "stop admitting; wait until nothing runs (for rolling updates)",
        deadline=False,
    )
    c.add_argument(
        "--timeout",
        dest="timeout_s",
        type=float,
        default=0.0,
        help="abort what still runs after this many seconds (default 0: wait as long as it takes)",
    )
    command("resume", _resume, "admit again after a drain")
    c = command("requests", _requests, "requests in flight on every replica")
    c.add_argument("--tenant", default=None, help="only this tenant's ('default' for the default)")
    c = command("abort", _abort, "abort one request by its id (or an HTTP response id)")
    c.add_argument("request_id")
    command("capacity", _capacity, "KV blocks used and free, queues by tenant, steps per second")
    command("tenants", _tenants, "every tenant's weight, quotas and requests in flight")
    c = command("set-weight", _set_weight, "set a tenant's weight under the fair policy")
    c.add_argument("tenant")
    c.add_argument("weight", type=float)
    c = command("set-quota", _set_quota, "set a tenant's quotas (0: no limit; unset: unchanged)")
    c.add_argument("tenant")
    c.add_argument("--tokens-per-minute", type=int, default=None)
    c.add_argument("--max-concurrent", type=int, default=None, help="max concurrent requests")
    command("health", _health, "the health of the gateway, each scheduler, each engine")
    c = command("load-lora", _load_lora, "serve a LoRA adapter (a PEFT directory) under NAME")
    c.add_argument("name")
    c.add_argument("path")
    c.add_argument("--replace", action="store_true", help=REPLACE_HELP)
    c = command("unload-lora", _unload_lora, "stop admitting requests for a LoRA adapter")
    c.add_argument("name")
