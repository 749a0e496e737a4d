"""`llmserve`: start the stack or one of its services, or talk to a running gateway.

llmserve serve [--model PATH] [--device auto|cpu|cuda]   the three processes, until Ctrl-C
llmserve gateway | scheduler | engine ...                  one service (compose runs these)
llmserve generate PROMPT        raw text in, streamed completion out
llmserve chat [MESSAGE]         one user turn through the chat template (interactive if omitted)
llmserve health [--wait S]      exit 0 when the server at --address is SERVING
llmserve bench serve | offline | compare   measure a gateway or the engine; compare results
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

DEFAULT_GATEWAY_PORT = 50051
DEFAULT_SCHEDULER_PORT = 50052
DEFAULT_ENGINE_PORT = 50053
DEFAULT_HTTP_PORT = 8000  # the gateway's OpenAI-compatible API
DEFAULT_METRICS_PORT = 9101  # gateway; scheduler 9102, engine 9103


# -- argument groups (shared by `serve` and the single-service commands) --------------------------


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    g.add_argument(
        "--num-kv-blocks",
        type=int,
        default=0,
        help="KV pool size in blocks (0: from --kv-cache-gb or free GPU memory)",
    )
    g.add_argument("--kv-cache-gb", type=float, default=2.0, help="CPU KV pool size")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: default)")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed for unseeded requests; also seeds --load-format dummy weights",
    )
    g.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="auto: the checkpoint at --model; dummy: seeded random weights for the config.json "
        "at --model (a directory, or the file; e.g. configs/llama-3-8b)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: run decode steps eagerly too",
    )
    g.add_argument(
        "--ops-backend",
        default="auto",
        choices=["auto", "torch", "cuda"],
        help="layer ops: auto = the CUDA kernels of kernels/ where they can run (fp16/bf16 on a "
        "GPU), else plain torch (kernels/reference.py)",
    )


def _add_engine_batch_args(p: argparse.ArgumentParser) -> None:
    """The scheduler's limits, for `llmserve engine` alone (`serve` passes its scheduler's)."""
    g = p.add_argument_group("engine: the scheduler's limits (size the GPU profile and graphs)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests per step at most")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=2048, help="tokens per step at most"
    )


def _add_scheduler_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("scheduler")
    g.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per step (prefill chunks + decodes)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=4096,
        help="queued requests beyond which new ones get RESOURCE_EXHAUSTED",
    )
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument(
        "--scheduling-policy",
        default="continuous",
        choices=["continuous", "static"],
        help="static: admit a batch only when nothing runs; finished members pad it until its "
        "last one finishes (the baseline `llmserve bench` compares against)",
    )
    g.add_argument(
        "--static-batch-wait-ms",
        type=float,
        default=100.0,
        help="static policy: wait up to this long for a new batch to fill to --max-num-seqs",
    )
    g.add_argument(
        "--overlap-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="plan step N+1 while the engine runs step N (two steps in flight)",
    )


def _metrics_arg(p: argparse.ArgumentParser, default: int, what: str) -> None:
    env = os.environ.get("LLMSERVE_METRICS_PORT")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env) if env is not None else default,
        help=f"serve Prometheus metrics at http://HOST:PORT/metrics ({what}; 0 turns it off; "
        "env LLMSERVE_METRICS_PORT). Traces and OTLP metrics: the standard OTEL_* variables",
    )


def _start_telemetry(service: str, args: argparse.Namespace) -> None:
    from common import telemetry
    from common.log import configure

    configure(service)
    telemetry.setup(service, args.metrics_port, getattr(args, "host", "0.0.0.0"))


def _add_http_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("OpenAI-compatible HTTP API")
    g.add_argument(
        "--http-port",
        type=int,
        default=DEFAULT_HTTP_PORT,
        help="port of the HTTP API (/v1/completions, /v1/chat/completions, ...; default "
        "%(default)s); 0 turns it off",
    )
    g.add_argument(
        "--api-key",
        **_api_key_option("require 'Authorization: Bearer KEY' of every HTTP and gRPC client"),
    )


def _api_key_option(what: str) -> dict[str, str | None]:
    return {
        "default": os.environ.get("LLMSERVE_API_KEY") or None,
        "help": f"{what} (default: env LLMSERVE_API_KEY)",
    }


def _model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="HF directory or .gguf file (default: the built-in SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        help="lower the model's context length (0: the model's own)",
    )


def _engine_config(args: argparse.Namespace, port: int, host: str):  # type: ignore[no-untyped-def]
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_gb=args.kv_cache_gb,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        num_threads=args.num_threads,
        seed=args.seed,
        host=host,
        port=port,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.enforce_eager,
        ops_backend=args.ops_backend,
    )


# -- single services -------------------------------------------------------------------------------


def cmd_engine(args: argparse.Namespace) -> int:
    _start_telemetry("engine", args)
    from common import telemetry
    from engine.service import serve

    if args.fake:
        from engine.fake import FakeEngine

        engine = FakeEngine(
            vocab_size=args.fake_vocab_size,
            max_model_len=args.max_model_len or 2048,
            block_size=args.block_size,
            num_blocks=args.num_kv_blocks or 256,
            eos_token_ids=tuple(args.fake_eos_token_id),
            step_delay_ms=args.fake_step_delay_ms,
        )
    else:
        from engine.engine import Engine

        engine = Engine(_engine_config(args, args.port, args.host))
    serve(engine, args.host, args.port)
    telemetry.shutdown()
    return 0


def _run_async(main: object) -> None:
    try:
        import uvloop

        uvloop.run(main)  # type: ignore[arg-type]
    except ImportError:
        asyncio.run(main)  # type: ignore[arg-type]


def cmd_scheduler(args: argparse.Namespace) -> int:
    _start_telemetry("scheduler", args)
    from common import telemetry
    from scheduler.config import SchedulerConfig
    from scheduler.service import serve

    config = SchedulerConfig(
        engine_address=args.engine_address,
        host=args.host,
        port=args.port,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        enable_prefix_caching=not args.no_prefix_caching,
        max_model_len=args.max_model_len,
        scheduling_policy=args.scheduling_policy,
        static_batch_wait_ms=args.static_batch_wait_ms,
        overlap_scheduling=args.overlap_scheduling,
    )
    _run_async(serve(config))
    telemetry.shutdown()
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    _start_telemetry("gateway", args)
    from common import telemetry
    from gateway.config import GatewayConfig
    from gateway.service import serve

    config = GatewayConfig(
        model=args.model,
        scheduler_address=args.scheduler_address,
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        api_key=args.api_key,
    )
    _run_async(serve(config))
    telemetry.shutdown()
    return 0


# -- serve: the whole stack ------------------------------------------------------------------------


def _service_argv(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """The three child command lines, engine first."""
    common = ["--max-model-len", str(args.max_model_len)]
    if args.model:
        common += ["--model", args.model]
    internal = "127.0.0.1"
    engine = [
        "engine",
        "--host",
        internal,
        "--port",
        str(args.engine_port),
        "--device",
        args.device,
        "--dtype",
        args.dtype,
        "--block-size",
        str(args.block_size),
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--kv-cache-gb",
        str(args.kv_cache_gb),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--num-threads",
        str(args.num_threads),
        "--seed",
        str(args.seed),
        "--load-format",
        args.load_format,
        "--ops-backend",
        args.ops_backend,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        *(["--enforce-eager"] if args.enforce_eager else []),
        *common,
    ]
    base = args.metrics_port
    engine += ["--metrics-port", str(base + 2 if base > 0 else 0)]
    scheduler = [
        "scheduler",
        "--host",
        internal,
        "--port",
        str(args.scheduler_port),
        "--engine-address",
        f"{internal}:{args.engine_port}",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-waiting",
        str(args.max_waiting),
        "--scheduling-policy",
        args.scheduling_policy,
        "--static-batch-wait-ms",
        str(args.static_batch_wait_ms),
        "--overlap-scheduling" if args.overlap_scheduling else "--no-overlap-scheduling",
        "--metrics-port",
        str(base + 1 if base > 0 else 0),
        *common,
    ]
    if args.no_prefix_caching:
        scheduler.append("--no-prefix-caching")
    gateway = [
        "gateway",
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--scheduler-address",
        f"{internal}:{args.scheduler_port}",
        "--http-port",
        str(args.http_port),
        "--metrics-port",
        str(base),
        *common,
    ]
    return [("engine", engine), ("scheduler", scheduler), ("gateway", gateway)]


def _stop_children(children: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    """SIGTERM the front first (gateway, scheduler, engine); SIGKILL what lingers."""
    for _, proc in reversed(children):
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for _, proc in reversed(children):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def cmd_serve(args: argparse.Namespace) -> int:
    from common.model_config import ModelSourceError, resolve_model_path
    from common.net import wait_until_serving

    try:
        resolve_model_path(args.model)
    except ModelSourceError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    children: list[tuple[str, subprocess.Popen[bytes]]] = []
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    if args.api_key:
        os.environ["LLMSERVE_API_KEY"] = args.api_key  # to the gateway, not on its command line
    commands = {
        name: [sys.executable, "-m", "llmserve.cli", *argv] for name, argv in _service_argv(args)
    }
    try:
        for name, cmd in commands.items():
            children.append((name, subprocess.Popen(cmd, start_new_session=True)))
        address = f"localhost:{args.port}"
        deadline = time.monotonic() + args.ready_timeout
        while not stop["signal"]:
            if wait_until_serving(address, timeout=0.5):
                break
            dead = [(n, p.returncode) for n, p in children if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{dead[0][0]} exited with {dead[0][1]}" if dead else "timed out"
                print(f"error: the stack did not start ({why})", file=sys.stderr)
                return 1
        else:
            return 0
        http = f", HTTP at http://localhost:{args.http_port}/v1" if args.http_port else ""
        print(f"llmserve ready: gateway at {address}{http} (Ctrl-C stops it)", flush=True)
        restarts: list[float] = []
        while not stop["signal"]:
            for i, (name, proc) in enumerate(children):
                if proc.poll() is None:
                    continue
                # The scheduler keeps every request through an engine restart; the gateway and
                # the scheduler hold client streams, so losing either ends the stack.
                recent = [t for t in restarts if time.monotonic() - t < 600]
                if name != "engine" or len(recent) >= 3:
                    print(f"error: {name} exited with {proc.returncode}", file=sys.stderr)
                    return 1
                print(f"engine exited with {proc.returncode}; restarting it", file=sys.stderr)
                restarts = [*recent, time.monotonic()]
                children[i] = (name, subprocess.Popen(commands[name], start_new_session=True))
            time.sleep(0.2)
        return 0
    finally:
        _stop_children(children)


# -- client commands -------------------------------------------------------------------------------


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address", default=os.environ.get("LLMSERVE_ADDRESS", f"localhost:{DEFAULT_GATEWAY_PORT}")
    )
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with text, token_ids and finish_reason",
    )
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--api-key", **_api_key_option("the server's API key"))


def _sampling_fields(args: argparse.Namespace) -> dict[str, object]:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "stop": args.stop,
        "ignore_eos": args.ignore_eos or None,
    }


def _run_one(args: argparse.Namespace, request: object) -> tuple[int, str]:
    """Stream one request to stdout (or print JSON); return (exit code, full text)."""
    import grpc

    from llmserve.client import Client, Completion

    completion = Completion()
    with Client(args.address, api_key=args.api_key) as client:
        try:
            for msg in client.stream(request, timeout=args.timeout):  # type: ignore[arg-type]
                completion.add(msg)
                if not args.json:
                    print(msg.text, end="", flush=True)
        except grpc.RpcError as err:
            if not args.json:
                print()
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1, completion.text
    if args.json:
        print(json.dumps(completion.to_json(), ensure_ascii=False))
    else:
        print()
    return 0, completion.text


def cmd_generate(args: argparse.Namespace) -> int:
    from llmserve.client import make_request

    return _run_one(args, make_request(text=args.prompt, **_sampling_fields(args)))[0]


def cmd_chat(args: argparse.Namespace) -> int:
    from llmserve.client import make_request

    history: list[tuple[str, str]] = []
    if args.system:
        history.append(("system", args.system))
    if args.message is not None:
        request = make_request(
            messages=[*history, ("user", args.message)], **_sampling_fields(args)
        )
        return _run_one(args, request)[0]
    print("chat: type a message, an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        history.append(("user", line))
        code, text = _run_one(args, make_request(messages=history, **_sampling_fields(args)))
        if code:
            return code
        history.append(("assistant", text))


def cmd_health(args: argparse.Namespace) -> int:
    from common.net import check_health, wait_until_serving

    if args.wait:
        ok = wait_until_serving(args.address, timeout=args.wait)
        print("SERVING" if ok else check_health(args.address))
        return 0 if ok else 1
    status = check_health(args.address)
    print(status)
    return 0 if status == "SERVING" else 1


# -- parser ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start gateway, scheduler and engine; wait; stop on Ctrl-C")
    _model_arg(p)
    p.add_argument("--host", default="0.0.0.0", help="gateway bind address")
    p.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT, help="gateway port")
    p.add_argument("--scheduler-port", type=int, default=DEFAULT_SCHEDULER_PORT)
    p.add_argument("--engine-port", type=int, default=DEFAULT_ENGINE_PORT)
    p.add_argument("--ready-timeout", type=float, default=600.0)
    _add_http_args(p)
    _metrics_arg(
        p, DEFAULT_METRICS_PORT, "the gateway's; the scheduler's is PORT+1, the engine's PORT+2"
    )
    _add_engine_args(p)
    _add_scheduler_args(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("engine", help="run the engine service")
    _model_arg(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=DEFAULT_ENGINE_PORT)
    _add_engine_args(p)
    _add_engine_batch_args(p)
    _metrics_arg(p, DEFAULT_METRICS_PORT + 2, "default %(default)s")
    p.add_argument("--fake", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--fake-vocab-size", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument(
        "--fake-eos-token-id", type=int, action="append", default=[], help=argparse.SUPPRESS
    )
    p.add_argument("--fake-step-delay-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_engine)

    p = sub.add_parser("scheduler", help="run the scheduler service")
    p.add_argument("--max-model-len", type=int, default=0)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)  # accepted, unused
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=DEFAULT_SCHEDULER_PORT)
    p.add_argument("--engine-address", default=f"localhost:{DEFAULT_ENGINE_PORT}")
    _metrics_arg(p, DEFAULT_METRICS_PORT + 1, "default %(default)s")
    _add_scheduler_args(p)
    p.set_defaults(func=cmd_scheduler)

    p = sub.add_parser("gateway", help="run the gateway service")
    _model_arg(p)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT)
    p.add_argument("--scheduler-address", default=f"localhost:{DEFAULT_SCHEDULER_PORT}")
    _add_http_args(p)
    _metrics_arg(p, DEFAULT_METRICS_PORT, "default %(default)s")
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("generate", help="complete raw text (no chat template)")
    p.add_argument("prompt")
    _add_client_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="one user turn through the chat template")
    p.add_argument("message", nargs="?", default=None)
    p.add_argument("--system", default=None, help="system message")
    _add_client_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("health", help="check a service's grpc.health.v1 status")
    p.add_argument("--address", default=f"localhost:{DEFAULT_GATEWAY_PORT}")
    p.add_argument("--wait", type=float, default=0.0, help="poll up to this many seconds")
    p.set_defaults(func=cmd_health)

    from llmserve.bench.cli import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
