"""JSON schemas written for the structured-output tests (tests/gateway/test_structured_outputs.py):
each bounded (string lengths, item counts, number ranges) so that a small model's output ends within
a few dozen tokens, and together covering nested objects, arrays with min/max items, enums, string
patterns and formats, integer and number ranges, required and optional properties,
$defs / $ref and anyOf."""

from __future__ import annotations

from typing import Any


def _s(n: int = 12) -> dict[str, Any]:
    return {"type": "string", "maxLength": n}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({"name": _s(), "age": _int(0, 120)}),
    "enum_color": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "bool_flag": _obj({"ok": {"type": "boolean"}}),
    "int_range": _obj({"score": _int(1, 10)}),
    "negative_range": _obj({"delta": _int(-50, -1)}),
    # numbers get a multipleOf: JSON numbers have no length limit otherwise
    "number_range": _obj(
        {"price": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.01}}
    ),
    "exclusive_range": _obj(
        {
            "ratio": {
                "type": "number",
                "exclusiveMinimum": 0,
                "exclusiveMaximum": 1,
                "multipleOf": 0.05,
            }
        }
    ),
    "string_pattern": _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    "zip_pattern": _obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    "format_date": _obj({"day": {"type": "string", "format": "date"}}),
    "format_email": _obj({"email": {"type": "string", "format": "email", "maxLength": 30}}),
    "format_uuid": _obj({"id": {"type": "string", "format": "uuid"}}),
    "format_ipv4": _obj({"ip": {"type": "string", "format": "ipv4"}}),
    "hex_pattern": _obj({"rgb": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    "min_length": _obj({"word": {"type": "string", "minLength": 3, "maxLength": 8}}),
    "array_bounds": _obj({"tags": {"type": "array", "items": _s(8), "minItems": 1, "maxItems": 3}}),
    "array_exact": _obj(
        {"xy": {"type": "array", "items": _int(0, 9), "minItems": 2, "maxItems": 2}}
    ),
    "array_of_objects": _obj(
        {
            "items": {
                "type": "array",
                "items": _obj({"sku": _s(6), "qty": _int(1, 9)}),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    "top_level_array": {"type": "array", "items": _int(0, 99), "minItems": 1, "maxItems": 4},
    "nested": _obj({"user": _obj({"name": _s(), "address": _obj({"city": _s()})})}),
    "nested_deep": _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
    "optional_props": _obj(
        {"title": _s(), "subtitle": _s(), "year": _int(1900, 2030)}, required=["title"]
    ),
    "all_optional": _obj({"x": _int(0, 9), "y": _int(0, 9)}, required=[]),
    "defs_ref": {
        "$defs": {"point": _obj({"x": _int(-9, 9), "y": _int(-9, 9)})},
        **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    },
    "defs_ref_array": {
        "$defs": {"tag": {"type": "string", "enum": ["a", "b", "c"]}},
        **_obj({"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}, "maxItems": 3}}),
    },
    "any_of": _obj({"value": {"anyOf": [_int(0, 9), {"type": "boolean"}]}}),
    "any_of_objects": _obj(
        {"shape": {"anyOf": [_obj({"r": _int(1, 9)}), _obj({"w": _int(1, 9), "h": _int(1, 9)})]}}
    ),
    "nullable": _obj({"note": {"anyOf": [_s(10), {"type": "null"}]}}),
    "const": _obj({"version": {"const": 2}, "name": _s(8)}),
    "enum_mixed": _obj({"level": {"enum": [1, 2, 3, "max"]}}),
    "multiple_types": _obj({"id": {"type": ["integer", "string"], "maximum": 999, "maxLength": 6}}),
    "order": _obj(
        {
            "id": _int(1, 9999),
            "status": {"enum": ["new", "paid", "shipped"]},
            "lines": {
                "type": "array",
                "items": _obj(
                    {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}, "qty": _int(1, 5)}
                ),
                "minItems": 1,
                "maxItems": 2,
            },
            "paid": {"type": "boolean"},
        }
    ),
}
