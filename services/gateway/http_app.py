"""The OpenAI-compatible HTTP API, and Anthropic's Messages, as an aiohttp application on the gateway core.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses,
GET and DELETE /v1/responses/{response_id}, POST /v1/messages (Anthropic's), GET /v1/models(/{model}),
POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin), POST /tokenize and /detokenize
(vLLM's), GET /health, GET /metrics, GET /openapi.json.

Middlewares, outermost first:
- observe: binds the request id (``x-request-id`` header, or a new one) for
  logs and every call into the mesh, returns it as a header, continues the
  caller's trace (``traceparent``) on the ``/v1`` routes and names it in the
  ``traceresponse`` header, records the HTTP metrics and logs one line per request;
- errors: turns every exception into OpenAI's error body (``openai_errors``), or on
  /v1/messages Anthropic's (``anthropic_errors``);
- auth: the ``/v1`` routes and the tokenizer's need a valid API key when keys are configured
  (``Authorization: Bearer``, or Anthropic's ``x-api-key``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvmesh import tracing
from kvmesh.api.gateway.v1 import gateway_pb2
from kvmesh.errors import KvmeshError, Unavailable
from kvmesh.runtime import METADATA_KEY, new_request_id, request_id_scope
from services.gateway.anthropic_errors import anthropic_error_body
from services.gateway.anthropic_serving import AnthropicServing
from services.gateway.auth import GUARDED_PATHS, ApiKeys, http_authorization
from services.gateway.core import Gateway
from services.gateway.http_context import RECEIVED_NS, REQUEST_ID, TENANT, TRACEPARENT
from services.gateway.metrics import HttpMetrics
from services.gateway.openai_errors import error_body
from services.gateway.openai_requests import (
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from services.gateway.openai_responses import Detokenized, Health, Model, ModelList, Tokenized, Unloaded
from services.gateway.openai_serving import OpenAIServing, json_response, parse
from services.gateway.openai_translate import tokenize_request
from services.gateway.openapi import Served, openapi_document
from services.gateway.responses_serving import ResponsesServing
from services.gateway.responses_store import LocalResponseStore, ResponseStore

log = structlog.get_logger("kvmesh.gateway.http")

# Prompts of 100k+ tokens sent as token ids are several MiB of JSON.
MAX_BODY_BYTES = 64 << 20

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Anthropic's Messages API: its errors are in Anthropic's shape.
MESSAGES_PATH = "/v1/messages"


class HttpApi:
    def __init__(
        self,
        gateway: Gateway,
        keys: ApiKeys,
        registry: CollectorRegistry,
        metrics: HttpMetrics,
        responses_store: ResponseStore | None = None,
        lenient_fields: bool = False,
    ) -> None:
        """``responses_store``: where POST /v1/responses keeps responses (default: in this process);
        ``lenient_fields``: unknown request fields are ignored instead of refused (``openai_serving.parse``)."""
        self._gateway = gateway
        self._keys = keys
        self._registry = registry
        self._metrics = metrics
        self._lenient = lenient_fields
        self._serving = OpenAIServing(gateway, lenient_fields)
        self._anthropic = AnthropicServing(gateway, lenient_fields)
        self._responses = ResponsesServing(gateway, responses_store or LocalResponseStore(), lenient_fields)
        served = Served(gateway.model.name, gateway.model.vocab_size, gateway.model.max_model_len, gateway.max_inflight)
        self._openapi = openapi_document(served, keys.enabled)
        self.draining = False  # set when shutdown begins: /health says so, new generations are refused

        app = web.Application(middlewares=[self._observe, self._errors, self._auth], client_max_size=MAX_BODY_BYTES)
        app.on_response_prepare.append(_add_request_id)
        app.router.add_post("/v1/completions", self._generation(self._serving.completions))
        app.router.add_post("/v1/chat/completions", self._generation(self._serving.chat))
        app.router.add_post(MESSAGES_PATH, self._generation(self._anthropic.messages))
        app.router.add_post("/v1/responses", self._generation(self._responses.create))
        app.router.add_get("/v1/responses/{response_id}", self._responses.get)
        app.router.add_delete("/v1/responses/{response_id}", self._responses.delete)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/load_lora_adapter", self._load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self._unload_lora_adapter)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._prometheus)
        app.router.add_get("/openapi.json", self._openapi_json)
        self.app = app

    # -- middlewares -----------------------------------------------------------

    @web.middleware
    async def _observe(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        rid = request.headers.get(METADATA_KEY) or new_request_id()
        request[REQUEST_ID] = rid
        request[RECEIVED_NS] = time.perf_counter_ns()
        start = time.perf_counter()
        status = "cancelled"  # unless a response comes back: the client hung up
        traced = (
            tracing.server_span(f"{request.method} {route}", request.headers.items(), **_http_attributes(request))
            if request.path.startswith("/v1/")  # not health checks and scrapes
            else nullcontext()
        )
        with request_id_scope(rid), traced as span:
            request[TRACEPARENT] = tracing.current_traceparent()
            try:
                response = await handler(request)
                status = str(response.status)
                return response
            finally:
                if span is not None and status != "cancelled":
                    span.set_attribute("http.response.status_code", int(status))
                elapsed = time.perf_counter() - start
                self._metrics.requests.labels(route, status).inc()
                self._metrics.duration.labels(route).observe(elapsed)
                # Successes at debug, like the RPC interceptor's: health checks and scrapes are frequent.
                level = log.info if status == "cancelled" or int(status) >= 400 else log.debug
                level(
                    "http request",
                    method=request.method,
                    path=request.path,
                    status=status,
                    duration_ms=round(elapsed * 1e3, 3),
                )

    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception as e:  # noqa: BLE001 - this is where every error becomes an error body
            shape = anthropic_error_body if request.path == MESSAGES_PATH else error_body
            status, body = shape(e, request[REQUEST_ID])
            if status >= 500 and not isinstance(e, KvmeshError):
                log.error("http request crashed", exc_info=e)
            elif status >= 500:
                log.warning("http request failed", status=status, error=body.error.message)
            response = json_response(body, status)
            if isinstance(e, web.HTTPMethodNotAllowed):
                response.headers["Allow"] = e.headers["Allow"]
            return response

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith(GUARDED_PATHS):
            request[TENANT] = self._keys.tenant(http_authorization(request.headers))
        return await handler(request)

    # -- routes ----------------------------------------------------------------

    def _generation(self, handler: Handler) -> Handler:
        async def generate(request: web.Request) -> web.StreamResponse:
            if self.draining:
                raise Unavailable("the gateway is shutting down; retry on another replica")
            return await handler(request)

        return generate

    async def _models(self, request: web.Request) -> web.Response:
        return json_response(ModelList(data=[_model(info) for info in await self._gateway.list_models()]))

    async def _model(self, request: web.Request) -> web.Response:
        name = await self._gateway.adapters.resolve(request.match_info["model"]) or self._gateway.model.name
        (info,) = [info for info in await self._gateway.list_models() if info.id == name]
        return json_response(_model(info))

    async def _load_lora_adapter(self, request: web.Request) -> web.Response:
        self._keys.admin(http_authorization(request.headers))
        req = await parse(request, LoadLoraAdapterRequest)
        loaded = await self._gateway.load_adapter(req.lora_name, req.lora_path)
        return json_response(_model(loaded.model))

    async def _unload_lora_adapter(self, request: web.Request) -> web.Response:
        self._keys.admin(http_authorization(request.headers))
        req = await parse(request, UnloadLoraAdapterRequest)
        await self._gateway.unload_adapter(req.lora_name)
        return json_response(Unloaded(id=req.lora_name))

    async def _tokenize(self, request: web.Request) -> web.Response:
        req = (await parse(request, TokenizeRequest, self._lenient)).root
        ids = await self._gateway.tokenize(tokenize_request(req))
        return json_response(Tokenized(count=len(ids), max_model_len=self._gateway.model.max_model_len, tokens=ids))

    async def _detokenize(self, request: web.Request) -> web.Response:
        req = await parse(request, DetokenizeRequest, self._lenient)
        text = await self._gateway.detokenize(gateway_pb2.DetokenizeRequest(model=req.model, token_ids=req.tokens))
        return json_response(Detokenized(prompt=text))

    async def _health(self, request: web.Request) -> web.Response:
        if self.draining:
            return json_response(Health(status="draining"), 503)
        return json_response(Health(status="ok"))

    async def _prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _openapi_json(self, request: web.Request) -> web.Response:
        return web.json_response(self._openapi)


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID in request:
        response.headers[METADATA_KEY] = request[REQUEST_ID]
    if request.get(TRACEPARENT) is not None:
        response.headers[tracing.TRACERESPONSE] = request[TRACEPARENT]


def _model(info: gateway_pb2.ModelInfo) -> Model:
    return Model(
        id=info.id,
        created=info.created,
        owned_by=info.owned_by,
        max_model_len=info.max_model_len,
        parent=info.parent or None,
    )


def _http_attributes(request: web.Request) -> dict[str, str]:
    return {"http.request.method": request.method, "url.path": request.path, "kvmesh.request_id": request[REQUEST_ID]}
