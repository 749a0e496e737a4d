"""`llmserve`: start the stack or one of its services, or talk to a running gateway.

llmserve serve [--model PATH] [--device auto|cpu|cuda]   the three processes, until Ctrl-C
llmserve gateway | scheduler | engine ...                  one service (compose runs these)
llmserve generate PROMPT        raw text in, streamed completion out
llmserve chat [MESSAGE]         one user turn through the chat template (interactive if omitted)
llmserve health [--wait S]      exit 0 when the server at --address is SERVING
llmserve admin drain | resume | requests | abort | capacity | tenants | set-weight | set-quota |
    health                      operate a running gateway (its Admin service; --admin-key)
llmserve bench serve | offline | compare   measure a gateway or the engine; compare results
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any

from llmserve.common.flags import add_flags
from llmserve.common.net import DEFAULT_GATEWAY_PORT
from llmserve.engine.contract.echo import EchoEngineConfig
from llmserve.services import SERVICE_CONFIGS, cmd_service

# -- serve: the whole stack ------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    from llmserve.common.families import family_refusal
    from llmserve.common.model_config import (
        ModelSourceError,
        check_draft_model,
        check_parallel_sizes,
        load_model_config,
        resolve_model_path,
    )
    from llmserve.common.tokenizer_files import check_gguf_tokenizer
    from llmserve.serve_flags import stack_from_flags
    from llmserve.stack import StackError

    try:
        path = resolve_model_path(args.model)
        stack = stack_from_flags(args)
        model_config = load_model_config(path)
        if path.suffix == ".gguf":  # the gateway's tokenizer, before the engine loads weights
            check_gguf_tokenizer(path)
        why = check_parallel_sizes(
            model_config, args.tensor_parallel_size, args.pipeline_parallel_size
        ) or family_refusal(model_config.family, stack.engine.features())
        if why:
            raise ValueError(why)
        if args.speculative_model:  # the engine checks it too; here, before anything starts
            draft_path = resolve_model_path(args.speculative_model, "--speculative-model")
            check_draft_model(path, model_config, draft_path, load_model_config(draft_path))
        stack.check_ports_free()
    except (ModelSourceError, ValueError, StackError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: object) -> None:
        stop["signal"] = signum

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        stack.start()
        try:
            stack.wait_ready(args.ready_timeout)
        except StackError as err:
            if stop["signal"]:
                return 0
            print(f"error: {err}", file=sys.stderr)
            return 1
        http = f", HTTP at {stack.http_url}" if stack.http_url else ""
        num = len(stack.scheduler_addresses)
        replicas = f", {num} replicas" if num > 1 else ""
        print(
            f"llmserve ready: gateway at {stack.gateway_address}{http}{replicas} (Ctrl-C stops it)"
        )
        sys.stdout.flush()
        return _supervise(stack, stop)
    finally:
        stack.stop()


def _supervise(stack: Any, stop: dict[str, int]) -> int:
    """Until a signal: restart whichever service crashed, at most 3 restarts in 10 minutes in
    all; one more crash ends the stack (exit 1). A new engine: the scheduler keeps every request
    and recomputes what was running. A new scheduler: the requests it held fail UNAVAILABLE at
    the gateway, which reconnects by itself. A new gateway: its clients reconnect."""
    restarts: list[float] = []
    while not stop["signal"]:
        for name, code in stack.dead():
            recent = [t for t in restarts if time.monotonic() - t < 600]
            if len(recent) >= 3:
                print(
                    f"error: {name} exited with {code}; 3 restarts in 10 minutes, giving up",
                    file=sys.stderr,
                )
                return 1
            print(f"{name} exited with {code}; restarting it", file=sys.stderr)
            restarts = [*recent, time.monotonic()]
            stack.restart(name)
        time.sleep(0.2)
    return 0


# -- client commands -------------------------------------------------------------------------------


def _text_arg(value: str) -> str:
    """A text argument protobuf can carry: bytes that are not UTF-8 reach us as surrogates."""
    from llmserve.common.text import invalid_text

    why = invalid_text(value, from_bytes=True)
    if why is not None:
        raise argparse.ArgumentTypeError(why)
    return value


def _seed_arg(value: str) -> int:
    from llmserve.common.sampling import SamplingError, seed_value

    try:
        return seed_value(int(value))
    except ValueError as err:  # SamplingError is one
        why = str(err) if isinstance(err, SamplingError) else f"seed={value!r} is not an integer"
        raise argparse.ArgumentTypeError(why) from err


def _add_client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address", default=os.environ.get("LLMSERVE_ADDRESS", f"localhost:{DEFAULT_GATEWAY_PORT}")
    )
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--seed", type=_seed_arg, default=None, help="-2**63 to 2**64 - 1")
    p.add_argument(
        "--stop", type=_text_arg, action="append", default=None, help="stop string (repeatable)"
    )
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument(
        "--disable-speculation",
        action="store_true",
        help="decode without the server's speculative decoding (same tokens, greedy or seeded)",
    )
    p.add_argument(
        "--user",
        type=_text_arg,
        default=None,
        help="the tenant the request is for, when the server has no --api-keys",
    )
    p.add_argument(
        "--priority",
        type=int,
        default=None,
        help="under the scheduler's priority policy, lower runs first (default 0)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object with text, token_ids and finish_reason",
    )
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument(
        "--api-key",
        default=os.environ.get("LLMSERVE_API_KEY") or None,
        help="the server's API key (default: env LLMSERVE_API_KEY)",
    )


_SAMPLING_FLAGS = (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "user", "priority",
)  # fmt: skip


def _request(args: argparse.Namespace, **prompt: Any) -> Any:
    """The GenerateRequest for prompt (text= or messages=) with the sampling flags given."""
    from llmserve.client import make_request

    fields = {name: getattr(args, name) for name in _SAMPLING_FLAGS}
    return make_request(
        **prompt,
        **fields,
        ignore_eos=args.ignore_eos or None,
        disable_speculation=args.disable_speculation or None,
    )


INTERRUPTED = 130  # the shell's code for a command ended by Ctrl-C


def _run_one(args: argparse.Namespace, request: object) -> tuple[int, str]:
    """Stream one request to stdout (or print JSON); return (exit code, the text received).
    Ctrl-C cancels the request (the server frees it) and returns INTERRUPTED."""
    import grpc

    from llmserve.client import Client, Completion

    completion = Completion()
    interrupted = False
    with Client(args.address, api_key=args.api_key) as client:
        call = client.start(request, timeout=args.timeout)  # type: ignore[arg-type]

        def on_ctrl_c(_signum: int, _frame: object) -> None:
            nonlocal interrupted
            interrupted = True
            call.cancel()  # the loop below then ends with CANCELLED, between two messages

        previous = signal.signal(signal.SIGINT, on_ctrl_c)
        try:
            for msg in call:
                completion.add(msg)
                if not args.json:
                    print(msg.text, end="", flush=True)
        except grpc.RpcError as err:
            if not args.json:
                print(flush=True)
            if interrupted:
                return INTERRUPTED, completion.text
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1, completion.text
        finally:
            signal.signal(signal.SIGINT, previous)
    if args.json:
        print(json.dumps(completion.to_json(), ensure_ascii=False))
    else:
        print()
    return 0, completion.text


def cmd_generate(args: argparse.Namespace) -> int:
    return _run_one(args, _request(args, text=args.prompt))[0]


def cmd_chat(args: argparse.Namespace) -> int:
    history: list[tuple[str, str]] = []
    if args.system:
        history.append(("system", args.system))
    if args.message is not None:
        return _run_one(args, _request(args, messages=[*history, ("user", args.message)]))[0]
    print(
        "chat: type a message; Ctrl-C stops an answer (what was said stays in the "
        "conversation); an empty line, Ctrl-D or Ctrl-C at the prompt ends",
        file=sys.stderr,
    )
    try:
        return _chat_loop(args, history)
    except KeyboardInterrupt:  # Ctrl-C at the prompt
        print(file=sys.stderr)
        return 0


class _PipeLines:
    """Lines of a stdin that is not a terminal, read unbuffered in short select() waits: a
    Ctrl-C that the kernel hands to one of gRPC's threads only sets Python's flag, and a read
    blocked in the main thread would never see it (the chat then hung at its prompt)."""

    def __init__(self) -> None:
        self.fd = sys.stdin.fileno()
        self.pending = b""

    def read(self, prompt: str) -> str:
        print(prompt, end="", flush=True)
        while b"\n" not in self.pending:
            if not select.select([self.fd], [], [], 0.2)[0]:
                continue  # returns to the interpreter: a pending Ctrl-C raises here
            data = os.read(self.fd, 65536)
            if not data:
                if not self.pending:
                    raise EOFError
                self.pending += b"\n"
            self.pending += data
        line, _, self.pending = self.pending.partition(b"\n")
        return line.decode("utf-8", errors="replace")


def _chat_loop(args: argparse.Namespace, history: list[tuple[str, str]]) -> int:
    read = input if sys.stdin.isatty() else _PipeLines().read
    while True:
        try:
            line = read("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        history.append(("user", line))
        code, text = _run_one(args, _request(args, messages=history))
        if code == INTERRUPTED:
            print("(stopped; the partial answer stays in the conversation)", file=sys.stderr)
        elif code:
            return code
        history.append(("assistant", text))


def cmd_internal_token(args: argparse.Namespace) -> int:
    """Write a fresh internal token to args.path (readable by its owner only), unless one is
    there already: restarted services must keep sharing it."""
    import secrets
    from pathlib import Path

    path = Path(args.path)
    if path.exists() and path.read_text().strip():
        print(f"{path}: kept the token already there")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    print(f"{path}: wrote a new token")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """The status word on stdout (scripts read it); why it is not SERVING on stderr."""
    from llmserve.common.net import health_status, wait_until_serving, with_default_port

    address = with_default_port(args.address, DEFAULT_GATEWAY_PORT)
    if args.wait and wait_until_serving(address, timeout=args.wait):
        status, why = "SERVING", ""
    else:
        status, why = health_status(address)
    print(status)
    if why:
        print(f"error: {address}: {why}", file=sys.stderr)
    return 0 if status == "SERVING" else 1


# -- parser ----------------------------------------------------------------------------------------


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: arguments it does not know are its own error, shown with its own
    usage line, not the top-level parser's (argparse leaves them to the top by default)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def _add_service_parser(sub: Any, name: str, help_text: str) -> None:
    p = sub.add_parser(name, help=help_text)
    add_flags(p, SERVICE_CONFIGS[name])
    p.add_argument("--config-stdin", action="store_true", help=argparse.SUPPRESS)
    if name == "engine":
        # The echo engine (tests): --echo and --echo-*, with --fake / --fake-* as their older
        # names (compose files and scripts written before the rename keep working).
        p.add_argument("--echo", "--fake", dest="fake", action="store_true", help=argparse.SUPPRESS)
        group = p.add_argument_group("echo engine (tests)")
        add_flags(
            group, EchoEngineConfig, prefix="fake-", flag_prefix="echo-", alias_prefix="fake-"
        )
    p.set_defaults(func=cmd_service)


def build_parser() -> argparse.ArgumentParser:
    from llmserve.serve_flags import add_serve_flags

    parser = argparse.ArgumentParser(prog="llmserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)

    p = sub.add_parser("serve", help="start gateway, scheduler and engine; wait; stop on Ctrl-C")
    add_serve_flags(p)
    p.set_defaults(func=cmd_serve)

    for name in SERVICE_CONFIGS:
        _add_service_parser(sub, name, f"run the {name} service")

    p = sub.add_parser("generate", help="complete raw text (no chat template)")
    p.add_argument("prompt", type=_text_arg)
    _add_client_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="one user turn through the chat template")
    p.add_argument("message", nargs="?", default=None, type=_text_arg)
    p.add_argument("--system", default=None, type=_text_arg, help="system message")
    _add_client_args(p)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("health", help="check a service's grpc.health.v1 status")
    p.add_argument("--address", default=f"localhost:{DEFAULT_GATEWAY_PORT}")
    p.add_argument("--wait", type=float, default=0.0, help="poll up to this many seconds")
    p.set_defaults(func=cmd_health)

    p = sub.add_parser(
        "internal-token",
        help="write a token for the internal links to PATH (compose's init service; "
        "`serve` makes its own)",
    )
    p.add_argument("path")
    p.set_defaults(func=cmd_internal_token)

    from llmserve.admin import add_admin_parser
    from llmserve.bench.cli import add_bench_parser

    add_admin_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ValueError as err:
        from llmserve.client import RequestError

        if not isinstance(err, RequestError):
            raise
        print(f"error: {err}", file=sys.stderr)  # a value the request cannot carry
        return 2


if __name__ == "__main__":
    sys.exit(main())
