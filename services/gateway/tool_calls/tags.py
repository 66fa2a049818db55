"""The parts of xgrammar structural tags that every format builds its grammar from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from services.gateway.tool_calls.format import Tool


def call_tags(tools: Sequence[Tool], begin: Callable[[str], str], end: str) -> list[dict[str, Any]]:
    """One tag per tool: a call of it is ``begin(name)`` (its text up to the arguments), the arguments, ``end``."""
    return [
        {
            "type": "tag",
            "begin": begin(tool.name),
            "content": {"type": "json_schema", "json_schema": tool.parameters},
            "end": end,
        }
        for tool in tools
    ]


def separated(tags: list[dict[str, Any]], separator: str, single: bool) -> dict[str, Any]:
    """One call or more (only one when ``single``), ``separator`` between them."""
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": single,
    }
