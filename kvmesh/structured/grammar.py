"""A constraint's grammar, built with xgrammar (which imports torch: workers only).

``build(spec)`` is the tokenizer-independent grammar the engine compiles against its vocabulary
(``kvmesh.engine.grammar``), with InvalidArgument saying what is wrong with a spec xgrammar refuses.
JSON Schemas go through ``check_schema`` first (keywords the grammar would silently drop are refused),
also inside structural tags, whose ``json_schema`` contents are built here the same way.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import xgrammar as xgr

from kvmesh.errors import InvalidArgument
from kvmesh.structured.json_schema import check_schema
from kvmesh.structured.spec import JSON_WHITESPACE, GrammarSpec, parse_json


def build(spec: GrammarSpec) -> xgr.Grammar:
    """The tokenizer-independent grammar; InvalidArgument says what is wrong with the spec."""
    try:
        if spec.kind == "json_schema":
            check_schema(parse_json(spec.source, "json_schema"))
            return _json_schema_grammar(spec.source)
        if spec.kind == "any_json":
            return xgr.Grammar.builtin_json_grammar()
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.source)
        if spec.kind == "structural_tag":
            tag = _with_schema_grammars(parse_json(spec.source, "structural_tag"))
            return xgr.Grammar.from_structural_tag(json.dumps(tag))
    except (RuntimeError, ValueError, TypeError) as e:
        raise InvalidArgument(f"{spec.kind}: {_xgrammar_message(e)}") from None
    raise InvalidArgument(f"unknown structured output kind {spec.kind!r}")


def _with_schema_grammars(tag: Any) -> Any:
    """The tag with each ``{"type": "json_schema", "json_schema": S}`` node replaced by S's grammar as
    ``{"type": "grammar", "grammar": <EBNF>}``: the one JSON Schema grammar (compact JSON, strict strings)
    serves tool arguments as it serves ``json_schema`` constraints."""
    tag = copy.deepcopy(tag)

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                check_schema(node["json_schema"])
                return {"type": "grammar", "grammar": str(_json_schema_grammar(json.dumps(node["json_schema"])))}
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(tag)


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


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's C++ errors start with '[time] path/file.cc:line: '; keep only what is wrong."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return _CPP_PREFIX.sub("", lines[0]) if lines else type(e).__name__


_CPP_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+\.cc:\d+:\s*")
