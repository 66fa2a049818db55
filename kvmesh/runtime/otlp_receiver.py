"""An OTLP/gRPC trace receiver that keeps what it is sent: for the tracing tests and ``bench/tracing.py``.

It speaks the OpenTelemetry Collector's ``TraceService.Export`` (the ``opentelemetry-proto`` definitions),
so services export to it exactly as they would to Jaeger or a collector. Not a backend: spans stay in
memory, flattened to ``ReceivedSpan``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    instance: str  # its service.instance.id
    name: str
    trace_id: str  # hex
    span_id: str
    parent_span_id: str  # "" for a root
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[str, ...] = ()


def _value(v: common_pb2.AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in pairs}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """``with OtlpReceiver() as r:`` serves on ``r.endpoint`` (http://127.0.0.1:<free port>)."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self.exports = 0  # Export calls received
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(None)

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            resource = _attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        ReceivedSpan(
                            service=resource.get("service.name", ""),
                            instance=resource.get("service.instance.id", ""),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes=_attributes(s.attributes),
                            events=tuple(e.name for e in s.events),
                        )
                    )
        with self._lock:
            self._spans.extend(got)
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self._spans if trace_id is None or s.trace_id == trace_id]

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], trace_id: str | None = None, timeout_s: float = 30.0
    ) -> list[ReceivedSpan]:
        """The spans (of ``trace_id``) once ``done`` holds for them; the last seen after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans(trace_id)
            if done(spans) or time.monotonic() > deadline:
                return spans
            time.sleep(0.1)
