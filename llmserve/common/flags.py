"""A service's settings as command-line flags, built from its frozen config dataclass, so each
setting is written once: its name, type, default and help live on the dataclass field.

    @dataclass(frozen=True)
    class SchedulerConfig:
        max_waiting: int = setting(4096, "queued requests beyond which ...")

    add_flags(parser, SchedulerConfig)            # --max-waiting N (bools: --x / --no-x)
    config = from_flags(SchedulerConfig, args)    # validated by the dataclass's __post_init__

Field metadata: "help"; "choices"; "env" (a variable that overrides the default); "flag" (a name
other than --field-name); "repeat" (a tuple field whose flag is given once per value, --x A --x B,
replacing the default). A `tuple[int, ...]` field takes a list (--eos-token-ids 1 2).
`to_json` / `from_json` carry a config whole to a child process (llmserve/stack.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def _fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the scalar type, whether it is a tuple of them) of int, float, str, bool, X | None,
    tuple[X, ...]."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is tuple:
        return args[0], True
    if args:  # X | None
        return args[0], False
    return hint, False


def flag_name(f: dataclasses.Field[Any], prefix: str = "") -> str:
    return f.metadata.get("flag") or f"--{prefix}{f.name.replace('_', '-')}"


def _dest(f: dataclasses.Field[Any], prefix: str) -> str:
    return (prefix + f.name).replace("-", "_")


def _default(f: dataclasses.Field[Any]) -> Any:
    env = f.metadata.get("env")
    if env and os.environ.get(env):
        return os.environ[env]
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[operator]


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    prefix: str = "",
    exclude: tuple[str, ...] = (),
    taken: set[str] | None = None,
    flag_prefix: str | None = None,
    alias_prefix: str | None = None,
) -> None:
    """Add a flag for each field of cls not in exclude. taken: flags already added by another
    config (a field two services share, e.g. --model) are skipped, and the new ones recorded.
    prefix names the parsed values (from_flags reads them under it); flag_prefix, when given,
    the flags instead, with alias_prefix's names accepted too (a renamed group's old flags)."""
    for f, hint in _fields(cls):
        name = flag_name(f, prefix if flag_prefix is None else flag_prefix)
        aliases = [flag_name(f, alias_prefix)] if alias_prefix is not None else []
        if f.name in exclude or (taken is not None and name in taken):
            continue
        if taken is not None:
            taken.add(name)
        kind, many = _base_type(hint)
        help_text = f.metadata.get("help", "")
        if env := f.metadata.get("env"):
            help_text += f" (env {env})"
        options: dict[str, Any] = {"default": _default(f), "dest": _dest(f, prefix)}
        if kind is bool:
            options["action"] = argparse.BooleanOptionalAction
        elif many and f.metadata.get("repeat"):
            # None until given: argparse would extend the default list rather than replace it.
            options.update(type=kind, action="extend", nargs="+", default=None)
            help_text += f" (repeatable; default: {' '.join(map(str, _default(f)))})"
        else:
            options.update(
                type=kind, choices=f.metadata.get("choices"), nargs="*" if many else None
            )
            if kind is not str or options["default"] is not None:
                help_text += " (default: %(default)s)"
        parser.add_argument(name, *aliases, help=help_text or None, **options)


def _with_tuples(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """values with the lists given for cls's tuple fields made tuples."""
    many = {f.name for f, hint in _fields(cls) if _base_type(hint)[1]}
    return {name: tuple(v) if name in many else v for name, v in values.items()}


def from_flags(cls: type[T], args: argparse.Namespace, *, prefix: str = "", **overrides: Any) -> T:
    """An instance of cls from parsed flags (fields without a flag keep their defaults)."""
    dests = {f.name: _dest(f, prefix) for f, _ in _fields(cls)}
    values = {name: getattr(args, dest) for name, dest in dests.items() if hasattr(args, dest)}
    unset = [
        f.name for f, _ in _fields(cls) if f.metadata.get("repeat") and values.get(f.name) is None
    ]
    for name in unset:  # a repeatable flag not given: the field's default
        values.pop(name, None)
    return cls(**{**_with_tuples(cls, values), **overrides})


def to_json(config: Any) -> str:
    return json.dumps({"type": type(config).__name__, "fields": dataclasses.asdict(config)})


def from_json(classes: dict[str, type], text: str) -> Any:
    """The config to_json wrote; its type must be one of classes (by name)."""
    data = json.loads(text)
    cls = classes[data["type"]]
    return cls(**_with_tuples(cls, data["fields"]))


def setting(default: Any, help: str, *, secret: bool = False, **metadata: Any) -> Any:
    """A config field with its flag's help text (and metadata: choices, env, flag); a secret
    one is left out of the config's repr (and so out of logs)."""
    return dataclasses.field(default=default, repr=not secret, metadata={"help": help, **metadata})


def check_ports(config: object, *names: str) -> None:
    """Raise ValueError naming the first field of config that is not a TCP port (0 allowed)."""
    for name in names:
        if not 0 <= getattr(config, name) < 65536:
            raise ValueError(f"{name}={getattr(config, name)} is not a TCP port")
