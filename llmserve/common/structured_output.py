"""Structured output (protos/common.proto's StructuredOutput): its limits, its grammar in
llguidance's terms, and whether the library compiles it. Torch-free: the gateway checks a
request here before it is admitted (on the validation thread); the engine builds its matchers
from the same grammar text (engine/features/grammar.py).

Each limit (MAX_CONSTRAINT_BYTES, MAX_SCHEMA_DEPTH, MAX_SCHEMA_PROPERTIES, MAX_CHOICES) and a
constraint whose language is empty (`root ::= root "a"`, the schema `{"$ref": "#"}`) is refused
with INVALID_ARGUMENT / HTTP 400 naming the field and the limit: docs/api.md#structured-output.
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any

from llguidance import LLMatcher, LLTokenizer, grammar_from

from llmserve.protos import common_pb2

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

StructuredOutput = common_pb2.StructuredOutput

MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_SCHEMA_PROPERTIES = 1024
MAX_CHOICES = 1024
# The kinds a constraint names (the oneof's field names), as the engine's cache keys them.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
_TOKEN_REF = re.compile(r"<\[(\d+)\]>")  # a grammar's special token, by id
# llguidance's JSON compiler: whitespace as in compact JSON (no runs of newlines to wander into)
# and unknown keywords ignored rather than refused (a schema's "title" or "description" is fine).
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "lenient": True}


class ConstraintError(ValueError):
    """A constraint is beyond the limits or does not compile; the message names the field."""


def constraint_of(so: StructuredOutput) -> tuple[str, str] | None:
    """(kind, text) of a constraint, the key its compiled grammar is cached by; None when unset.
    A choice's text is its list as JSON."""
    kind = so.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        return kind, json.dumps(list(so.choice.choices))
    return kind, getattr(so, kind)


def grammar_text(kind: str, text: str) -> str:
    """The llguidance grammar of a (kind, text) constraint. Raises ValueError when the text is
    not what its kind needs (a schema that is not JSON)."""
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', _JSON_OPTIONS)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(text, _JSON_OPTIONS)
    if kind == "grammar":
        return grammar_from("grammar", text)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return grammar_from("choice", text)
    raise ValueError(f"unknown constraint kind {kind!r}")


def check_structured_output(so: StructuredOutput, prefix: str, field: str = "") -> None:
    """Raise ConstraintError naming `prefix + kind` (or field, when given: the client's name for
    it) when so is beyond the limits or the library cannot compile it (the library's reason in
    the message). Compiles are cached by (kind, text)."""
    key = constraint_of(so)
    if key is None:
        return
    kind, text = key
    field = field or f"{prefix}{kind}"
    if kind == "choice":
        _check_choices(list(so.choice.choices), field)
    elif kind != "json_object":
        if not text:
            raise ConstraintError(f"{field} is empty")
        size = len(text.encode())
        if size > MAX_CONSTRAINT_BYTES:
            raise ConstraintError(f"{field} has {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}")
    if kind == "json_schema":
        _check_schema(text, field)
    error = compile_error(kind, text)
    if error:
        raise ConstraintError(f"{field} does not compile: {error}")


@functools.lru_cache(maxsize=512)
def compile_error(kind: str, text: str) -> str:
    """The library's reason a constraint does not compile ("" when it does)."""
    try:
        grammar = grammar_text(kind, text)
    except ValueError as err:
        return str(err)
    error = LLMatcher.validate_grammar(grammar).strip()
    if error:
        return error
    matcher = LLMatcher(_byte_tokenizer(_num_tokens(grammar)), grammar)
    matcher.compute_bitmask()  # the first mask finds a start state that leads nowhere
    if not matcher.is_error():
        return ""
    reason = matcher.get_error().strip().splitlines()[0]
    if reason.startswith("NoExtensionBias"):  # the start state takes no byte and is not final
        return "its language is empty: no text satisfies it"
    return reason


def _num_tokens(grammar: str) -> int:
    """The vocabulary a grammar is checked in: the bytes and an EOS, or as many ids as the
    special tokens it names (`<[200005]>`: gpt-oss's <|channel|>) need, as a power of two."""
    largest = max((int(n) for n in _TOKEN_REF.findall(grammar)), default=0)
    return 257 if largest < 257 else 1 << largest.bit_length()


@functools.cache
def _byte_tokenizer(n_vocab: int = 257) -> LLTokenizer:
    """A vocabulary of the 256 bytes and an EOS (id 256; n_vocab > 257: ids beyond stand for a
    model's special tokens, which no text spells): what a constraint admits, whatever the
    model's tokens (built with the tokenizers library, which the gateway has anyway)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {"</s>": 256}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.ByteFallback()
    return LLTokenizer(tokenizer.to_str(), n_vocab=n_vocab, eos_token=256)


def _check_choices(choices: list[str], field: str) -> None:
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise ConstraintError(f"{field} has {len(choices)} strings; 1 to {MAX_CHOICES} are allowed")
    for i, choice in enumerate(choices):
        if not choice:
            raise ConstraintError(f"{field}[{i}] is empty")
    size = sum(len(c.encode()) for c in choices)
    if size > MAX_CONSTRAINT_BYTES:
        raise ConstraintError(f"{field} has {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}")


def _check_schema(text: str, field: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise ConstraintError(f"{field} is not JSON: {err}") from err
    if not isinstance(schema, dict | bool):
        raise ConstraintError(f"{field} must be a JSON object (a schema), not {type(schema)}")
    depth, num_properties = _measure(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ConstraintError(f"{field} nests {depth} levels deep; the limit is {MAX_SCHEMA_DEPTH}")
    if num_properties > MAX_SCHEMA_PROPERTIES:
        raise ConstraintError(
            f"{field} has {num_properties} properties; the limit is {MAX_SCHEMA_PROPERTIES}"
        )


def _measure(schema: Any) -> tuple[int, int]:
    """(nesting depth of objects and arrays, properties declared), over the whole document."""
    depth, num_properties = 0, 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, dict):
            depth = max(depth, level)
            props = node.get("properties")
            if isinstance(props, dict):
                num_properties += len(props)
            stack.extend((v, level + 1) for v in node.values())
        elif isinstance(node, list):
            depth = max(depth, level)
            stack.extend((v, level + 1) for v in node)
    return depth, num_properties
