"""A chat request's tools and tool choice, validated into what the template shows and what the grammar allows.

Every problem is an ``InvalidField`` naming the field and saying what is
wrong: a bad tool name or a repeated one, parameters that are not an object
schema or use a keyword the grammar cannot enforce, a ``tool_choice`` naming
an undeclared tool or set without tools, and tools together with
``sampling.structured_output`` (one reply has one grammar).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import InvalidArgument, InvalidField
from kvmesh.structured.spec import GrammarSpec
from services.gateway.tool_calls.format import CallPolicy, Tool, ToolCallFormat
from services.gateway.validation import check_grammar

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"
_NAME = re.compile(NAME_PATTERN)
# The arguments of a tool declared without parameters: any object.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolUse:
    """Tools the reply may call: shown to the model, enforced by ``grammar``, parsed back by the format."""

    tools: tuple[Tool, ...]
    grammar: GrammarSpec  # the format's structural tag for the calls tool_choice allows

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.for_template() for t in self.tools]


def tool_use(request: gateway_pb2.ChatRequest, fmt: ToolCallFormat) -> ToolUse | None:
    """None when the reply is plain text: no tools, or ``tool_choice`` none (the tools are then left out of
    the prompt)."""
    if not request.tools:
        if request.HasField("tool_choice"):
            raise InvalidField("tool_choice", "tool_choice is set but no tools are declared")
        return None
    if GrammarSpec.from_pb(request.sampling.structured_output) is not None:
        raise InvalidField(
            "sampling.structured_output",
            "a structured output (response format) cannot be combined with tools: a reply follows one grammar",
        )
    tools = _tools(request.tools)
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    choice = request.tool_choice
    which = choice.WhichOneof("choice")
    if which == "function_name":
        chosen = next((t for t in tools if t.name == choice.function_name), None)
        if chosen is None:
            declared = ", ".join(t.name for t in tools)
            raise InvalidField(
                "tool_choice.function_name",
                f"tool_choice names the function {choice.function_name!r}, which is not declared (tools: {declared})",
            )
        policy = CallPolicy((chosen,), required=True, single=True)
    elif which is None or choice.mode in (gateway_pb2.TOOL_CHOICE_MODE_UNSPECIFIED, gateway_pb2.TOOL_CHOICE_MODE_AUTO):
        policy = CallPolicy(tools, required=False, single=not parallel)
    elif choice.mode == gateway_pb2.TOOL_CHOICE_MODE_REQUIRED:
        policy = CallPolicy(tools, required=True, single=not parallel)
    elif choice.mode == gateway_pb2.TOOL_CHOICE_MODE_NONE:
        return None
    else:
        raise InvalidField("tool_choice.mode", f"unknown tool_choice mode {choice.mode}")
    grammar = GrammarSpec("structural_tag", json.dumps(fmt.structural_tag(policy)))
    try:
        check_grammar(grammar)
    except InvalidArgument as e:
        raise InvalidField("tools", f"the tools' grammar cannot be built: {e.message}") from None
    return ToolUse(tools, grammar)


def _tools(declared: list[gateway_pb2.Tool]) -> tuple[Tool, ...]:
    tools: list[Tool] = []
    for i, t in enumerate(declared):
        if not _NAME.match(t.name):
            raise InvalidField(f"tools[{i}].name", f"tool name {t.name!r} must match {NAME_PATTERN}")
        if any(seen.name == t.name for seen in tools):
            raise InvalidField(f"tools[{i}].name", f"tool name {t.name!r} is declared twice")
        schema = _parameters(i, t)
        try:
            check_grammar(GrammarSpec.json_schema(schema))
        except InvalidArgument as e:
            raise InvalidField(f"tools[{i}].parameters_json", f"tool {t.name!r} parameters: {e.message}") from None
        tools.append(Tool(t.name, t.description, schema))
    return tuple(tools)


def _parameters(i: int, tool: gateway_pb2.Tool) -> dict[str, Any]:
    if not tool.parameters_json:
        return ANY_OBJECT
    field = f"tools[{i}].parameters_json"
    try:
        schema = json.loads(tool.parameters_json)
    except json.JSONDecodeError as e:
        raise InvalidField(field, f"tool {tool.name!r}: parameters are not valid JSON: {e}") from None
    if schema == {}:
        return ANY_OBJECT
    if not isinstance(schema, dict) or schema.get("type") != "object":
        raise InvalidField(
            field, f'tool {tool.name!r}: parameters must be a JSON Schema of an object ("type": "object")'
        )
    return schema
