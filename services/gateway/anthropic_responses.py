"""The Anthropic Messages bodies the gateway sends (the message, its stream events, errors), as pydantic models.

Every body of POST /v1/messages goes out through these models, so the OpenAPI
document built from them describes exactly what is sent.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(description="A tool_result block answers the call by this id.")
    name: str
    input: dict[str, Any] = Field(description="The call's arguments; {} in content_block_start (streamed).")


ContentBlock = Annotated[TextContent | ToolUseContent, Field(discriminator="type")]


class MessageUsage(BaseModel):
    input_tokens: int = Field(description="Prompt tokens computed (not read from cache).")
    output_tokens: int
    cache_read_input_tokens: int = Field(description="Prompt tokens whose KV came from a cache.")


class Message(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None = Field(description="null only in message_start.")
    stop_sequence: str | None = Field(description="With stop_reason stop_sequence: the one that ended the reply.")
    usage: MessageUsage


# -- stream events ---------------------------------------------------------------


class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: Message = Field(description="No content yet; usage is counted in message_delta.")


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str = Field(description="The call's arguments: all of them, in one delta.")


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | InputJsonDelta, Field(discriminator="type")]


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageEnd(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageEnd
    usage: MessageUsage


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta | MessageStop


# -- errors ----------------------------------------------------------------------

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "timeout_error",
    "overloaded_error",
]


class AnthropicErrorDetail(BaseModel):
    type: ErrorType
    message: str


class AnthropicErrorResponse(BaseModel):
    """An error answer, and the stream's ``error`` event after the headers went out."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail
