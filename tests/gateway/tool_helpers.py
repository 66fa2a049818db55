"""What the tool-call format tests share: the grammar a request's tools compile to, whether it takes a
text, and a reply read back by a parser chunk by chunk."""

from __future__ import annotations

import json
import random

import xgrammar as xgr

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.structured.grammar import build as build_grammar
from kvmesh.structured.spec import GrammarSpec
from services.gateway.tool_calls import FORMATS
from services.gateway.tool_calls.format import ParsedCall, Piece, ToolCallParser
from services.gateway.tool_calls.request import tool_use

# Two tools: one whose arguments have required fields, bounds and no extras; one with an enum.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    gateway_pb2.Tool(name="get_weather", description="Weather forecast", parameters_json=json.dumps(WEATHER)),
    gateway_pb2.Tool(name="get_time", parameters_json=json.dumps(TIME)),
]
AUTO = gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_AUTO)
REQUIRED = gateway_pb2.ToolChoice(mode=gateway_pb2.TOOL_CHOICE_MODE_REQUIRED)
NAMED = gateway_pb2.ToolChoice(function_name="get_time")


def grammar(fmt: str, choice: gateway_pb2.ToolChoice | None = None, parallel: bool | None = None) -> GrammarSpec:
    """The grammar a chat request with TOOLS gets in format ``fmt``."""
    request = gateway_pb2.ChatRequest(tools=TOOLS, tool_choice=choice)
    if parallel is not None:
        request.parallel_tool_calls = parallel
    use = tool_use(request, FORMATS[fmt])
    assert use is not None
    return use.grammar


def accepts(spec: GrammarSpec, text: str) -> bool:
    """Whether the whole of ``text`` is a complete output under ``spec`` (no tokenizer: strings only)."""
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(build_grammar(spec))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def read_reply(parser: ToolCallParser, chunks: list[str]) -> tuple[str, list[ParsedCall]]:
    """The content and calls of a reply fed to ``parser`` in ``chunks``."""
    pieces: list[Piece] = []
    for c in chunks:
        pieces += parser.feed(c)
    pieces += parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ParsedCall)]


def splits(text: str, rng: random.Random) -> list[str]:
    """``text`` cut at up to 12 random places."""
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
