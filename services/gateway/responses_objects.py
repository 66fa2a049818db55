"""The Responses API's bodies the gateway sends: the response object, its output items and the stream's events.

Every body goes out through these models (``model_dump_json``), so the
OpenAPI document built from them describes what is sent. Output items are
shaped so that they validate as input items (``responses_requests``): clients
send a previous output back as input, and the store keeps conversations as
input items.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from services.gateway.responses_requests import Format, FunctionTool, ItemStatus, NamedFunction


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list, description="Always empty.")


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"] = "function_call"
    status: ItemStatus
    call_id: str = Field(description="What the function_call_output item that answers it names.")
    name: str
    arguments: str = Field(description="JSON text of an object that validates against the tool's parameters.")


OutputItem = Annotated[OutputMessage | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Input tokens whose KV came from a cache instead of being computed.")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(0, description="Always 0.")


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = Field(
        description="The reply reached max_output_tokens or the context (or the repetition guard cut it)."
    )


class TextSettings(BaseModel):
    format: Format


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    text: TextSettings
    tool_choice: Literal["none", "auto", "required"] | NamedFunction
    tools: list[FunctionTool]
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    usage: ResponseUsage | None = Field(description="null until the response is done (in stream events).")
    user: str | None
    metadata: dict[str, str]


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


# -- stream events ------------------------------------------------------------------


class ResponseEvent(BaseModel):
    """The response as it stands: created and in progress first, then completed or incomplete last."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    sequence_number: int
    response: Response


class OutputItemEvent(BaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(BaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = Field(default_factory=list, description="Always empty.")


class TextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = Field(default_factory=list, description="Always empty.")


class ArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"] = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str = Field(description="A call's arguments come whole, in one delta, once the call is complete.")


class ArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(BaseModel):
    """A failure after the stream began; it is the last event."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None
    message: str
    param: str | None


StreamEvent = (
    ResponseEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent
)
