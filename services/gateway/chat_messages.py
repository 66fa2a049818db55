"""A conversation as chat templates take it: the dicts transformers passes to ``apply_chat_template``.

An assistant's calls become ``{"id", "type": "function", "function": {"name",
"arguments"}}`` with the arguments parsed into an object (templates write them
out with ``tojson``); a tool message keeps its ``tool_call_id``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import InvalidArgument, InvalidField


def template_messages(messages: Sequence[gateway_pb2.ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise InvalidArgument("messages is empty")
    rendered = []
    for i, m in enumerate(messages):
        if not m.role:
            raise InvalidField(f"messages[{i}].role", f"messages[{i}].role is empty")
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.name:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [_call(i, j, call) for j, call in enumerate(m.tool_calls)]
        if m.tool_call_id:
            message["tool_call_id"] = m.tool_call_id
        rendered.append(message)
    return rendered


def _call(i: int, j: int, call: gateway_pb2.ToolCall) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    if not call.name:
        raise InvalidField(f"{where}.name", f"{where}.name is empty")
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except json.JSONDecodeError as e:
        raise InvalidField(f"{where}.arguments", f"{where}.arguments is not valid JSON: {e}") from None
    if not isinstance(arguments, dict):
        raise InvalidField(f"{where}.arguments", f"{where}.arguments must be a JSON object")
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
