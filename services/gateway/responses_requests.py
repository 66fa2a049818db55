"""The body of POST /v1/responses (the OpenAI Responses API, text only): validation and OpenAPI schema in one.

Stricter than the chat and completions bodies: an unknown field is a 400
naming it (``extra="forbid"``), and every field the Responses API defines but
kvmesh does not serve (built-in tools, images and files, ``reasoning``,
``background``, ``include``, ``truncation`` "auto", ...) is a 400 naming it
unless its value is absent or changes nothing. A client never gets a 200 for
a request that was not served as written.

The input items are also what the response store keeps (a conversation is
input items and output items), so every output item the gateway renders
validates as an input item: clients send them back as they got them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag
from pydantic_core import PydanticCustomError

from services.gateway.openai_requests import _NOT_YET, MAX_TEMPERATURE, TokenCount, _refused
from services.gateway.tool_calls.request import NAME_PATTERN


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def _empty(value: Any) -> bool:
    return value == [] or value is False


def _only(kind: str, allowed: tuple[str, ...]) -> BeforeValidator:
    """Refuse a ``type`` the Responses API defines but kvmesh does not serve, naming it."""

    def check(value: Any) -> Any:
        found = value.get("type") if isinstance(value, dict) else None
        if isinstance(found, str) and found not in allowed:
            raise PydanticCustomError(
                "unsupported",
                "'{found}' {kind}s are not supported (only {allowed})",
                {"found": found, "kind": kind, "allowed": ", ".join(allowed)},
            )
        return value

    return BeforeValidator(check)


def _type_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type={kind}" if isinstance(kind, str) else None


# -- content -------------------------------------------------------------------


class InputText(Body):
    type: Literal["input_text"]
    text: str


class OutputText(Body):
    """A previous reply's text, as the gateway rendered it."""

    type: Literal["output_text"]
    text: str
    annotations: Annotated[
        list[Any] | None, _refused(_empty, "not supported: kvmesh writes no annotations, only [] is accepted")
    ] = None
    logprobs: Annotated[
        list[Any] | None, _refused(_empty, "not supported: kvmesh writes no logprobs here, only [] is accepted")
    ] = None


# Parts are joined with newlines before the chat template sees them, as chat content parts are.
Part = Annotated[
    Annotated[InputText, Tag("type=input_text")] | Annotated[OutputText, Tag("type=output_text")],
    Discriminator(_type_tag, custom_error_type="invalid_type", custom_error_message="type must be a part type"),
    _only("content part", ("input_text", "output_text")),
]
Content = str | list[Part]

# What a stored or echoed item may say about itself; it changes nothing.
ItemStatus = Literal["in_progress", "completed", "incomplete"]


# -- input items -----------------------------------------------------------------


class MessageItem(Body):
    """A message; ``type`` may be left out (the "easy" input message)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallItem(Body):
    """A call the model made (from a previous response's output)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = Field(description="The arguments as JSON text (an object).")
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(Body):
    """What the client's function returned, for the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Part]
    id: str | None = None
    status: ItemStatus | None = None


ITEM_TYPES = ("message", "function_call", "function_call_output")


def _item_tag(value: Any) -> str | None:
    if isinstance(value, dict) and "type" not in value:
        return "type=message"
    return _type_tag(value)


Item = Annotated[
    Annotated[MessageItem, Tag("type=message")]
    | Annotated[FunctionCallItem, Tag("type=function_call")]
    | Annotated[FunctionCallOutputItem, Tag("type=function_call_output")],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_type",
        custom_error_message="an item's type must be one of " + ", ".join(ITEM_TYPES),
    ),
    _only("item", ITEM_TYPES),
]

# -- tools and formats -----------------------------------------------------------


class FunctionTool(Body):
    """Responses' function tool: flat, without chat's ``function`` wrapper."""

    type: Literal["function"]
    name: str = Field(pattern=NAME_PATTERN, description="Unique within the request.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments, an object schema. Default: any object."
    )
    strict: bool | None = Field(None, description="Accepted; calls always follow the schema.")


Tool = Annotated[FunctionTool, _only("tool", ("function",))]


class NamedFunction(Body):
    type: Literal["function"]
    name: str = Field(min_length=1)


def _tool_choice_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "mode="
    return _type_tag(value)


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode=")] | Annotated[NamedFunction, Tag("type=function")],
    Discriminator(
        _tool_choice_tag,
        custom_error_type="invalid_tool_choice",
        custom_error_message="tool_choice must be 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...}',
    ),
    _only("tool choice", ("function",)),
]


class FormatText(Body):
    type: Literal["text"]


class FormatJsonObject(Body):
    type: Literal["json_object"] = Field(description="Any JSON object.")


class FormatJsonSchema(Body):
    # The response repeats the format: "schema" there too.
    model_config = ConfigDict(serialize_by_alias=True)

    type: Literal["json_schema"]
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: the field has another name, the JSON key is "schema".
    json_schema: dict[str, Any] = Field(alias="schema", description="The JSON Schema the reply follows.")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


Format = Annotated[
    Annotated[FormatText, Tag("type=text")]
    | Annotated[FormatJsonObject, Tag("type=json_object")]
    | Annotated[FormatJsonSchema, Tag("type=json_schema")],
    Discriminator(
        _type_tag,
        custom_error_type="invalid_type",
        custom_error_message="type must be one of text, json_object, json_schema",
    ),
]


class TextConfig(Body):
    format: Format | None = Field(None, description="Default: text.")
    verbosity: Annotated[Literal["medium"] | None, _refused(lambda v: v == "medium", "not supported")] = None


class ResponseStreamOptions(Body):
    include_obfuscation: Annotated[bool | None, _refused(lambda v: v is False, "not supported: only false")] = None


# -- the request -------------------------------------------------------------------


def _as_items(value: Any) -> Any:
    # A string is one user message. Made an item before validation, so that a bad item's errors
    # are not mixed with "not a string" (one union member each).
    return [{"role": "user", "content": value}] if isinstance(value, str) else value


Items = Annotated[list[Item], Field(min_length=1)]
Input = Annotated[Items, BeforeValidator(_as_items, json_schema_input_type=str | Items)]

Metadata = Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)]


class ResponseRequest(Body):
    model: str = Field(min_length=1, description="A model id from GET /v1/models.")
    input: Input = Field(
        description="A user message's text, or a list of items: messages, function calls and their outputs."
    )
    instructions: str | None = Field(
        None, description="A system message ahead of the conversation; not carried over by previous_response_id."
    )
    previous_response_id: str | None = Field(
        None, description="Continue that stored response's conversation (its input and output) with this input."
    )
    store: bool | None = Field(None, description="Keep the response for previous_response_id and GET. Default: true.")
    metadata: Metadata | None = Field(None, description="Up to 16 string pairs, returned with the response.")
    max_output_tokens: TokenCount | None = Field(None, description="Default: up to the model's context.")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0: greedy. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool | None = False
    stream_options: ResponseStreamOptions | None = None
    text: TextConfig | None = None
    tools: list[Tool] | None = Field(None, description="Functions the model may call (function tools only).")
    tool_choice: ToolChoice | None = Field(None, description="Default: auto (none without tools). Needs tools.")
    parallel_tool_calls: bool | None = Field(None, description="Allow several calls in one reply. Default: true.")
    user: str | None = Field(None, description="The end user, for logs.")
    # Defined by the Responses API, not served: refused unless absent or harmless.
    background: Annotated[bool | None, _refused(lambda v: v is False, "not supported: only false")] = None
    include: Annotated[list[Any] | None, _refused(_empty, "not supported: kvmesh adds nothing, only []")] = None
    truncation: Annotated[
        Literal["disabled"] | None, _refused(lambda v: v == "disabled", "not supported: only 'disabled'")
    ] = None
    service_tier: Annotated[
        Literal["auto", "default"] | None, _refused(lambda v: v in ("auto", "default"), "not supported")
    ] = None
    reasoning: Annotated[None, _NOT_YET] = None
    conversation: Annotated[None, _NOT_YET] = None
    prompt: Annotated[None, _NOT_YET] = None
    prompt_cache_key: Annotated[None, _NOT_YET] = None
    prompt_cache_retention: Annotated[None, _NOT_YET] = None
    safety_identifier: Annotated[None, _NOT_YET] = None
    max_tool_calls: Annotated[None, _NOT_YET] = None
    top_logprobs: Annotated[None, _NOT_YET] = None
