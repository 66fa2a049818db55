"""The request id that follows a request across every hop of the mesh.

It travels as the ``x-request-id`` gRPC metadata entry. The server
interceptor reads it (or makes one) and binds it into structlog's
contextvars for the duration of the call; the client interceptor installed by
``create_channel`` copies the bound id onto every outgoing call made while
handling it, and the trace context (``kvmesh.tracing``) beside it. The
contextvar is the single place the current id lives.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import structlog

from kvmesh.tracing import outgoing_metadata

METADATA_KEY = "x-request-id"


def new_request_id() -> str:
    return uuid.uuid4().hex


def current_request_id() -> str | None:
    """The id bound for the current call or scope, if any."""
    return structlog.contextvars.get_contextvars().get("request_id")


@contextmanager
def request_id_scope(request_id: str | None = None) -> Iterator[str]:
    """Bind ``request_id`` (a new one when None) for logs and outgoing calls in this block.

    For entry points that are not gRPC servers (the gateway's HTTP handlers,
    benchmarks, tests); gRPC servers get this from the interceptor.
    """
    rid = request_id or new_request_id()
    with structlog.contextvars.bound_contextvars(request_id=rid):
        yield rid


def request_id_from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key == METADATA_KEY and isinstance(value, str) and value:
            return value
    return None


Details = grpc.aio.ClientCallDetails
Continuation = Callable[..., Any]


def _with_request_id(details: Details) -> Details:
    rid = current_request_id()
    pairs = list(details.metadata or ())
    added = outgoing_metadata()  # the trace context, when there is one
    if rid is not None and request_id_from_metadata(pairs) is None:
        added.append((METADATA_KEY, rid))
    if not added:
        return details
    return details._replace(metadata=grpc.aio.Metadata(*pairs, *added))


# grpc.aio files a client interceptor under the first RPC kind it implements
# only, so each kind needs its own class.


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Continuation, client_call_details: Details, request: Any
    ) -> Any:
        return await continuation(_with_request_id(client_call_details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Continuation, client_call_details: Details, request: Any
    ) -> Any:
        return await continuation(_with_request_id(client_call_details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Continuation, client_call_details: Details, request_iterator: Any
    ) -> Any:
        return await continuation(_with_request_id(client_call_details), request_iterator)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Continuation, client_call_details: Details, request_iterator: Any
    ) -> Any:
        return await continuation(_with_request_id(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors adding the current request id and trace context to every outgoing call, of every RPC kind."""
    return [_UnaryUnary(), _UnaryStream(), _StreamUnary(), _StreamStream()]
