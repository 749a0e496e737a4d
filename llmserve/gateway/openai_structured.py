"""Structured output in the OpenAI API: OpenAI's `response_format` and vLLM's
`structured_outputs` as protos/common.proto's StructuredOutput, checked against the limits and
compiled here (common/structured_output.py), so an error names the body's own field."""

from __future__ import annotations

import json
import re
from typing import Any

from llmserve.common.structured_output import ConstraintError, check_structured_output
from llmserve.common.text import invalid_text
from llmserve.gateway.validation import ValidationError
from llmserve.protos.common_pb2 import ChoiceList, StructuredOutput

_VLLM_KINDS = ("json", "regex", "choice", "grammar")
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def text_field(where: str, value: str) -> str:
    """value, or ValidationError naming where when protobuf cannot carry it (a lone surrogate,
    which JSON can escape: "\\ud800")."""
    why = invalid_text(value)
    if why is not None:
        raise ValidationError(f"{where} is {why}")
    return value


def structured_output(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> StructuredOutput | None:
    """The body's constraint (response_format or structured_outputs), checked against the
    limits and compiled (ValidationError naming the body's field and the library's reason)."""
    found = [
        c for c in (_response_format(response_format), _vllm_constraint(structured_outputs)) if c
    ]
    if len(found) > 1:
        raise ValidationError(
            "response_format and structured_outputs both constrain the output; send one"
        )
    if not found:
        return None
    so, field = found[0]
    try:
        check_structured_output(so, "", field)
    except ConstraintError as err:
        raise ValidationError(str(err)) from err
    return so


def _response_format(fmt: dict[str, Any] | None) -> tuple[StructuredOutput, str] | None:
    kind = (fmt or {}).get("type", "text")
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True), "response_format"
    if kind != "json_schema":
        raise ValidationError(
            f"response_format.type={kind!r} must be 'text', 'json_object' or 'json_schema'"
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise ValidationError("response_format.json_schema is missing (an object with a schema)")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and _SCHEMA_NAME.fullmatch(name)):
        raise ValidationError(
            f"response_format.json_schema.name={str(name)[:70]!r} must be 1-64 letters, digits, "
            "_ or -"
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ValidationError("response_format.json_schema.schema must be a JSON schema object")
    field = "response_format.json_schema.schema"
    return StructuredOutput(json_schema=text_field(field, json.dumps(schema))), field


def _vllm_constraint(spec: dict[str, Any] | None) -> tuple[StructuredOutput, str] | None:
    if not spec:
        return None
    given = [k for k in _VLLM_KINDS if spec.get(k) is not None]
    if len(given) != 1:
        raise ValidationError(
            f"structured_outputs must set exactly one of {', '.join(_VLLM_KINDS)} "
            f"(it sets {', '.join(given) or 'none'})"
        )
    kind = given[0]
    value, field = spec[kind], f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(value, dict | bool):
            value = json.dumps(value)
        if not isinstance(value, str):
            raise ValidationError(f"{field} must be a JSON schema (an object or its text)")
        return StructuredOutput(json_schema=text_field(field, value)), field
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise ValidationError(f"{field} must be a list of strings")
        choices = [text_field(f"{field}[{i}]", c) for i, c in enumerate(value)]
        return StructuredOutput(choice=ChoiceList(choices=choices)), field
    if not isinstance(value, str):
        raise ValidationError(f"{field} must be a string")
    if kind == "regex":
        return StructuredOutput(regex=text_field(field, value)), field
    return StructuredOutput(grammar=text_field(field, value)), field
