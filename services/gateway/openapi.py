"""The OpenAPI 3.1 document served at GET /openapi.json.

Built from the same pydantic models that validate requests and serialize
responses, and from the statuses the error mapping can produce, so the
document says what the server does. It depends on what is served: the model's
name, vocabulary and context, and the gateway's in-flight limit bound the
request fields (beyond them the server answers 400 or 404), and with API keys
on, the ``/v1`` operations require a bearer token (or Anthropic's ``x-api-key``) and may answer 401.
POST /v1/messages is Anthropic's Messages API: its bodies, events and errors are Anthropic's shapes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.gateway.anthropic_requests import MessagesRequest
from services.gateway.anthropic_responses import (
    AnthropicErrorResponse,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
)
from services.gateway.auth import GUARDED_PATHS
from services.gateway.openai_requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeChatRequest,
    TokenizePromptRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from services.gateway.openai_responses import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    Detokenized,
    ErrorResponse,
    Health,
    Model,
    ModelList,
    Tokenized,
    Unloaded,
)
from services.gateway.responses_objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    DeletedResponse,
    ErrorEvent,
    OutputItemEvent,
    Response,
    ResponseEvent,
    TextDeltaEvent,
    TextDoneEvent,
)
from services.gateway.responses_requests import ResponseRequest

_REQUESTS = (
    CompletionRequest,
    ChatCompletionRequest,
    ResponseRequest,
    MessagesRequest,
    TokenizeRequest,
    DetokenizeRequest,
)
# The bodies that name the model (and token ids): the document allows only what is served.
_BOUNDED = (
    CompletionRequest,
    ChatCompletionRequest,
    ResponseRequest,
    MessagesRequest,
    TokenizePromptRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)
_ADMIN_REQUESTS = (LoadLoraAdapterRequest, UnloadLoraAdapterRequest)
_MESSAGE_EVENTS = (MessageStart, ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta, MessageStop)
_RESPONSE_EVENTS = (
    ResponseEvent,
    OutputItemEvent,
    ContentPartEvent,
    TextDeltaEvent,
    TextDoneEvent,
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ErrorEvent,
)
_RESPONSES = (
    Completion,
    ChatCompletion,
    ChatCompletionChunk,
    Model,
    ModelList,
    Unloaded,
    Health,
    ErrorResponse,
    Tokenized,
    Detokenized,
    Response,
    DeletedResponse,
    *_RESPONSE_EVENTS,
    Message,
    *_MESSAGE_EVENTS,
    AnthropicErrorResponse,
)
# What /tokenize and /detokenize can answer besides 200 (401 is added with auth).
_TOKENIZER_ERRORS = {400: "Invalid request: a parameter, a token id outside the vocabulary.", 404: "Unknown model."}

# What the admin API (LoRA adapters) can answer besides 200 (401 is added with auth).
_ADMIN_ERRORS = {
    400: "A bad adapter (the message names what is wrong), or one that running requests still use.",
    403: "Not an admin tenant's key.",
    404: "No worker has that adapter (unload).",
    409: "Another adapter's files are loaded under that name.",
    503: "No worker, or a worker could not be reached.",
}

# What a generation request can be answered with besides 200 (401 is added with auth):
# bad input, an unknown model, a conflict a worker reported, a body over the size limit,
# admission control, a bug, no worker / a dead one.
_GENERATION_ERRORS = {
    400: "Invalid request: a parameter, the prompt's length, an unsupported feature.",
    404: "Unknown model.",
    409: "A worker aborted the request.",
    413: "Request body too large.",
    429: "Too many requests in flight: retry later.",
    500: "Internal error.",
    503: "No worker available, or the mesh failed the request.",
}


@dataclass(frozen=True)
class Served:
    """What the document's bounds come from."""

    model_name: str
    vocab_size: int
    max_model_len: int
    max_generations: int  # requests in flight at most: n (times the prompts) cannot exceed it


def _integers(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every integer schema within ``schema`` (through anyOf and array items)."""
    if schema.get("type") == "integer":
        yield schema
    for branch in schema.get("anyOf", []):
        yield from _integers(branch)
    if isinstance(schema.get("items"), dict):
        yield from _integers(schema["items"])


def _bound(schemas: dict[str, Any], served: Served) -> None:
    for request in _BOUNDED:
        fields = schemas[request.__name__]["properties"]
        fields["model"]["enum"] = [served.model_name]  # any other name is a 404
        maxima = {
            "max_tokens": served.max_model_len - 1,
            "max_completion_tokens": served.max_model_len - 1,
            "max_output_tokens": served.max_model_len - 1,
            "n": served.max_generations,
            "best_of": served.max_generations,
            "prompt": served.vocab_size - 1,
            "tokens": served.vocab_size - 1,
        }
        for name, maximum in maxima.items():
            for integer in _integers(fields.get(name, {})):
                integer["maximum"] = min(integer.get("maximum", maximum), maximum)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _json(model: type[BaseModel]) -> dict[str, Any]:
    return {"application/json": {"schema": _ref(model)}}


def _errors(statuses: dict[int, str], body: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    return {str(s): {"description": d, "content": _json(body)} for s, d in statuses.items()}


def _generation(
    summary: str, request: type[BaseModel], response: type[BaseModel], chunk: type[BaseModel], errors: dict[int, str]
) -> dict[str, Any]:
    # OpenAPI 3.1 describes each server-sent event; its data is one JSON chunk, an error, or [DONE].
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "description": f"One {chunk.__name__} as JSON, then `[DONE]`; an error after the first chunk "
                "comes as an ErrorResponse and ends the stream (no `[DONE]`).",
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "contentMediaType": "application/json",
                        "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]},
                    },
                ],
            }
        },
    }
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": {
                "200": {
                    "description": "The whole response, or with stream: true a stream of chunks.",
                    "content": {**_json(response), "text/event-stream": {"schema": event}},
                },
                **_errors(errors),
            },
        }
    }


def _responses(errors: dict[int, str]) -> dict[str, Any]:
    # Each server-sent event names its type (the event line) and carries it as JSON.
    event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"type": "string", "description": "The data's type."},
            "data": {
                "type": "string",
                "description": "One event as JSON: response.created first, then response.completed or "
                "response.incomplete last; an error after the first event comes as an error event, the last.",
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [_ref(e) for e in _RESPONSE_EVENTS]},
            },
        },
    }
    return {
        "post": {
            "summary": "Create a response (the OpenAI Responses API, text): continue a stored one with "
            "previous_response_id.",
            "requestBody": {"required": True, "content": _json(ResponseRequest)},
            "responses": {
                "200": {
                    "description": "The whole response, or with stream: true a stream of events.",
                    "content": {**_json(Response), "text/event-stream": {"schema": event}},
                },
                **_errors(errors),
            },
        }
    }


def _messages(errors: dict[int, str]) -> dict[str, Any]:
    """Anthropic's Messages: each server-sent event names its type (``event:``) and carries it as JSON."""
    events = [*_MESSAGE_EVENTS, AnthropicErrorResponse]
    event = {
        "type": "object",
        "required": ["event", "data"],
        "properties": {
            "event": {"enum": [e.model_fields["type"].default for e in events]},
            "data": {
                "type": "string",
                "description": "The event as JSON: message_start, then each content block's start, deltas and "
                "stop, then message_delta and message_stop; an error after the headers comes as an `error` event "
                "and ends the stream.",
                "contentMediaType": "application/json",
                "contentSchema": {"anyOf": [_ref(e) for e in events]},
            },
        },
    }
    return {
        "post": {
            "summary": "Anthropic's Messages API: complete a conversation (the model's chat template is applied).",
            "requestBody": {"required": True, "content": _json(MessagesRequest)},
            "responses": {
                "200": {
                    "description": "The message, or with stream: true a stream of events.",
                    "content": {**_json(Message), "text/event-stream": {"schema": event}},
                },
                **_errors(errors, AnthropicErrorResponse),
            },
        }
    }


def _get(summary: str, responses: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": responses, **extra}}


def _post(summary: str, request: type[BaseModel], responses: dict[str, Any]) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(request)},
            "responses": responses,
        }
    }


def _ok(description: str, content: dict[str, Any]) -> dict[str, Any]:
    return {"200": {"description": description, "content": content}}


def openapi_document(served: Served, auth: bool) -> dict[str, Any]:
    _, top = models_json_schema(
        [(m, "validation") for m in (*_REQUESTS, *_ADMIN_REQUESTS)] + [(m, "serialization") for m in _RESPONSES],
        ref_template="#/components/schemas/{model}",
    )
    schemas = top["$defs"]
    _bound(schemas, served)
    auth_errors = {401: "Missing or invalid API key."} if auth else {}
    generation_errors = dict(sorted((_GENERATION_ERRORS | auth_errors).items()))
    admin_errors = dict(sorted((_ADMIN_ERRORS | auth_errors).items()))
    stored = {404: "No stored response by that id (for this API key).", 503: "The store failed."}
    stored_errors = dict(sorted((stored | auth_errors).items()))
    response_id = [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]
    text = {"text/plain": {"schema": {"type": "string"}}}
    paths: dict[str, Any] = {
        "/v1/completions": _generation(
            "Complete prompts.", CompletionRequest, Completion, Completion, generation_errors
        ),
        "/v1/chat/completions": _generation(
            "Complete a conversation (the model's chat template is applied).",
            ChatCompletionRequest,
            ChatCompletion,
            ChatCompletionChunk,
            generation_errors,
        ),
        "/v1/responses": _responses(
            dict(sorted((generation_errors | {404: "Unknown model, or no stored previous_response_id."}).items()))
        ),
        "/v1/responses/{response_id}": {
            **_get(
                "A stored response.",
                _ok("The response.", _json(Response)) | _errors(stored_errors),
                parameters=response_id,
            ),
            "delete": {
                "summary": "Delete a stored response.",
                "responses": _ok("Deleted.", _json(DeletedResponse)) | _errors(stored_errors),
                "parameters": response_id,
            },
        },
        "/v1/messages": _messages(generation_errors),
        "/v1/models": _get("The models served.", _ok("The models.", _json(ModelList)) | _errors(auth_errors)),
        "/v1/models/{model}": _get(
            "One model.",
            _ok("The model.", _json(Model)) | _errors(dict(sorted(({404: "Unknown model."} | auth_errors).items()))),
            parameters=[{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
        ),
        "/v1/load_lora_adapter": _post(
            "Load a LoRA adapter (a PEFT folder on the workers' disk) on every worker; requests then name it.",
            LoadLoraAdapterRequest,
            _ok("The adapter, as /v1/models lists it.", _json(Model)) | _errors(admin_errors),
        ),
        "/v1/unload_lora_adapter": _post(
            "Unload a LoRA adapter from every worker.",
            UnloadLoraAdapterRequest,
            _ok("Unloaded.", _json(Unloaded)) | _errors(admin_errors),
        ),
        "/tokenize": _post(
            "Tokenize a prompt, or a conversation as a chat request renders it (vLLM's shapes).",
            TokenizeRequest,
            _ok("The token ids.", _json(Tokenized)) | _errors(dict(sorted((_TOKENIZER_ERRORS | auth_errors).items()))),
        ),
        "/detokenize": _post(
            "The text of token ids, special tokens shown (vLLM's shapes).",
            DetokenizeRequest,
            _ok("The text.", _json(Detokenized)) | _errors(dict(sorted((_TOKENIZER_ERRORS | auth_errors).items()))),
        ),
        "/health": _get(
            "Whether the gateway takes requests.",
            _ok("Serving.", _json(Health)) | {"503": {"description": "Shutting down.", "content": _json(Health)}},
        ),
        "/metrics": _get("Prometheus metrics (the same as the metrics port's).", _ok("Prometheus text format.", text)),
        "/openapi.json": _get(
            "This document.", _ok("OpenAPI 3.1.", {"application/json": {"schema": {"type": "object"}}})
        ),
    }
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "kvmesh OpenAI-compatible API",
            "version": version("kvmesh"),
            "description": f"Serves the model {served.model_name!r}.",
        },
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if auth:
        document["components"]["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
        for path, item in paths.items():
            if path.startswith(GUARDED_PATHS):
                for operation in item.values():
                    operation["security"] = [{"bearer": []}, {"apiKey": []}]  # either
    return document
