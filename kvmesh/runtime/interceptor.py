"""The one server interceptor every kvmesh service runs.

For each call to one of the service's own RPCs it:
- takes the request id from ``x-request-id`` metadata (or makes one) and binds
  it, with the method, into structlog's contextvars for the whole call;
- continues the caller's trace (``traceparent`` metadata) with a span for the call
  (``kvmesh.tracing``), whose trace id it binds too and names in the
  initial metadata (``traceresponse``); the mesh's background calls
  (``BACKGROUND_METHODS``) start no trace of their own;
- with mutual TLS, refuses a caller whose certificate's role may not call the method
  (PERMISSION_DENIED, ``kvmesh.runtime.authz``);
- refuses calls with UNAVAILABLE until the service is ready;
- maps exceptions to gRPC status: a ``KvmeshError`` to its code with its
  message, ``NotImplementedError`` to UNIMPLEMENTED, anything else to INTERNAL with a generic message (the traceback is
  logged here, never sent);
- records the RPC metrics.

It wraps the method handler rather than the servicer, so it covers all four
RPC kinds. Servicer methods must be ``async def``, and streaming ones async
generators (``yield`` responses, no ``context.write``), which is how every
kvmesh servicer is written.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from opentelemetry.trace import Span

from kvmesh.errors import InvalidArgument, InvalidField, KvmeshError, Unavailable
from kvmesh.runtime.authz import authorize
from kvmesh.runtime.identity import peer_role
from kvmesh.runtime.metrics import RpcMetrics
from kvmesh.runtime.request_id import new_request_id, request_id_from_metadata
from kvmesh.tracing import TRACERESPONSE, current_traceparent, server_span

log = structlog.get_logger("kvmesh.rpc")

# Calls that keep the mesh running rather than serve a request (membership, KV events, handshakes, stats):
# outside a request's trace they get no span. Each would be a trace of one span, and their steady stream
# would bury the requests' traces (docs/tracing.md).
BACKGROUND_METHODS = frozenset(
    {
        "/kvmesh.api.router.v1.RouterService/RegisterWorker",
        "/kvmesh.api.router.v1.RouterService/Heartbeat",
        "/kvmesh.api.router.v1.RouterService/DeregisterWorker",
        "/kvmesh.api.router.v1.RouterService/PublishKVEvents",
        "/kvmesh.api.router.v1.RouterService/ResyncWorker",
        "/kvmesh.api.router.v1.RouterService/ListWorkers",
        "/kvmesh.api.prefill.v1.PrefillService/NixlHandshake",
        "/kvmesh.api.kvstore.v1.KVStoreService/NixlHandshake",
        "/kvmesh.api.kvstore.v1.KVStoreService/Stats",
        "/kvmesh.api.speculator.v1.SpeculatorService/Stats",
        "/kvmesh.api.adapter.v1.AdapterService/ListAdapters",
    }
)

FIELD_KEY = "kvmesh-field"
REASON_KEY = "kvmesh-reason"


@dataclass(frozen=True)
class _Call:
    service: str
    method: str
    full_method: str
    request_id: str
    metadata: tuple[tuple[str, str | bytes], ...]  # the caller's: its trace context

    @contextmanager
    def scope(self) -> Iterator[Span]:
        """The call's request id and method bound for its logs, and its span (OpenTelemetry's RPC conventions)."""
        attributes = {
            "rpc.system": "grpc",
            "rpc.service": self.service,
            "rpc.method": self.method,
            "kvmesh.request_id": self.request_id,
        }
        with (
            structlog.contextvars.bound_contextvars(request_id=self.request_id, rpc=self.full_method),
            server_span(
                self.full_method.lstrip("/"),
                self.metadata,
                starts_trace=self.full_method not in BACKGROUND_METHODS,
                **attributes,
            ) as span,
        ):
            yield span


def error_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """What a domain error says beside its message, as trailing metadata a client reads back
    (``client_errors.from_rpc_error``): the field it names, its machine-readable reason."""
    pairs = []
    if isinstance(exc, InvalidField):
        pairs.append((FIELD_KEY, exc.field))
    if isinstance(exc, KvmeshError) and exc.reason:
        pairs.append((REASON_KEY, exc.reason))
    return tuple(pairs)


def status_for(exc: Exception, request_id: str) -> tuple[grpc.StatusCode, str]:
    """The status code and wire message for an exception a servicer raised."""
    if isinstance(exc, KvmeshError):
        return grpc.StatusCode[exc.code], exc.message
    if isinstance(exc, NotImplementedError):  # what generated servicer bases raise for a missing method
        return grpc.StatusCode.UNIMPLEMENTED, "method not implemented"
    return grpc.StatusCode.INTERNAL, f"internal error (request_id={request_id})"


@dataclass(frozen=True)
class _Undecodable:
    """A request whose bytes are not the method's message (grpc's own deserializer would answer INTERNAL)."""

    problem: str

    def refuse(self) -> InvalidArgument:
        return InvalidArgument(f"the request is not a valid message of this method: {self.problem}")


def _lenient(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as e:  # DecodeError, and anything a malformed payload makes the parser raise
            return _Undecodable(f"{type(e).__name__}: {e}")

    return parse


def _parsed(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` for a single request, refusing one that did not parse."""

    def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            raise request.refuse()
        return behavior(request, context)

    return call


def _parsed_each(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` for a request stream, refusing the first message that did not parse."""

    async def checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, _Undecodable):
                raise request.refuse()
            yield request

    def call(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        return behavior(checked(requests), context)

    return call


async def _name_the_trace(context: grpc.aio.ServicerContext) -> None:
    """The caller learns which trace its call is in (the initial metadata's ``traceresponse``)."""
    traceparent = current_traceparent()
    if traceparent is not None:
        await context.send_initial_metadata(((TRACERESPONSE, traceparent),))


class ServerInterceptor(grpc.aio.ServerInterceptor):
    def __init__(
        self,
        service_names: Collection[str],
        metrics: RpcMetrics,
        is_ready: Callable[[], bool],
        *,
        authorize: bool = False,
    ) -> None:
        self._services = frozenset(service_names)  # health and reflection pass through untouched
        self._metrics = metrics
        self._is_ready = is_ready
        self._authorize = authorize  # the server is mutual TLS: check each caller's role

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        full_method = handler_call_details.method
        service, _, method = full_method.lstrip("/").rpartition("/")
        if handler is None or service not in self._services:
            return handler
        rid = request_id_from_metadata(handler_call_details.invocation_metadata) or new_request_id()
        call = _Call(service, method, full_method, rid, tuple(handler_call_details.invocation_metadata or ()))
        kw = {
            "request_deserializer": _lenient(handler.request_deserializer),
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(call, _parsed(handler.unary_unary)), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(call, _parsed_each(handler.stream_unary)), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(call, _parsed(handler.unary_stream)), **kw)
        return grpc.stream_stream_rpc_method_handler(self._stream(call, _parsed_each(handler.stream_stream)), **kw)

    def _unary(self, call: _Call, behavior: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            start = self._begin(call)
            code = grpc.StatusCode.OK
            with call.scope() as span:
                try:
                    self._admit(call, context)
                    await _name_the_trace(context)
                    response = await behavior(request, context)
                    code = context.code() or grpc.StatusCode.OK
                    return response
                except BaseException as exc:
                    code, message = self._outcome(call, exc, context)
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    if message is not None:
                        await context.abort(code, message, error_metadata(exc))  # raises AbortError: grpc sends it
                    raise
                finally:
                    self._end(call, code, start)

        return handle

    def _stream(self, call: _Call, behavior: Callable[..., AsyncIterator[Any]]) -> Callable[..., AsyncIterator[Any]]:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            start = self._begin(call)
            code = grpc.StatusCode.OK
            with call.scope() as span:
                try:
                    self._admit(call, context)
                    await _name_the_trace(context)
                    async for response in behavior(request, context):
                        yield response
                    code = context.code() or grpc.StatusCode.OK
                except BaseException as exc:
                    code, message = self._outcome(call, exc, context)
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    if message is not None:
                        await context.abort(code, message, error_metadata(exc))  # raises AbortError: grpc sends it
                    raise
                finally:
                    self._end(call, code, start)

        return handle

    def _admit(self, call: _Call, context: grpc.aio.ServicerContext) -> None:
        # The role first: a caller that may not call the method learns nothing, readiness included.
        if self._authorize:
            authorize(call.service, call.method, peer_role(context.auth_context()))
        if not self._is_ready():
            raise Unavailable(f"{call.service} is not ready")

    def _outcome(
        self, call: _Call, exc: BaseException, context: grpc.aio.ServicerContext
    ) -> tuple[grpc.StatusCode, str | None]:
        """Log ``exc``; return its status code, and the message to abort with unless the call already ended."""
        if isinstance(exc, grpc.aio.AbortError):  # the servicer called context.abort itself
            return context.code() or grpc.StatusCode.UNKNOWN, None
        if not isinstance(exc, Exception):  # CancelledError / GeneratorExit: the client went away
            log.info("rpc cancelled")
            return grpc.StatusCode.CANCELLED, None
        code, message = status_for(exc, call.request_id)
        if code != grpc.StatusCode.INTERNAL:
            log.warning("rpc failed", code=code.name, error=message)
        else:
            log.exception("rpc crashed", code=code.name)
        return code, message

    def _begin(self, call: _Call) -> float:
        self._metrics.in_flight.labels(call.service, call.method).inc()
        return time.perf_counter()

    def _end(self, call: _Call, code: grpc.StatusCode, start: float) -> None:
        elapsed = time.perf_counter() - start
        self._metrics.in_flight.labels(call.service, call.method).dec()
        self._metrics.requests.labels(call.service, call.method, code.name).inc()
        self._metrics.duration.labels(call.service, call.method).observe(elapsed)
        log.debug("rpc done", code=code.name, duration_ms=round(elapsed * 1e3, 3))
