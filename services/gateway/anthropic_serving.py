"""POST /v1/messages: parse, run through the gateway core's chat, answer as one message or as SSE events.

It runs the way ``openai_serving`` runs a chat completion of one choice: the
same core call under the request's id and tenant, and for a streamed answer
the headers go out only with the first chunk, so whatever refuses a request
(validation, an unknown model, admission control, no worker) still gets its
HTTP status, in Anthropic's error shape (the HTTP app's error middleware). An
error after that is an ``error`` event that ends the stream.
"""

from __future__ import annotations

import time

import structlog
from aiohttp import web

from kvmesh.errors import KvmeshError
from services.gateway.anthropic_errors import anthropic_error_body
from services.gateway.anthropic_render import MessageRenderer
from services.gateway.anthropic_requests import MessagesRequest
from services.gateway.anthropic_responses import AnthropicErrorResponse, StreamEvent
from services.gateway.anthropic_translate import chat_request
from services.gateway.core import Gateway
from services.gateway.fan_in import FanIn
from services.gateway.http_context import RECEIVED_NS, REQUEST_ID, TENANT
from services.gateway.openai_serving import SERVER_TIMING, SSE_HEADERS, json_response, parse
from services.gateway.timing import server_timing

log = structlog.get_logger("kvmesh.gateway.http")


def _sse(event: StreamEvent | AnthropicErrorResponse) -> bytes:
    return b"event: " + event.type.encode() + b"\ndata: " + event.model_dump_json().encode() + b"\n\n"


async def _write(response: web.StreamResponse, events: list[StreamEvent]) -> None:
    if events:
        await response.write(b"".join(_sse(e) for e in events))


class AnthropicServing:
    def __init__(self, gateway: Gateway, lenient_fields: bool = False) -> None:
        """``lenient_fields``: unknown request fields are dropped instead of refused (``openai_serving.parse``)."""
        self._gateway = gateway
        self._lenient = lenient_fields

    def _decode(self, token_ids: list[int]) -> str:
        return self._gateway.model.tokenizer.decode(token_ids, skip_special_tokens=True)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, MessagesRequest, self._lenient)
        core_request = chat_request(req)
        rid, tenant = request[REQUEST_ID], request[TENANT]
        renderer = MessageRenderer(f"msg_{rid}", self._gateway.model.name, req.stop_sequences or (), self._decode)
        async with FanIn([(rid, self._gateway.chat(core_request, rid, tenant))]) as fan:
            if not req.stream:
                while (event := await fan.next()) is not None:
                    renderer.add(event[1])
                response = json_response(renderer.message())
                response.headers[SERVER_TIMING] = server_timing(renderer.phases())
                return response

            first = await fan.first_of_each()
            waited = {"first_token": time.perf_counter_ns() - request[RECEIVED_NS]}
            response = web.StreamResponse(headers={**SSE_HEADERS, SERVER_TIMING: server_timing(waited)})
            await response.prepare(request)
            try:
                await response.write(_sse(renderer.start()))
                for _, chunk in first:
                    await _write(response, renderer.add(chunk))
                while (event := await fan.next()) is not None:
                    await _write(response, renderer.add(event[1]))
                await _write(response, renderer.finish())
            except ConnectionError:
                raise  # the client is gone: nobody to tell (leaving the fan-in cancels the request)
            except Exception as e:  # noqa: BLE001 - the headers are out: report it in the stream
                await self._stream_error(response, e, rid)
                return response
            await response.write_eof()
            return response

    async def _stream_error(self, response: web.StreamResponse, error: Exception, request_id: str) -> None:
        status, body = anthropic_error_body(error, request_id)
        if isinstance(error, KvmeshError):
            log.warning("stream ended with an error", status=status, error=body.error.message)
        else:
            log.error("stream crashed", exc_info=error)
        await response.write(_sse(body))
        await response.write_eof()
