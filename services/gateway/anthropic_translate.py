"""From a validated Anthropic Messages request to the gateway core's ChatRequest (one choice).

The conversation maps onto chat roles the way chat templates know them:
``system`` becomes a system message; an assistant turn's text blocks join
into its content and its tool_use blocks become its tool calls (the input as
JSON arguments); a user turn's tool_result blocks become tool messages
(answering the call by id) and its text blocks user messages, in their order.
``tool_choice`` any is the core's "required", tool names the function, and
``disable_parallel_tool_use`` turns parallel calls off. The deeper checks
(tool schemas, a choice naming an undeclared tool) are the core's.
"""

from __future__ import annotations

import json

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from services.gateway.anthropic_requests import (
    AssistantTurn,
    MessagesRequest,
    TextBlock,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolResultBlock,
    ToolUseBlock,
    UserTurn,
)
from services.gateway.openai_errors import ParamError
from services.gateway.openai_translate import FLOAT32_TINY

# Chat templates have no error flag: the model reads that a result is an error.
ERROR_PREFIX = "Error: "


def chat_request(req: MessagesRequest) -> gateway_pb2.ChatRequest:
    if isinstance(req.messages[-1], AssistantTurn):
        # Anthropic continues a final assistant turn; a chat template would close it and start a new one.
        where = f"messages.{len(req.messages) - 1}"
        raise ParamError(f"{where}: a final assistant message (a prefill to continue) is not supported", where)
    user = req.metadata.user_id if req.metadata is not None else None
    chat = gateway_pb2.ChatRequest(model=req.model, sampling=_sampling(req), user=user or "")
    if req.system is not None:
        chat.messages.add(role="system", content=_text(req.system))
    for message in req.messages:
        chat.messages.extend(_user(message) if isinstance(message, UserTurn) else [_assistant(message)])
    for tool in req.tools or ():
        schema = json.dumps(tool.input_schema)
        chat.tools.add(name=tool.name, description=tool.description or "", parameters_json=schema)
    if req.tool_choice is not None:
        _tool_choice(req.tool_choice, chat)
    return chat


def _sampling(req: MessagesRequest) -> sampling_pb2.SamplingParams:
    params = sampling_pb2.SamplingParams(max_tokens=req.max_tokens, stop=req.stop_sequences or (), top_k=req.top_k or 0)
    if req.temperature is not None:
        params.temperature = req.temperature
    if req.top_p is not None:
        params.top_p = max(req.top_p, FLOAT32_TINY)  # as chat does: a float32 0 would be refused
    return params


def _text(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _user(message: UserTurn) -> list[gateway_pb2.ChatMessage]:
    """Tool messages for the results, user messages for runs of text blocks, in the blocks' order."""
    out: list[gateway_pb2.ChatMessage] = []
    texts: list[TextBlock] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            texts.append(block)
            continue
        if texts:
            out.append(gateway_pb2.ChatMessage(role="user", content=_text(texts)))
            texts = []
        out.append(_tool_result(block))
    if texts:
        out.append(gateway_pb2.ChatMessage(role="user", content=_text(texts)))
    return out


def _tool_result(block: ToolResultBlock) -> gateway_pb2.ChatMessage:
    content = _text(block.content or [])
    if block.is_error:
        content = ERROR_PREFIX + content
    return gateway_pb2.ChatMessage(role="tool", content=content, tool_call_id=block.tool_use_id)


def _assistant(message: AssistantTurn) -> gateway_pb2.ChatMessage:
    texts = [b for b in message.content if isinstance(b, TextBlock)]
    out = gateway_pb2.ChatMessage(role="assistant", content=_text(texts))
    for call in message.content:
        if isinstance(call, ToolUseBlock):
            out.tool_calls.add(id=call.id, name=call.name, arguments=json.dumps(call.input))
    return out


def _tool_choice(choice: ToolChoice, chat: gateway_pb2.ChatRequest) -> None:
    if isinstance(choice, ToolChoiceNone):
        chat.tool_choice.mode = gateway_pb2.TOOL_CHOICE_MODE_NONE
        return
    if isinstance(choice, ToolChoiceAuto):
        chat.tool_choice.mode = gateway_pb2.TOOL_CHOICE_MODE_AUTO
    elif isinstance(choice, ToolChoiceAny):
        chat.tool_choice.mode = gateway_pb2.TOOL_CHOICE_MODE_REQUIRED
    else:
        chat.tool_choice.function_name = choice.name
    if choice.disable_parallel_tool_use is not None:
        chat.parallel_tool_calls = not choice.disable_parallel_tool_use
