"""The Anthropic Messages request body (POST /v1/messages): one pydantic model is both the validation and the schema.

Parsing is strict in the style of ``openai_requests`` (JSON types as the
schema says), with one difference: nothing is ignored. A field Anthropic
defines that kvmesh does not serve (``thinking``, ``output_config``, ...) is a
400 saying so, and a field nobody defines is a 400 naming it
(``extra="forbid"``; the gateway's --lenient-fields drops those instead): a
client never gets a 200 for a request that was not served as written.
``cache_control`` is served: the prefix cache caches every prompt unasked.
Content blocks other than text, tool_use and tool_result (images, documents,
thinking, ...) and tools other than custom ones (the server tools) are
refused the same way.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from services.gateway.openai_requests import TokenCount, TopK
from services.gateway.tool_calls.request import NAME_PATTERN


def _not_served(value: Any) -> Any:
    if value is not None:
        raise PydanticCustomError("unsupported", "not supported by kvmesh")
    return value


# A field Anthropic defines that is not served: absent (or null) is fine, any value is a 400.
NotServed = Annotated[None, BeforeValidator(_not_served)]


class Body(BaseModel):
    # An unknown field is a 400 naming it (``openai_errors``), or dropped with --lenient-fields (``parse``).
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class CacheControl(Body):
    """A prompt-caching breakpoint. Served as asked: the router's prefix cache keeps every prompt's full blocks
    without being told where, so a marked prefix is read from cache as Anthropic's would be."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


def _blocks_of(*served: str) -> BeforeValidator:
    """Refuse a content block whose type is not one of ``served``, naming its type."""

    def check(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind not in served:
            raise PydanticCustomError(
                "unsupported",
                "'{kind}' content blocks are not supported (served: {served})",
                {"kind": kind, "served": ", ".join(served)},
            )
        return value

    return BeforeValidator(check)


def _type_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type={kind}" if isinstance(kind, str) else None


class TextBlock(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: NotServed = None


def _blocks(block: Any) -> BeforeValidator:
    """Content: a string (one text block) or a list of ``block``s. The string becomes its block here, so that
    errors point into the list instead of also saying "not a string"."""

    def as_blocks(value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value

    return BeforeValidator(as_blocks, json_schema_input_type=str | list[block])


# Blocks are joined with newlines before the chat template sees them.
Text = Annotated[TextBlock, _blocks_of("text")]
TextContent = Annotated[list[Text], _blocks(Text)]


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any] = Field(description="The call's arguments.")
    cache_control: CacheControl | None = None
    caller: NotServed = None


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, description="The id of the tool_use block this answers.")
    content: TextContent | None = None
    is_error: bool | None = Field(None, description="The model reads the result's text after 'Error: '.")
    cache_control: CacheControl | None = None


# Tags are "type=<type>", so that error locations leave them out (as openai_requests' are).
_BLOCK_TYPE = Discriminator(_type_tag, custom_error_type="invalid_type", custom_error_message="a block needs a type")
UserBlock = Annotated[
    Annotated[
        Annotated[TextBlock, Tag("type=text")] | Annotated[ToolResultBlock, Tag("type=tool_result")], _BLOCK_TYPE
    ],
    _blocks_of("text", "tool_result"),
]
AssistantBlock = Annotated[
    Annotated[Annotated[TextBlock, Tag("type=text")] | Annotated[ToolUseBlock, Tag("type=tool_use")], _BLOCK_TYPE],
    _blocks_of("text", "tool_use"),
]


class UserTurn(Body):
    role: Literal["user"]
    content: Annotated[list[UserBlock], _blocks(UserBlock)]


class AssistantTurn(Body):
    role: Literal["assistant"]
    content: Annotated[list[AssistantBlock], _blocks(AssistantBlock)]


ROLES = ("user", "assistant")


def _role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return f"role={role}" if role in ROLES else None


Message = Annotated[
    Annotated[UserTurn, Tag("role=user")] | Annotated[AssistantTurn, Tag("role=assistant")],
    Discriminator(_role, custom_error_type="invalid_role", custom_error_message="role must be user or assistant"),
]


class Tool(Body):
    name: str = Field(pattern=NAME_PATTERN, description="Unique within the request.")
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="JSON Schema of the input, an object schema.")
    type: Literal["custom"] | None = Field(None, description="Only custom tools: server tools are not served.")
    cache_control: CacheControl | None = None
    strict: bool | None = Field(None, description="Accepted; calls always follow the schema.")
    allowed_callers: NotServed = None
    defer_loading: NotServed = None
    eager_input_streaming: NotServed = None
    input_examples: NotServed = None


def _custom_tools_only(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind != "custom":
        raise PydanticCustomError("unsupported", "'{kind}' tools are not supported (only custom tools)", {"kind": kind})
    return value


class ToolChoiceAuto(Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool | None = None


class ToolChoiceAny(Body):
    type: Literal["any"] = Field(description="At least one tool call.")
    disable_parallel_tool_use: bool | None = None


class ToolChoiceTool(Body):
    type: Literal["tool"] = Field(description="Exactly one call of the named tool.")
    name: str = Field(min_length=1)
    disable_parallel_tool_use: bool | None = None


class ToolChoiceNone(Body):
    type: Literal["none"]


ToolChoice = Annotated[
    Annotated[ToolChoiceAuto, Tag("type=auto")]
    | Annotated[ToolChoiceAny, Tag("type=any")]
    | Annotated[ToolChoiceTool, Tag("type=tool")]
    | Annotated[ToolChoiceNone, Tag("type=none")],
    Discriminator(
        _type_tag,
        custom_error_type="invalid_tool_choice",
        custom_error_message="tool_choice.type must be one of auto, any, tool, none",
    ),
]


class Metadata(Body):
    user_id: str | None = Field(None, description="The end user, for logs.")


StopSequence = Annotated[str, Field(min_length=1)]


class MessagesRequest(Body):
    model: str = Field(min_length=1, description="A model id from GET /v1/models.")
    max_tokens: TokenCount = Field(description="The most tokens to generate.")
    messages: list[Message] = Field(min_length=1)
    system: TextContent | None = Field(None, description="Sent to the model as a system message.")
    tools: list[Annotated[Tool, BeforeValidator(_custom_tools_only)]] | None = Field(
        None, description="Functions the model may call."
    )
    tool_choice: ToolChoice | None = Field(None, description="Default: auto. Needs tools.")
    stop_sequences: list[StopSequence] | None = Field(None, description="Stop before any of these strings.")
    temperature: float | None = Field(None, ge=0, le=1, description="0: greedy. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = Field(None, description="0 = off.")
    stream: bool | None = False
    metadata: Metadata | None = None
    # Defined by Anthropic, not served.
    thinking: NotServed = None
    output_config: NotServed = None
    cache_control: CacheControl | None = None
    container: NotServed = None
    service_tier: NotServed = None
    speed: NotServed = None
    inference_geo: NotServed = None
    diagnostics: NotServed = None
    user_profile_id: NotServed = None
    workspace_id: NotServed = None
