"""POST /v1/responses, GET and DELETE /v1/responses/{id}: the Responses API on the gateway core's chat.

A request continues the stored conversation its ``previous_response_id``
names (looked up for the caller's tenant only), runs as one chat request
through ``Gateway.chat`` like a chat completion with one choice, and, unless
``store`` is false, is stored with its output before the client sees the end
of it, so a follow-up sent at once finds it.

Streaming follows chat completions: the headers leave with the first tokens,
so whatever refuses a request still gets its HTTP status; an error after
that is an ``error`` event, the stream's last. Events carry their ``event:``
line as OpenAI sends them.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence

import structlog
from aiohttp import web
from pydantic import TypeAdapter

from kvmesh.errors import InvalidField, KvmeshError
from services.gateway.core import Gateway
from services.gateway.fan_in import FanIn
from services.gateway.http_context import RECEIVED_NS, REQUEST_ID, TENANT
from services.gateway.openai_errors import ParamError
from services.gateway.openai_render import TokenTexts
from services.gateway.openai_serving import SERVER_TIMING, SSE_HEADERS, json_response, parse
from services.gateway.responses_objects import DeletedResponse, Response, StreamEvent
from services.gateway.responses_render import ResponseRenderer
from services.gateway.responses_requests import Item, ResponseRequest
from services.gateway.responses_store import ResponseStore, StoredResponse
from services.gateway.responses_translate import chat_request, responses_param
from services.gateway.timing import server_timing

log = structlog.get_logger("kvmesh.gateway.http")

_ITEMS = TypeAdapter(list[Item])


def _sse(event: StreamEvent) -> bytes:
    return b"event: " + event.type.encode() + b"\ndata: " + event.model_dump_json().encode() + b"\n\n"


@contextlib.contextmanager
def _responses_params() -> Iterator[None]:
    """The core names a bad field of its ChatRequest; the client gets it as its own request spells it."""
    try:
        yield
    except InvalidField as e:
        raise ParamError(e.message, responses_param(e.field)) from None


class ResponsesServing:
    def __init__(self, gateway: Gateway, store: ResponseStore, lenient_fields: bool = False) -> None:
        """``lenient_fields``: unknown request fields are dropped instead of refused (``openai_serving.parse``)."""
        self._gateway = gateway
        self._store = store
        self._lenient = lenient_fields
        self._texts = TokenTexts(gateway.model.tokenizer)

    async def create(self, request: web.Request) -> web.StreamResponse:
        req = await parse(request, ResponseRequest, self._lenient)
        rid, tenant = request[REQUEST_ID], request[TENANT]
        history: list[Item] = []
        if req.previous_response_id is not None:
            previous = await self._store.get(tenant, req.previous_response_id, "previous_response_id")
            history = previous.conversation
        conversation = [*history, *req.input]
        core_request = chat_request(req, conversation)
        renderer = ResponseRenderer(
            f"resp_{uuid.uuid4().hex}", int(time.time()), self._gateway.model.name, req, self._texts
        )
        keep = functools.partial(self._keep, tenant, req, conversation)
        with _responses_params():
            async with FanIn([(rid, self._gateway.chat(core_request, rid, tenant))]) as fan:
                if req.stream:
                    return await self._stream(request, fan, renderer, keep)
                while (event := await fan.next()) is not None:
                    renderer.add(event[1])
                response = renderer.response()
                await keep(response)
                answer = json_response(response)
                answer.headers[SERVER_TIMING] = server_timing(renderer.phases())
                return answer

    async def _stream(
        self,
        request: web.Request,
        fan: FanIn,
        renderer: ResponseRenderer,
        keep: Callable[[Response], Awaitable[None]],
    ) -> web.StreamResponse:
        first = await fan.first_of_each()
        waited = {"first_token": time.perf_counter_ns() - request[RECEIVED_NS]}
        answer = web.StreamResponse(headers={**SSE_HEADERS, SERVER_TIMING: server_timing(waited)})
        await answer.prepare(request)
        try:
            events = renderer.start()
            for _, chunk in first:
                events += renderer.add(chunk)
            await answer.write(b"".join(_sse(e) for e in events))
            while (event := await fan.next()) is not None:
                events = renderer.add(event[1])
                if events:
                    await answer.write(b"".join(_sse(e) for e in events))
            await keep(renderer.response())
            await answer.write(_sse(renderer.end()))
        except ConnectionError:
            raise  # the client is gone: nobody to tell (leaving the fan-in cancels the request)
        except Exception as e:  # noqa: BLE001 - the headers are out: report it in the stream
            failure = renderer.error(e, request[REQUEST_ID])
            if isinstance(e, KvmeshError):
                log.warning("stream ended with an error", error=failure.message)
            else:
                log.error("stream crashed", exc_info=e)
            await answer.write(_sse(failure))
        await answer.write_eof()
        return answer

    async def get(self, request: web.Request) -> web.Response:
        stored = await self._store.get(request[TENANT], request.match_info["response_id"])
        return json_response(stored.response)

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["response_id"]
        await self._store.delete(request[TENANT], response_id)
        return json_response(DeletedResponse(id=response_id))

    async def _keep(self, tenant: str, req: ResponseRequest, conversation: Sequence[Item], response: Response) -> None:
        """Store the response with the conversation it ends (unless the request said store: false)."""
        if req.store is False:
            return
        output = _ITEMS.validate_python([item.model_dump() for item in response.output])
        await self._store.put(tenant, StoredResponse(response=response, conversation=[*conversation, *output]))
