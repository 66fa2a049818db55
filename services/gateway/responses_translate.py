"""From a Responses request and the conversation it continues to the gateway core's ``ChatRequest``.

A conversation is a list of items; they become chat messages: a message item
is a message (its parts joined by newlines, as chat's are), the
``function_call`` items that follow an assistant message are that message's
tool calls (a reply with text and calls renders as a message item and then
call items), other ``function_call`` items an assistant message of their own,
and a ``function_call_output`` is a tool message. ``instructions`` go first, as
a system message of this request only.

Sampling, ``text.format`` and tools go through ``openai_translate``'s helpers,
so the Responses API and chat completions cannot map the same setting two
ways; the core checks what spans fields (a tool_choice naming an undeclared
tool, a format together with tools), naming the gRPC field, which
``responses_param`` spells as the Responses request does.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from kvmesh.api.gateway.v1 import gateway_pb2
from services.gateway.openai_translate import add_function, json_output, sampling, tool_choice
from services.gateway.responses_requests import (
    FormatJsonObject,
    FormatJsonSchema,
    FunctionCallItem,
    FunctionCallOutputItem,
    Item,
    MessageItem,
    Part,
    ResponseRequest,
)


def chat_request(req: ResponseRequest, conversation: Sequence[Item]) -> gateway_pb2.ChatRequest:
    """The request that continues ``conversation`` (the stored one, then this request's input)."""
    params = sampling(req.max_output_tokens, req.temperature, req.top_p)
    text_format = req.text.format if req.text is not None else None
    if isinstance(text_format, FormatJsonObject):
        params.structured_output.CopyFrom(json_output(None))
    elif isinstance(text_format, FormatJsonSchema):
        params.structured_output.CopyFrom(json_output(text_format.json_schema))
    request = gateway_pb2.ChatRequest(
        model=req.model, messages=chat_messages(req.instructions, conversation), sampling=params, user=req.user or ""
    )
    for tool in req.tools or ():
        add_function(request, tool.name, tool.description, tool.parameters)
    choice = req.tool_choice
    if choice is not None:
        request.tool_choice.CopyFrom(tool_choice(choice) if isinstance(choice, str) else tool_choice(None, choice.name))
    if req.parallel_tool_calls is not None:
        request.parallel_tool_calls = req.parallel_tool_calls
    return request


def chat_messages(instructions: str | None, items: Sequence[Item]) -> list[gateway_pb2.ChatMessage]:
    messages = [] if instructions is None else [gateway_pb2.ChatMessage(role="system", content=instructions)]
    for item in items:
        if isinstance(item, MessageItem):
            messages.append(gateway_pb2.ChatMessage(role=item.role, content=_text(item.content)))
        elif isinstance(item, FunctionCallItem):
            if not messages or messages[-1].role != "assistant":
                messages.append(gateway_pb2.ChatMessage(role="assistant"))
            messages[-1].tool_calls.add(id=item.call_id, name=item.name, arguments=item.arguments)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(gateway_pb2.ChatMessage(role="tool", content=_text(item.output), tool_call_id=item.call_id))
    return messages


def _text(content: str | list[Part]) -> str:
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


# ChatRequest fields (after "[i]" became ".i") as the Responses request spells them.
_RENAMED = (
    (re.compile(r"sampling\.structured_output"), "text.format"),
    (re.compile(r"sampling\.max_tokens"), "max_output_tokens"),
    (re.compile(r"sampling\.(\w+)"), r"\1"),
    (re.compile(r"tool_choice\..+"), "tool_choice"),
    (re.compile(r"tools\.(\d+)\.parameters_json"), r"tools.\1.parameters"),
    # A message may stand for several items (calls), and the instructions come first: no index.
    (re.compile(r"messages\..+"), "input"),
)


def responses_param(field: str) -> str:
    """A ChatRequest field path ("tools[1].parameters_json") as the request's parameter ("tools.1.parameters")."""
    dotted = re.sub(r"\[(\d+)\]", r".\1", field)
    for pattern, spelling in _RENAMED:
        if pattern.fullmatch(dotted):
            return pattern.sub(spelling, dotted)
    return dotted
