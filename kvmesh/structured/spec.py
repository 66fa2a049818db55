"""A request's output constraint: one value, carried from the API to the sampler.

Torch-free (the gateway imports it, and xgrammar imports torch). The gateway checks what it can without
a grammar compiler (``check``: JSON text, and JSON Schemas against the keywords the grammar enforces), so
the common mistakes are a 400 before anything is routed; workers build the grammar
(``kvmesh.structured.grammar``, which refuses a regular expression or EBNF grammar xgrammar cannot parse)
and compile it against their vocabulary. The same ``GrammarSpec`` is the compile cache's key, so equal
constraints from different requests share one compiled grammar.

A structural tag's ``{"type": "json_schema", "json_schema": ...}`` contents (how the gateway writes the
arguments of declared tools) are held to the same enforceable keywords as a ``json_schema`` constraint.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.errors import InvalidArgument
from kvmesh.structured.json_schema import check_schema

Kind = Literal["json_schema", "any_json", "regex", "ebnf", "structural_tag"]

# Compact JSON: free whitespace lets a model pad forever between tokens of a value
# (a well-known failure of grammar-constrained JSON), and no client needs it.
JSON_WHITESPACE = False


@dataclass(frozen=True)
class GrammarSpec:
    kind: Kind
    # JSON text for json_schema and structural_tag, the pattern or grammar otherwise ("" for any_json).
    source: str = ""

    @staticmethod
    def json_schema(schema: dict | bool) -> GrammarSpec:
        return GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":")))

    def to_pb(self) -> sampling_pb2.StructuredOutput:
        if self.kind == "any_json":
            return sampling_pb2.StructuredOutput(any_json=True)
        return sampling_pb2.StructuredOutput(**{self.kind: self.source})

    @staticmethod
    def from_pb(pb: sampling_pb2.StructuredOutput) -> GrammarSpec | None:
        """None when the message sets no constraint."""
        kind = pb.WhichOneof("kind")
        if kind is None or (kind == "any_json" and not pb.any_json):
            return None
        return GrammarSpec(kind, "" if kind == "any_json" else getattr(pb, kind))

    def check(self) -> None:
        """Raise InvalidArgument for what can be told wrong without building the grammar: text that is not
        JSON where JSON is due, and JSON Schemas with keywords the grammar cannot enforce."""
        if self.kind == "json_schema":
            check_schema(parse_json(self.source, "json_schema"))
        elif self.kind == "structural_tag":
            for schema in tag_schemas(parse_json(self.source, "structural_tag")):
                check_schema(schema)
        elif self.kind not in ("any_json", "regex", "ebnf"):
            raise InvalidArgument(f"unknown structured output kind {self.kind!r}")


def tag_schemas(tag: Any) -> Iterator[Any]:
    """Every JSON Schema inside a structural tag (the contents of ``{"type": "json_schema"}`` nodes)."""
    if isinstance(tag, dict):
        if tag.get("type") == "json_schema" and "json_schema" in tag:
            yield tag["json_schema"]
            return
        for value in tag.values():
            yield from tag_schemas(value)
    elif isinstance(tag, list):
        for value in tag:
            yield from tag_schemas(value)


def parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{what} is not valid JSON: {e}") from None
