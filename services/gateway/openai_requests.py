"""The OpenAI request bodies the gateway accepts: one pydantic model is both the validation and the OpenAPI schema.

Parsing is strict (JSON types as the schema says: no "5" for 5, no true for 1;
16.0 is the integer 16, as in JSON Schema) and every field is one of three kinds:

- supported: mapped onto the request's sampling parameters;
- known but only accepted where harmless (``echo`` false, ...): the schema
  allows exactly those values, and any other gets a 400 saying the feature is
  not supported;
- unknown: a 400 naming it, because a 200 for a request we did not serve as
  written is worse than an error (``--lenient-fields`` ignores them instead,
  for clients that send junk: ``openai_serving.parse``).

vLLM's extensions are served under vLLM's names (``stop_token_ids``,
``min_tokens``, ``guided_json``, ``chat_template_kwargs``, ...), so a client
written for vLLM gets what it asked for or a 400, never a silent default.

What the schema cannot say (a JSON Schema the grammar cannot enforce, a
``tool_choice`` naming an undeclared tool, ...) the gateway core checks, for
the gRPC API too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, RootModel, Tag
from pydantic_core import PydanticCustomError

from kvmesh.sampling import (
    LOGIT_BIAS_LIMIT,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    PENALTY_LIMIT,
    REPETITION_PENALTY_MAX,
)
from services.gateway.tool_calls.request import NAME_PATTERN

UINT32_MAX = 2**32 - 1
# OpenAI's limits.
MAX_N = 128
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # int64 like OpenAI, or any uint64 (the mesh's seed type)


def _refused(accept: Callable[[Any], bool], why: str) -> BeforeValidator:
    """Refuse a field's value with ``why`` unless it is absent/null or ``accept`` says it is harmless."""

    def check(value: Any) -> Any:
        if value is not None and not accept(value):
            raise PydanticCustomError("unsupported", why)
        return value

    return BeforeValidator(check)


def _never(_: Any) -> bool:
    return False


# Messages name no field: the error reports it ("tools: not supported yet").
_NOT_YET = _refused(_never, "not supported yet")


def _whole_number(value: Any) -> Any:
    # JSON has one number type: 16.0 is the integer 16 (JSON Schema agrees). Anything else is
    # left to strict validation, which refuses strings, booleans and fractions.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _integer(ge: int, le: int) -> Any:
    # The bounds go before the validator, or pydantic's JSON schema misnames them ("ge" for "minimum").
    return Annotated[int, Field(ge=ge, le=le), BeforeValidator(_whole_number)]


Choices = _integer(1, MAX_N)
TokenCount = _integer(1, UINT32_MAX)
Seed = _integer(SEED_MIN, SEED_MAX)
TopK = _integer(0, UINT32_MAX)
TopLogprobs = _integer(0, MAX_TOP_LOGPROBS)
TokenId = _integer(0, UINT32_MAX)
MinTokens = _integer(0, UINT32_MAX)


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


# -- shared pieces -------------------------------------------------------------

Text = Annotated[str, Field(min_length=1)]


class StreamOptions(Body):
    include_usage: bool | None = Field(None, description="Send a last chunk with the request's usage (and no choices).")


def _token_id_keys(value: Any) -> Any:
    # JSON object keys are strings: logit_bias names token ids as "123".
    if isinstance(value, dict):
        for key in value:
            if not (isinstance(key, str) and key.isdigit() and int(key) <= UINT32_MAX):
                raise PydanticCustomError(
                    "token_id", "keys must be token ids (decimal strings), got {key!r}", {"key": key}
                )
    return value


class SamplingFields(Body):
    """What completions and chat share."""

    model: str = Field(min_length=1, description="A model id from GET /v1/models.")
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE, description="0: greedy. Default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    n: Choices | None = Field(None, description="Choices to generate; each runs as its own request.")
    stop: Text | list[Text] | None = Field(None, description="Stop before any of these strings (not included).")
    seed: Seed | None = Field(None, description="Reproducible sampling; choice i of n uses seed + i.")
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    return_timings: bool | None = Field(
        None,
        description="kvmesh extension: usage.timings says where the request's time went (streamed: in the "
        "include_usage chunk). The Server-Timing header says it too.",
    )
    user: str | None = Field(None, description="The end user, for logs.")
    presence_penalty: float | None = Field(
        None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, description="Lower a token's logit once it was generated."
    )
    frequency_penalty: float | None = Field(
        None, ge=-PENALTY_LIMIT, le=PENALTY_LIMIT, description="Lower a token's logit per time it was generated."
    )
    logit_bias: Annotated[
        dict[str, Annotated[float, Field(ge=-LOGIT_BIAS_LIMIT, le=LOGIT_BIAS_LIMIT)]] | None,
        BeforeValidator(_token_id_keys),
    ] = Field(None, description="Token id (as a string) -> bias added to its logit.")
    repetition_penalty: float | None = Field(
        None,
        gt=0,
        le=REPETITION_PENALTY_MAX,
        description="kvmesh extension (transformers' repetition penalty over prompt and output); default: the model's.",
    )
    # kvmesh extensions (also understood by other OpenAI-compatible servers).
    top_k: TopK | None = Field(None, description="kvmesh extension: 0 = off.")
    min_p: float | None = Field(None, ge=0, lt=1, description="kvmesh extension: 0 = off.")
    ignore_eos: bool | None = Field(None, description="kvmesh extension: keep generating past EOS (benchmarks).")
    cache_salt: str | None = Field(
        None,
        description="kvmesh extension: share cached prefixes only with requests of the same salt (within a tenant).",
    )
    # vLLM's extensions, under vLLM's names.
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM extension: also stop after these tokens.")
    min_tokens: MinTokens | None = Field(
        None, description="vLLM extension: no EOS, stop token or stop string ends the output before this many tokens."
    )
    include_stop_str_in_output: bool | None = Field(
        None, description="vLLM extension: keep the stop string that ended the output at its end."
    )
    skip_special_tokens: bool | None = Field(
        None, description="vLLM extension: false shows special tokens in the text. Default: true."
    )
    spaces_between_special_tokens: Annotated[
        bool | None, _refused(lambda v: v is True, "not supported: only true is accepted")
    ] = None
    priority: Annotated[
        int | None, _refused(lambda v: v == 0, "not supported yet: requests are served first come, first served")
    ] = None
    guided_json: dict[str, Any] | bool | None = Field(
        None, description="vLLM extension: the output is JSON that follows this JSON Schema."
    )
    guided_regex: Text | None = Field(None, description="vLLM extension: the output matches this regular expression.")
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = Field(
        None, description="vLLM extension: the output is exactly one of these strings."
    )
    guided_grammar: Text | None = Field(
        None, description="vLLM extension: the output follows this EBNF grammar (GBNF, start rule `root`)."
    )


# -- completions ---------------------------------------------------------------

Prompt = (
    Text
    | Annotated[list[Text], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)

# OpenAI's default for the legacy completions API.
DEFAULT_COMPLETION_MAX_TOKENS = 16


class CompletionRequest(SamplingFields):
    prompt: Prompt = Field(
        description="A string, a list of strings, a list of token ids or a list of those; one choice set per prompt."
    )
    max_tokens: TokenCount | None = DEFAULT_COMPLETION_MAX_TOKENS
    logprobs: TopLogprobs | None = Field(None, description="Return each token's logprob and this many alternatives.")
    echo: Annotated[Literal[False] | None, _refused(lambda v: v is False, "not supported: only false is accepted")] = (
        None
    )
    suffix: Annotated[None, _NOT_YET] = None
    best_of: Choices | None = Field(None, description="Only equal to n (no server-side ranking).")


# -- chat ----------------------------------------------------------------------


def _text_parts_only(value: Any) -> Any:
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind is not None and kind != "text":
                raise PydanticCustomError(
                    "unsupported", "only text content parts are supported, not '{kind}' parts", {"kind": str(kind)}
                )
    return value


class TextPart(Body):
    type: Literal["text"]
    text: str


# Parts are joined with newlines before the chat template sees them.
Content = Annotated[str | list[TextPart], BeforeValidator(_text_parts_only)]


class SystemMessage(Body):
    role: Literal["system"]
    content: Content
    name: str | None = None


class DeveloperMessage(Body):
    role: Literal["developer"]
    content: Content
    name: str | None = None


class UserMessage(Body):
    role: Literal["user"]
    content: Content
    name: str | None = None


class CalledFunction(Body):
    name: str = Field(min_length=1)
    arguments: str = Field(description="The arguments as JSON text (an object).")


class AssistantToolCall(Body):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(Body):
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[AssistantToolCall] | None = Field(
        None, description="The calls this turn made (content may be null)."
    )
    function_call: Annotated[None, _NOT_YET] = None


class ToolMessage(Body):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


ROLES = ("system", "developer", "user", "assistant", "tool")


def _role(value: Any) -> str | None:
    role = value.get("role") if isinstance(value, dict) else getattr(value, "role", None)
    return f"role={role}" if role in ROLES else None


# Tags are "role=<role>" so that error locations can tell them from field names.
Message = Annotated[
    Annotated[SystemMessage, Tag("role=system")]
    | Annotated[DeveloperMessage, Tag("role=developer")]
    | Annotated[UserMessage, Tag("role=user")]
    | Annotated[AssistantMessage, Tag("role=assistant")]
    | Annotated[ToolMessage, Tag("role=tool")],
    Discriminator(
        _role,
        custom_error_type="invalid_role",
        custom_error_message="role must be one of " + ", ".join(ROLES),
    ),
]


class ResponseFormatText(Body):
    type: Literal["text"]


class ResponseFormatJsonObject(Body):
    type: Literal["json_object"] = Field(description="Any JSON object.")


class JsonSchemaFormat(Body):
    name: str = Field(pattern=NAME_PATTERN)
    description: str | None = None
    # "schema" would shadow a BaseModel attribute: the field has another name, the JSON key is "schema".
    json_schema: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON Schema the reply follows. Default: any JSON object."
    )
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormatJsonSchema(Body):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


def _type_tag(value: Any) -> str | None:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"type={kind}" if isinstance(kind, str) else None


# Tags are "type=<type>", like messages' "role=<role>", so that error locations leave them out.
ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("type=text")]
    | Annotated[ResponseFormatJsonObject, Tag("type=json_object")]
    | Annotated[ResponseFormatJsonSchema, Tag("type=json_schema")],
    Discriminator(
        _type_tag,
        custom_error_type="invalid_type",
        custom_error_message="type must be one of text, json_object, json_schema",
    ),
]


class FunctionDefinition(Body):
    name: str = Field(pattern=NAME_PATTERN, description="Unique within the request.")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="JSON Schema of the arguments, an object schema. Default: any object."
    )
    strict: bool | None = Field(None, description="Accepted; calls always follow the schema.")


class ChatTool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(Body):
    name: str = Field(min_length=1)


class NamedToolChoice(Body):
    type: Literal["function"]
    function: ToolChoiceFunction


def _tool_choice_tag(value: Any) -> str | None:
    if isinstance(value, str):
        return "mode="
    return "type=function" if isinstance(value, (dict, NamedToolChoice)) else None


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode=")] | Annotated[NamedToolChoice, Tag("type=function")],
    Discriminator(
        _tool_choice_tag,
        custom_error_type="invalid_tool_choice",
        custom_error_message=(
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
        ),
    ),
]


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: TokenCount | None = Field(
        None, description="Deprecated by OpenAI: max_completion_tokens wins when both are set."
    )
    max_completion_tokens: TokenCount | None = Field(None, description="Default: up to the model's context.")
    logprobs: bool | None = False
    top_logprobs: TopLogprobs | None = Field(None, description="Needs logprobs: true.")
    response_format: ResponseFormat | None = Field(None, description="Not together with tools.")
    tools: list[ChatTool] | None = Field(None, description="Functions the model may call.")
    tool_choice: ToolChoice | None = Field(None, description="Default: auto (none without tools). Needs tools.")
    parallel_tool_calls: bool | None = Field(None, description="Allow several calls in one reply. Default: true.")
    functions: Annotated[None, _NOT_YET] = None
    function_call: Annotated[None, _NOT_YET] = None
    audio: Annotated[None, _NOT_YET] = None
    modalities: list[Literal["text"]] | None = None
    prediction: Annotated[None, _NOT_YET] = None
    web_search_options: Annotated[None, _NOT_YET] = None
    store: Annotated[bool | None, _refused(lambda v: v is False, "not supported: completions are not stored")] = None
    metadata: Annotated[
        dict[str, str] | None, _refused(lambda v: v == {}, "not supported: completions are not stored to tag")
    ] = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description='vLLM extension: extra variables for the chat template, e.g. {"enable_thinking": false}.'
    )


# -- the admin API (vLLM's names for the same calls) ------------------------------


class LoadLoraAdapterRequest(Body):
    lora_name: Text = Field(description="The model id requests will use for it.")
    lora_path: Text = Field(description="The adapter's PEFT folder, as the workers see it.")


class UnloadLoraAdapterRequest(Body):
    lora_name: Text


# -- tokenizing (vLLM's /tokenize and /detokenize) --------------------------------


class TokenizePromptRequest(Body):
    model: str = Field(min_length=1)
    prompt: str = Field(description="Text, tokenized as the completions API tokenizes a text prompt.")
    add_special_tokens: bool | None = Field(
        None, description="Add the tokenizer's special tokens (BOS). Default: true."
    )


class TokenizeChatRequest(Body):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1, description="Rendered by the chat template as a chat request is.")
    add_generation_prompt: Annotated[
        bool | None, _refused(lambda v: v is True, "not supported: the prompt always ends with the generation prompt")
    ] = None
    chat_template_kwargs: dict[str, Any] | None = None


def _shape(value: Any) -> str:
    chat = isinstance(value, TokenizeChatRequest) or (isinstance(value, dict) and "messages" in value)
    return "shape=chat" if chat else "shape=prompt"


class TokenizeRequest(RootModel):
    """A body with ``messages`` is a chat; any other is a prompt (vLLM's two shapes of one route)."""

    root: Annotated[
        Annotated[TokenizeChatRequest, Tag("shape=chat")] | Annotated[TokenizePromptRequest, Tag("shape=prompt")],
        Discriminator(_shape),
    ]


class DetokenizeRequest(Body):
    model: str = Field(min_length=1)
    tokens: list[TokenId] = Field(description="Token ids; their text is returned with special tokens shown.")
