"""W3C trace context through every hop, and OpenTelemetry spans exported over OTLP when asked for.

A request's trace context travels as ``traceparent`` (and ``tracestate``): an HTTP header at the gateway,
gRPC metadata between services. ``server_span`` continues the caller's context for one call (the server
interceptor and the gateway's HTTP middleware use it) and binds its trace id into structlog's contextvars,
so every log line of the request carries it; ``outgoing_metadata`` is what the client interceptor adds to
every call made while handling it.

Export is off unless an OTLP endpoint is set (``--otlp-endpoint``, or the standard
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_ENDPOINT``; ``OTEL_SDK_DISABLED=true`` or
``OTEL_TRACES_EXPORTER=none`` turn it off again). Off, the SDK is never imported, no span is made, and an
incoming ``traceparent`` is passed on unchanged (a trace that crosses an untraced service stays whole).
On, new traces are sampled at ``--trace-sample-ratio`` (``OTEL_TRACES_SAMPLER_ARG``) and a continued one
follows its caller's decision; spans leave in batches on a background thread.
"""

from __future__ import annotations

import contextvars
import os
import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = structlog.get_logger("kvmesh.tracing")

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# The gateway's answer names the trace it made (W3C Trace Context level 2's response header).
TRACERESPONSE = "traceresponse"

# A collector that is down holds up a stopping process this long at most (the spans are then lost).
EXPORT_TIMEOUT_S = 5

_PROPAGATOR = TraceContextTextMapPropagator()
# Off: the caller's (traceparent, tracestate), passed on as they came.
_passthrough: contextvars.ContextVar[tuple[tuple[str, str], ...]] = contextvars.ContextVar(
    "kvmesh_trace_passthrough", default=()
)
_tracer: trace.Tracer | None = None
_provider: Any = None  # the SDK's TracerProvider, once started


@dataclass(frozen=True)
class TraceSettings:
    """Where spans go (None: nowhere, tracing off) and the share of new traces sampled."""

    endpoint: str | None
    sample_ratio: float

    @classmethod
    def from_env(cls, endpoint: str | None, sample_ratio: float | None, environ: Mapping[str, str]) -> TraceSettings:
        """The flags (``--otlp-endpoint``, ``--trace-sample-ratio``) first, then the standard ``OTEL_*``."""
        disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
        disabled = disabled or environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none"
        endpoint = (
            endpoint or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        )
        if sample_ratio is None:
            sample_ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG") or 1.0)
        if not 0.0 <= sample_ratio <= 1.0:
            raise ValueError(f"the trace sample ratio must be within [0, 1], got {sample_ratio}")
        return cls(None if disabled else endpoint or None, sample_ratio)


def start_tracing(service: str, settings: TraceSettings, instance: str | None = None) -> bool:
    """Export this process's spans as ``kvmesh-<service>`` when ``settings`` name an endpoint; whether it does."""
    global _tracer, _provider
    if settings.endpoint is None:
        return False
    # Imported here: a process that does not trace never loads the SDK or the exporter.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    resource = Resource.create(
        {
            "service.name": os.environ.get("OTEL_SERVICE_NAME") or f"kvmesh-{service}",
            "service.instance.id": instance or f"{socket.gethostname()}:{os.getpid()}",
        }
    )
    provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)))
    insecure = settings.endpoint.startswith("http://")
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.endpoint, insecure=insecure, timeout=EXPORT_TIMEOUT_S))
    )
    _provider = provider
    _tracer = provider.get_tracer("kvmesh")
    log.info("tracing on", endpoint=settings.endpoint, sample_ratio=settings.sample_ratio)
    return True


def stop_tracing() -> None:
    """Send the spans still queued and stop exporting (blocking: call it off the event loop)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


def enabled() -> bool:
    return _tracer is not None


def _carrier(pairs: Iterable[tuple[str, str | bytes]]) -> dict[str, str]:
    return {k: v for k, v in pairs if k in (TRACEPARENT, TRACESTATE) and isinstance(v, str)}


@contextmanager
def server_span(
    name: str, incoming: Iterable[tuple[str, str | bytes]], starts_trace: bool = True, **attributes: Any
) -> Iterator[Span]:
    """One call handled here, continuing the caller's trace context (``incoming``: its metadata or headers).

    ``starts_trace`` False: a call that arrives outside any trace gets no span (the mesh's own background
    calls: they would each be a trace of one span, crowding out the requests' traces).
    """
    carrier = _carrier(incoming)
    if _tracer is None or not (starts_trace or TRACEPARENT in carrier):
        token = _passthrough.set(tuple(carrier.items()))
        trace_id = _trace_id_of(carrier.get(TRACEPARENT, ""))
        try:
            with structlog.contextvars.bound_contextvars(**({"trace_id": trace_id} if trace_id else {})):
                yield trace.INVALID_SPAN
        finally:
            _passthrough.reset(token)
        return
    parent = _PROPAGATOR.extract(carrier)
    span = _tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    ctx = span.get_span_context()
    bound = {"trace_id": format(ctx.trace_id, "032x")} if ctx.is_valid else {}
    try:
        with structlog.contextvars.bound_contextvars(**bound):
            yield span
    except BaseException as exc:
        if isinstance(exc, Exception):
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        otel_context.detach(token)
        span.end()


def continued_span(name: str, traceparent: str, **attributes: Any) -> Span:
    """A span continuing ``traceparent`` that outlives any one call (the caller ends it): work on a request
    that arrives on a stream shared by many requests (the speculator's). A no-op span when tracing is off."""
    if _tracer is None or not traceparent:
        return trace.INVALID_SPAN
    parent = _PROPAGATOR.extract({TRACEPARENT: traceparent})
    return _tracer.start_span(name, context=parent, attributes=attributes)


@contextmanager
def span(name: str, **attributes: Any) -> Iterator[Span]:
    """A span for a phase of the current call (a no-op span when tracing is off)."""
    if _tracer is None:
        yield trace.INVALID_SPAN
        return
    with _tracer.start_as_current_span(name, attributes=attributes) as s:
        yield s


def record_span(name: str, start_ns: int, end_ns: int, **attributes: Any) -> None:
    """A finished phase of the current call, from its ``time.time_ns()`` bounds (measured elsewhere, e.g. on
    the engine's thread)."""
    if _tracer is None or end_ns < start_ns:
        return
    _tracer.start_span(name, start_time=start_ns, attributes=attributes).end(end_time=end_ns)


def set_attributes(**attributes: Any) -> None:
    """Attributes of the current span (none when tracing is off or nothing samples this trace)."""
    if _tracer is not None:
        trace.get_current_span().set_attributes({k: v for k, v in attributes.items() if v is not None})


def add_event(name: str, **attributes: Any) -> None:
    """A moment in the current span (the first token, a preemption)."""
    if _tracer is not None:
        trace.get_current_span().add_event(name, attributes=attributes)


def wall_ns(perf_ns: int) -> int:
    """A ``time.perf_counter_ns()`` instant as ``time.time_ns()`` (span times are wall-clock)."""
    return time.time_ns() - (time.perf_counter_ns() - perf_ns)


def outgoing_metadata() -> list[tuple[str, str]]:
    """The trace context for a call made now: the current span's, or what the caller passed in."""
    if _tracer is None:
        return list(_passthrough.get())
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return list(carrier.items())


def current_traceparent() -> str | None:
    """The ``traceparent`` of the current span (or the one passed through), for a response header."""
    for key, value in outgoing_metadata():
        if key == TRACEPARENT:
            return value
    return None


def _trace_id_of(traceparent: str) -> str | None:
    # version-traceid-parentid-flags: 2-32-16-2 hex digits
    parts = traceparent.split("-")
    return parts[1] if len(parts) == 4 and len(parts[1]) == 32 else None
