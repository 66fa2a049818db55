"""POST /v1/completions and /v1/chat/completions: parse, run through the gateway core, answer whole or as SSE.

A streamed answer sends its headers only once every choice has its first
chunk: whatever can refuse a request (validation, an unknown model, admission
control, no worker) has spoken by then, so those still get their proper HTTP
status instead of a 200 with an error inside. An error after that travels in
the stream as an ``{"error": ...}`` event (what OpenAI's clients raise on),
and the stream ends without ``[DONE]``.

The client hanging up cancels the handler's task (the server runs with
handler cancellation), which closes the fan-in, which cancels every request
in the mesh.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import structlog
from aiohttp import web
from pydantic import BaseModel, ValidationError

from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import KvmeshError
from services.gateway.core import Gateway
from services.gateway.fan_in import FanIn, Stream
from services.gateway.http_context import RECEIVED_NS, REQUEST_ID, TENANT
from services.gateway.openai_errors import EXTRA_FIELD, ParamError, error_body
from services.gateway.openai_render import ChatRenderer, CompletionRenderer, TokenTexts
from services.gateway.openai_requests import ChatCompletionRequest, CompletionRequest
from services.gateway.openai_translate import chat_requests, completion_requests
from services.gateway.timing import server_timing

log = structlog.get_logger("kvmesh.gateway.http")

Body = TypeVar("Body", bound=BaseModel)
Renderer = CompletionRenderer | ChatRenderer

# X-Accel-Buffering: a proxy in front (nginx) must pass each event on as it comes.
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
SERVER_TIMING = "Server-Timing"


async def parse(request: web.Request, model: type[Body], lenient: bool = False) -> Body:
    """The request body as ``model``; any problem is a 400 naming the field.

    ``lenient``: fields the body does not define are dropped (and logged) instead of refused.
    """
    raw = await request.read()
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        unknown = [p["loc"] for p in e.errors(include_url=False) if p["type"] == EXTRA_FIELD]
        if not (lenient and unknown):
            raise ParamError.from_validation(e) from None
    body = json.loads(raw)
    for loc in unknown:
        *path, name = loc
        _at(body, path).pop(name, None)
    log.info("unknown request fields ignored", fields=[".".join(map(str, loc)) for loc in unknown])
    try:
        return model.model_validate_json(json.dumps(body))
    except ValidationError as e:
        raise ParamError.from_validation(e) from None


def _at(body: Any, path: list[int | str]) -> Any:
    """The value at a validation error's location, skipping the labels pydantic adds (union members, tags)."""
    for part in path:
        if isinstance(part, int) or part in body:
            body = body[part]
    return body


def json_response(body: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=body.model_dump_json(), status=status, content_type="application/json")


def _sse(body: BaseModel) -> bytes:
    return b"data: " + body.model_dump_json().encode() + b"\n\n"


class OpenAIServing:
    def __init__(self, gateway: Gateway, lenient_fields: bool = False) -> None:
        self._gateway = gateway
        self._lenient = lenient_fields
        self._texts = TokenTexts(gateway.model.tokenizer)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, CompletionRequest, self._lenient)
        core_requests = completion_requests(req, self._gateway.max_inflight)
        renderer = self._renderer(
            CompletionRenderer, "cmpl", request, req, core_requests, logprobs=req.logprobs is not None
        )
        return await self._answer(request, req, renderer, core_requests, self._gateway.generate)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, ChatCompletionRequest, self._lenient)
        core_requests = chat_requests(req, self._gateway.max_inflight)
        renderer = self._renderer(ChatRenderer, "chatcmpl", request, req, core_requests, logprobs=bool(req.logprobs))
        return await self._answer(request, req, renderer, core_requests, self._gateway.chat)

    def _renderer(
        self,
        cls: type[Renderer],
        prefix: str,
        request: web.Request,
        request_body: CompletionRequest | ChatCompletionRequest,
        core_requests: Sequence[object],
        logprobs: bool,
    ) -> Renderer:
        return cls(
            f"{prefix}-{request[REQUEST_ID]}",
            int(time.time()),
            self._gateway.model.name,
            choices=len(core_requests),
            per_prompt=request_body.n or 1,
            texts=self._texts,
            logprobs=logprobs,
            timings=bool(request_body.return_timings),
        )

    async def _answer(
        self,
        request: web.Request,
        req: CompletionRequest | ChatCompletionRequest,
        renderer: Renderer,
        core_requests: Sequence[gateway_pb2.GenerateRequest | gateway_pb2.ChatRequest],
        call: Callable[..., Stream],
    ) -> web.StreamResponse:
        rid, tenant = request[REQUEST_ID], request[TENANT]
        ids = [rid] if len(core_requests) == 1 else [f"{rid}-{i}" for i in range(len(core_requests))]
        async with FanIn([(sub, call(r, sub, tenant)) for sub, r in zip(ids, core_requests)]) as fan:
            if not req.stream:
                while (event := await fan.next()) is not None:
                    renderer.add(*event)
                response = json_response(renderer.response())
                response.headers[SERVER_TIMING] = server_timing(renderer.phases())
                return response

            first = await fan.first_of_each()
            # The headers leave with the first tokens: only their wait is known yet (the rest: return_timings).
            waited = {"first_token": time.perf_counter_ns() - request[RECEIVED_NS]}
            response = web.StreamResponse(headers={**SSE_HEADERS, SERVER_TIMING: server_timing(waited)})
            await response.prepare(request)
            try:
                for event in first:
                    await response.write(_sse(renderer.add(*event)))
                while (event := await fan.next()) is not None:
                    await response.write(_sse(renderer.add(*event)))
            except ConnectionError:
                raise  # the client is gone: nobody to tell (leaving the fan-in cancels the rest)
            except Exception as e:  # noqa: BLE001 - the headers are out: report it in the stream
                await self._stream_error(response, e, rid)
                return response
            if req.stream_options is not None and req.stream_options.include_usage:
                await response.write(_sse(renderer.usage_chunk()))
            await response.write(_DONE)
            await response.write_eof()
            return response

    async def _stream_error(self, response: web.StreamResponse, error: Exception, request_id: str) -> None:
        status, body = error_body(error, request_id)
        if isinstance(error, KvmeshError):
            log.warning("stream ended with an error", status=status, error=body.error.message)
        else:
            log.error("stream crashed", exc_info=error)
        await response.write(_sse(body))
        await response.write_eof()
