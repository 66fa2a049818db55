"""Which JSON Schemas a grammar can enforce, and a clear refusal for the rest.

xgrammar turns a schema into a grammar but silently drops keywords it cannot
express (``not``, ``if``/``then``, ``uniqueItems``, ``dependentRequired``, ...),
and then a "constrained" output can still fail validation. So every keyword is
checked against the set whose enforcement our tests verify (tests/structured);
anything else is a 400 naming the keyword and where it is, rather than a
guarantee we would not keep. Annotations (title, description, ...) are ignored.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from kvmesh.errors import InvalidArgument

# Keywords with no effect on which values are valid.
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"}
)
# Keywords the grammar enforces (subschema-bearing ones are walked below).
ENFORCED = frozenset(
    {
        "type", "enum", "const",
        "properties", "required", "additionalProperties", "minProperties", "maxProperties",
        "items", "prefixItems", "minItems", "maxItems",
        "minLength", "maxLength", "pattern", "format",
        "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
        "anyOf", "allOf", "$ref", "$defs", "definitions",
    }
)  # fmt: skip
# String formats the grammar checks (the others, e.g. "idn-email", "iri", "regex", are not).
FORMATS = frozenset(
    {
        "date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uri", "uri-reference",
        "uri-template", "uuid", "json-pointer", "relative-json-pointer",
    }
)  # fmt: skip
# Where subschemas sit: keyword -> "one" schema, a "map" of name -> schema, or a "list".
_SUBSCHEMAS = {
    "additionalProperties": "one", "items": "one",
    "properties": "map", "$defs": "map", "definitions": "map",
    "prefixItems": "list", "anyOf": "list", "allOf": "list",
}  # fmt: skip


def check_schema(schema: Any) -> None:
    """Raise InvalidArgument unless ``schema`` is valid JSON Schema made only of enforceable keywords."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgument(f"json_schema must be a JSON object, got {type(schema).__name__}")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = _pointer(list(e.absolute_path))
        raise InvalidArgument(f"json_schema is not a valid JSON Schema at {where}: {e.message}") from None
    _walk(schema, [])


def _walk(node: Any, path: list[str | int]) -> None:
    if isinstance(node, bool):
        return
    for key, value in node.items():
        here = [*path, key]
        if key in ANNOTATIONS:
            continue
        if key not in ENFORCED:
            _refuse(here, f"keyword '{key}' is not supported")
        _check_keyword(node, key, value, here)
        kind = _SUBSCHEMAS.get(key)
        if kind == "one":
            _walk(value, here)
        elif kind == "map":
            for name, sub in value.items():
                _walk(sub, [*here, name])
        elif kind == "list":
            for i, sub in enumerate(value):
                _walk(sub, [*here, i])


def _check_keyword(node: dict, key: str, value: Any, here: list[str | int]) -> None:
    """Keywords that are enforced only in some forms."""
    if key == "format" and value not in FORMATS:
        _refuse(here, f"format '{value}' is not supported (supported: {', '.join(sorted(FORMATS))})")
    elif key == "format" and ("minLength" in node or "maxLength" in node):
        _refuse(here, "'format' together with minLength/maxLength is not supported (the lengths would be ignored)")
    elif key in ("enum", "const"):
        values = value if key == "enum" else [value]
        if any(isinstance(v, (dict, list)) for v in values):
            _refuse(here, f"'{key}' with object or array values is not supported")
    elif key == "allOf" and len(value) != 1:
        _refuse(here, "'allOf' with more than one subschema is not supported: merge them into one schema")
    elif key == "multipleOf" and (node.get("type") != "integer" or not float(value).is_integer()):
        _refuse(here, "'multipleOf' is supported only as a whole number on type 'integer'")
    elif key == "$ref" and not str(value).startswith("#"):
        _refuse(here, f"only local references ('#/...') are supported, not {value!r}")


def _pointer(path: list[str | int]) -> str:
    return "/" + "/".join(str(p) for p in path) if path else "the root"


def _refuse(path: list[str | int], why: str) -> None:
    raise InvalidArgument(f"json_schema: {why} (at {_pointer(path)})")
