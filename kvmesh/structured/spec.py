"""A request's output constraint: one value, carried from the API to the sampler.

The gateway validates it (``check``, no tokenizer needed, so a bad grammar is a
400 before anything is routed) and workers compile it against their vocabulary.
The same ``GrammarSpec`` is the compile cache's key, so equal constraints from
different requests share one compiled grammar.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

import xgrammar as xgr

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

    def grammar(self) -> xgr.Grammar:
        """The tokenizer-independent grammar; InvalidArgument says what is wrong with the spec."""
        try:
            if self.kind == "json_schema":
                schema = _json(self.source, "json_schema")
                check_schema(schema)
                return _json_schema_grammar(self.source)
            if self.kind == "any_json":
                return xgr.Grammar.builtin_json_grammar()
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.source)
            if self.kind == "ebnf":
                return xgr.Grammar.from_ebnf(self.source)
            if self.kind == "structural_tag":
                _json(self.source, "structural_tag")
                return xgr.Grammar.from_structural_tag(self.source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidArgument(f"{self.kind}: {_xgrammar_message(e)}") from None
        raise InvalidArgument(f"unknown structured output kind {self.kind!r}")

    def check(self) -> None:
        """Raise InvalidArgument unless the constraint can be compiled and enforced."""
        self.grammar()


# xgrammar (0.2.8, 0.2.9) spells the characters of a length-bounded string as [^"\\\r\n], which lets
# raw control characters through (U+0000-U+001F must be escaped in JSON); unbounded strings get it right.
_LOOSE_STRING_CHAR = r"[^\"\\\r\n]"
_JSON_STRING_CHAR = r"[^\0-\x1f\"\\]"


def _json_schema_grammar(source: str) -> xgr.Grammar:
    grammar = xgr.Grammar.from_json_schema(source, any_whitespace=JSON_WHITESPACE, strict_mode=True)
    ebnf = str(grammar)
    if _LOOSE_STRING_CHAR not in ebnf:
        return grammar
    return xgr.Grammar.from_ebnf(ebnf.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _json(text: str, what: str) -> dict | bool:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"{what} is not valid JSON: {e}") from None


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's C++ errors start with '[time] path/file.cc:line: '; keep only what is wrong."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return _CPP_PREFIX.sub("", lines[0]) if lines else type(e).__name__


_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")
