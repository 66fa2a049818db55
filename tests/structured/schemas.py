"""JSON Schemas every structured-output test and benchmark runs: nesting, enums, arrays with
min/max items, required/optional properties, numbers and integers, string patterns and formats.

Strings, arrays and numbers are bounded (maxLength, maxItems, ranges), as a deployed schema
should be: a model that never closes a string would otherwise run into max_tokens, which ends
the output mid-value (finish_reason "length") however good the grammar is.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

NAME = {"type": "string", "minLength": 1, "maxLength": 12}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 999}

SCHEMAS: list[tuple[str, Schema]] = [
    ("flat_object", {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
    }),
    ("optional_fields", {
        "type": "object",
        "properties": {"id": SMALL_INT, "nickname": NAME, "active": {"type": "boolean"}},
        "required": ["id"],
    }),
    ("string_enum", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("mixed_enum", {"enum": ["auto", 1, 2.5, True, None]}),
    (
        "const",
        {"type": "object", "properties": {"version": {"const": "v1"}, "n": SMALL_INT}, "required": ["version", "n"]},
    ),
    ("bounded_integer", {"type": "integer", "minimum": -50, "maximum": 50}),
    ("exclusive_range", {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    ("multiple_of", {"type": "integer", "minimum": 0, "maximum": 100, "multipleOf": 5}),
    ("number_range", {"type": "number", "minimum": -1.5, "maximum": 1.5}),
    ("boolean", {"type": "boolean"}),
    ("array_min_max", {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 4}),
    ("array_of_enums", {
        "type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3,
    }),
    ("tuple_prefix_items", {
        "type": "array", "prefixItems": [NAME, SMALL_INT, {"type": "boolean"}], "items": False, "minItems": 3,
    }),
    ("nested_objects", {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": NAME, "address": {
                    "type": "object",
                    "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                }},
                "required": ["name", "address"],
            },
        },
        "required": ["user"],
    }),
    ("array_of_objects", {
        "type": "object",
        "properties": {"items": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"type": "object", "properties": {"sku": NAME, "qty": SMALL_INT}, "required": ["sku", "qty"]},
        }},
        "required": ["items"],
    }),
    ("string_pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"}),
    ("string_lengths", {"type": "string", "minLength": 3, "maxLength": 8}),
    ("uuid_format", {"type": "string", "format": "uuid"}),
    (
        "date_format",
        {"type": "object", "properties": {"when": {"type": "string", "format": "date"}}, "required": ["when"]},
    ),
    (
        "nullable",
        {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 10}}, "required": ["note"]},
    ),
    ("any_of", {"anyOf": [SMALL_INT, {"type": "string", "enum": ["none", "many"]}]}),
    ("refs_and_defs", {
        "type": "object",
        "$defs": {"point": {"type": "object", "properties": {"x": SMALL_INT, "y": SMALL_INT}, "required": ["x", "y"]}},
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
    }),
    ("no_extra_properties", {
        "type": "object", "properties": {"k": NAME}, "required": ["k"], "additionalProperties": False,
    }),
    ("property_counts", {
        "type": "object",
        "properties": {"a": SMALL_INT, "b": SMALL_INT, "c": SMALL_INT},
        "minProperties": 1, "maxProperties": 2,
    }),
]  # fmt: skip
