"""From a validated OpenAI request to the gateway core's requests: one per (prompt, choice).

``n`` choices are ``n`` independent requests through the mesh (each routed,
prefilled and decoded on its own); with a ``seed``, choice ``i`` samples with
``seed + i``, so the choices differ yet every one is reproducible. Prompts
come first: the request for prompt ``p``, choice ``i`` is at ``p * n + i``,
which is the choice index OpenAI reports.

``response_format`` becomes ``sampling.structured_output`` (json_object: a JSON
Schema of any object), and so do vLLM's ``guided_*`` fields (one at most, and
not with response_format or tools); tools, tool_choice and the messages' calls
map onto the ChatRequest's fields one to one. Their deeper checks are the core's.
"""

from __future__ import annotations

import json
from typing import Any

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.structured.spec import GrammarSpec
from services.gateway.openai_errors import ParamError
from services.gateway.openai_requests import (
    AssistantMessage,
    ChatCompletionRequest,
    CompletionRequest,
    Content,
    Message,
    ResponseFormat,
    ResponseFormatJsonObject,
    ResponseFormatJsonSchema,
    SamplingFields,
    TokenizeChatRequest,
    TokenizePromptRequest,
    ToolChoice,
    ToolMessage,
)
from services.gateway.tool_calls.request import ANY_OBJECT

_TOOL_CHOICE_MODES = {
    "none": gateway_pb2.TOOL_CHOICE_MODE_NONE,
    "auto": gateway_pb2.TOOL_CHOICE_MODE_AUTO,
    "required": gateway_pb2.TOOL_CHOICE_MODE_REQUIRED,
}

_SEED_SPACE = 2**64  # the mesh's seeds are uint64; OpenAI's may be negative
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32


def sampling(max_tokens: int | None, temperature: float | None, top_p: float | None) -> sampling_pb2.SamplingParams:
    """The sampling settings every OpenAI API has (the Responses API has only these)."""
    params = sampling_pb2.SamplingParams(max_tokens=max_tokens or 0)  # 0: up to the context
    if temperature is not None:
        params.temperature = temperature
    if top_p is not None:
        # The contract's float32 rounds a top_p under ~1e-38 to 0, which workers refuse; the
        # smallest float32 keeps what it means: the most likely token only.
        params.top_p = max(top_p, FLOAT32_TINY)
    return params


def _sampling(
    req: SamplingFields, max_tokens: int | None, logprobs: bool, top_logprobs: int
) -> sampling_pb2.SamplingParams:
    params = sampling(max_tokens, req.temperature, req.top_p)
    params.stop.extend([req.stop] if isinstance(req.stop, str) else list(req.stop or ()))
    params.logprobs = logprobs
    params.top_logprobs = top_logprobs
    params.top_k = req.top_k or 0
    params.min_p = req.min_p or 0.0
    params.ignore_eos = bool(req.ignore_eos)
    params.presence_penalty = req.presence_penalty or 0.0
    params.frequency_penalty = req.frequency_penalty or 0.0
    params.logit_bias.update({int(t): b for t, b in (req.logit_bias or {}).items()})
    params.stop_token_ids.extend(req.stop_token_ids or ())
    params.min_tokens = req.min_tokens or 0
    params.include_stop_str_in_output = bool(req.include_stop_str_in_output)
    if req.skip_special_tokens is not None:
        params.skip_special_tokens = req.skip_special_tokens
    guided = _guided(req)
    if guided is not None:
        params.structured_output.CopyFrom(guided)
    if req.repetition_penalty is not None:
        params.repetition_penalty = req.repetition_penalty
    return params


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _guided(req: SamplingFields) -> sampling_pb2.StructuredOutput | None:
    """vLLM's guided decoding fields as the one constraint they name (None: none is set)."""
    given = [name for name in _GUIDED if getattr(req, name) is not None]
    if len(given) > 1:
        raise ParamError(f"set one of {', '.join(given)}, not several", given[1])
    if req.guided_json is not None:
        return GrammarSpec.json_schema(req.guided_json).to_pb()
    if req.guided_regex is not None:
        return GrammarSpec("regex", req.guided_regex).to_pb()
    if req.guided_choice is not None:
        # An EBNF alternation of string literals (JSON's escapes are GBNF's) needs no regex escaping.
        literals = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in req.guided_choice)
        return GrammarSpec("ebnf", f"root ::= {literals}").to_pb()
    if req.guided_grammar is not None:
        return GrammarSpec("ebnf", req.guided_grammar).to_pb()
    return None


def _choices(req: SamplingFields, prompts: int, limit: int) -> int:
    """``n``, after the checks that span several fields."""
    n = req.n or 1
    if req.stream_options is not None and not req.stream:
        raise ParamError("stream_options is only allowed with stream: true", "stream_options")
    if prompts * n > limit:
        raise ParamError(
            f"this request asks for {prompts * n} generations ({prompts} prompt(s) x n={n}); "
            f"this gateway runs at most {limit} at once",
            "n",
        )
    return n


def _with_seed(params: sampling_pb2.SamplingParams, seed: int | None, choice: int) -> sampling_pb2.SamplingParams:
    if seed is None:
        return params
    seeded = sampling_pb2.SamplingParams()
    seeded.CopyFrom(params)
    seeded.seed = (seed + choice) % _SEED_SPACE
    return seeded


def completion_requests(req: CompletionRequest, limit: int) -> list[gateway_pb2.GenerateRequest]:
    """One request per (prompt, choice); ``limit`` caps their number (the gateway's in-flight limit)."""
    prompts = _prompts(req.prompt)
    n = _choices(req, len(prompts), limit)
    if req.best_of is not None and req.best_of != n:
        raise ParamError(f"best_of must equal n ({n}): kvmesh does not rank extra completions", "best_of")
    logprobs = req.logprobs is not None
    params = _sampling(req, req.max_tokens, logprobs, req.logprobs or 0)
    requests = []
    for prompt in prompts:
        for i in range(n):
            r = gateway_pb2.GenerateRequest(
                model=req.model,
                sampling=_with_seed(params, req.seed, i),
                cache_salt=req.cache_salt or "",
                user=req.user or "",
            )
            if isinstance(prompt, str):
                r.text = prompt
            else:
                r.token_ids.ids.extend(prompt)
            requests.append(r)
    return requests


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One or more prompts (the schema has made sure none is empty)."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def chat_requests(req: ChatCompletionRequest, limit: int) -> list[gateway_pb2.ChatRequest]:
    n = _choices(req, 1, limit)
    if req.top_logprobs and not req.logprobs:
        raise ParamError("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling(req, max_tokens, bool(req.logprobs), req.top_logprobs or 0)
    structured = _structured_output(req.response_format)
    if structured is not None:
        if params.HasField("structured_output"):
            raise ParamError("response_format cannot be combined with guided_* fields", "response_format")
        params.structured_output.CopyFrom(structured)
    template = gateway_pb2.ChatRequest(
        model=req.model,
        messages=[_message(m) for m in req.messages],
        cache_salt=req.cache_salt or "",
        user=req.user or "",
        chat_template_kwargs_json=json.dumps(req.chat_template_kwargs) if req.chat_template_kwargs else "",
    )
    for tool in req.tools or ():
        f = tool.function
        add_function(template, f.name, f.description, f.parameters)
    if req.tool_choice is not None:
        template.tool_choice.CopyFrom(_tool_choice(req.tool_choice))
    if req.parallel_tool_calls is not None:
        template.parallel_tool_calls = req.parallel_tool_calls
    requests = []
    for i in range(n):
        r = gateway_pb2.ChatRequest()
        r.CopyFrom(template)
        r.sampling.CopyFrom(_with_seed(params, req.seed, i))
        requests.append(r)
    return requests


def _message(m: Message) -> gateway_pb2.ChatMessage:
    message = gateway_pb2.ChatMessage(role=m.role, content=_text(m.content), name=getattr(m, "name", None) or "")
    if isinstance(m, AssistantMessage):
        for call in m.tool_calls or ():
            message.tool_calls.add(id=call.id, name=call.function.name, arguments=call.function.arguments)
    if isinstance(m, ToolMessage):
        message.tool_call_id = m.tool_call_id
    return message


def add_function(
    request: gateway_pb2.ChatRequest, name: str, description: str | None, parameters: dict[str, Any] | None
) -> None:
    """Declare a function tool on ``request`` (no parameters: any object)."""
    parameters_json = json.dumps(parameters) if parameters is not None else ""
    request.tools.add(name=name, description=description or "", parameters_json=parameters_json)


def json_output(schema: dict[str, Any] | None) -> sampling_pb2.StructuredOutput:
    """Replies that follow the JSON Schema ``schema`` (None: any JSON object)."""
    return GrammarSpec.json_schema(ANY_OBJECT if schema is None else schema).to_pb()


def _structured_output(response_format: ResponseFormat | None) -> sampling_pb2.StructuredOutput | None:
    if isinstance(response_format, ResponseFormatJsonObject):
        return json_output(None)
    if isinstance(response_format, ResponseFormatJsonSchema):
        return json_output(response_format.json_schema.json_schema)
    return None  # text


def _tool_choice(choice: ToolChoice) -> gateway_pb2.ToolChoice:
    return tool_choice(choice) if isinstance(choice, str) else tool_choice(None, choice.function.name)


def tool_choice(mode: str | None, function: str | None = None) -> gateway_pb2.ToolChoice:
    """A mode ("none", "auto", "required"), or else the one ``function`` the reply must call."""
    if mode is not None:
        return gateway_pb2.ToolChoice(mode=_TOOL_CHOICE_MODES[mode])
    return gateway_pb2.ToolChoice(function_name=function)


def _text(content: Content | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part.text for part in content)


def tokenize_request(req: TokenizeChatRequest | TokenizePromptRequest) -> gateway_pb2.TokenizeRequest:
    """/tokenize's body as the core's request: a chat renders as chat_requests' would."""
    if isinstance(req, TokenizePromptRequest):
        add_special = req.add_special_tokens is None or req.add_special_tokens
        return gateway_pb2.TokenizeRequest(model=req.model, text=req.prompt, add_special_tokens=add_special)
    return gateway_pb2.TokenizeRequest(
        model=req.model,
        chat=gateway_pb2.ChatMessages(messages=[_message(m) for m in req.messages]),
        chat_template_kwargs_json=json.dumps(req.chat_template_kwargs) if req.chat_template_kwargs else "",
    )
