"""The OpenAI response bodies the gateway sends, as pydantic models.

Every body goes out through these models (``model_dump_json``), so the
OpenAPI document built from them describes exactly what is sent.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens whose KV came from a cache instead of being computed.")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    timings: dict[str, float] | None = Field(
        None,
        exclude_if=lambda v: v is None,
        description="kvmesh extension, with return_timings: milliseconds per phase of the request (its slowest "
        "choice): tokenize, route, prefill_queue, prefill, kvstore, kv_transfer, decode_queue, first_token, total.",
    )


# -- completions ---------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None = Field(description="null in stream chunks until the choice ends.")


class Completion(BaseModel):
    """A whole completion, and also each chunk of a streamed one (as OpenAI does)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(description="null in stream chunks, except the usage chunk of include_usage.")
    system_fingerprint: str | None = Field(
        None,
        description="The serving configuration that produced it (model, dtype, kernels; docs/determinism.md); "
        "in stream chunks, on the chunks that end a choice and the usage chunk.",
    )


# -- chat ----------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class CalledFunction(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of an object that validates against the tool's parameters.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ToolCallDelta(ToolCall):
    """A whole call, in the chunk that completed it."""

    index: int = Field(description="The call's position among the choice's calls.")


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = Field(description="null when the reply is tool calls only.")
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = Field(
        None,
        description="The serving configuration that produced it (model, dtype, kernels; docs/determinism.md); "
        "in stream chunks, on the chunks that end a choice and the usage chunk.",
    )


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, description="Set on a choice's first chunk.")
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = Field(
        None,
        description="The serving configuration that produced it (model, dtype, kernels; docs/determinism.md); "
        "in stream chunks, on the chunks that end a choice and the usage chunk.",
    )


# -- the rest ------------------------------------------------------------------


class Model(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    max_model_len: int = Field(description="Longest prompt + completion, in tokens.")
    parent: str | None = Field(None, description="For a LoRA adapter: the base model it adapts.")


class Unloaded(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class Health(BaseModel):
    status: Literal["ok", "draining"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Tokenized(BaseModel):
    """vLLM's /tokenize answer."""

    count: int
    max_model_len: int
    tokens: list[int]


class Detokenized(BaseModel):
    """vLLM's /detokenize answer."""

    prompt: str
