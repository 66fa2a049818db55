"""Trace context through a real service process: continued, exported over OTLP when on, passed through when off."""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest

from kvmesh import tracing
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.runtime.otlp_receiver import OtlpReceiver
from kvmesh.tracing import TraceSettings
from tests.runtime.demo_process import log_until, spawn_demo

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN}-01"


async def _call_demo(env: dict[str, str]) -> tuple[list[dict], int]:
    """Start the demo service, call it once with TRACEPARENT, stop it; its log lines of the call, its exit code."""
    proc = await spawn_demo(
        "--log-level", "debug", env={**os.environ, "KVMESH_GREETING": "hi", "OTEL_BSP_SCHEDULE_DELAY": "100", **env}
    )
    try:
        assert proc.stderr is not None
        serving = (await log_until(proc.stderr, "serving"))[-1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{serving['port']}") as channel:
            stub = kvstore_pb2_grpc.KVStoreServiceStub(channel)
            call = stub.Stats(kvstore_pb2.StatsRequest(), metadata=(("traceparent", TRACEPARENT),))
            await call
            # The answer names the trace the call is in.
            assert dict(await call.initial_metadata())["traceresponse"].split("-")[1] == TRACE_ID
        lines = await log_until(proc.stderr, "rpc done")
        proc.send_signal(signal.SIGTERM)
        await log_until(proc.stderr, "stopped")
        return lines, await asyncio.wait_for(proc.wait(), timeout=30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_a_traced_service_continues_the_callers_trace_and_exports_its_span() -> None:
    with OtlpReceiver() as receiver:
        lines, code = await _call_demo({"KVMESH_OTLP_ENDPOINT": receiver.endpoint})
        assert code == 0
        # Sent by the time the process exits: stopping flushes what is queued.
        (span,) = receiver.spans(TRACE_ID)
    assert span.name == "kvmesh.api.kvstore.v1.KVStoreService/Stats"
    assert span.parent_span_id == CALLER_SPAN
    assert span.service == "kvmesh-demo"
    assert span.attributes["rpc.method"] == "Stats"
    assert span.end_ns >= span.start_ns > 0
    assert lines[-1]["trace_id"] == TRACE_ID  # the call's log lines name its trace


async def test_with_export_off_nothing_is_sent_and_the_trace_id_still_reaches_the_logs() -> None:
    with OtlpReceiver() as receiver:
        # An endpoint in the environment, switched off the standard way.
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_SDK_DISABLED": "true"}
        lines, code = await _call_demo(env)
        assert code == 0
        assert receiver.exports == 0 and receiver.spans() == []
    assert lines[-1]["trace_id"] == TRACE_ID
    assert not any(line["event"] == "tracing on" for line in lines)


def test_settings_take_the_flags_then_the_standard_variables() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4317", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
    assert TraceSettings.from_env(None, None, env) == TraceSettings("http://a:4317", 0.1)
    traces_only = {**env, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b:4317"}
    assert TraceSettings.from_env(None, None, traces_only).endpoint == "http://b:4317"
    assert TraceSettings.from_env("http://c:4317", 0.5, traces_only) == TraceSettings("http://c:4317", 0.5)
    assert TraceSettings.from_env(None, None, {}) == TraceSettings(None, 1.0)
    assert TraceSettings.from_env("http://c:4317", None, {"OTEL_TRACES_EXPORTER": "none"}).endpoint is None
    with pytest.raises(ValueError, match="within"):
        TraceSettings.from_env(None, 1.5, {})


def test_off_an_incoming_context_is_passed_on_unchanged() -> None:
    assert not tracing.enabled()
    assert tracing.outgoing_metadata() == []
    incoming = [("traceparent", TRACEPARENT), ("tracestate", "k=v"), ("x-request-id", "r")]
    with tracing.server_span("x", incoming) as span:
        assert not span.is_recording()
        assert tracing.outgoing_metadata() == [("traceparent", TRACEPARENT), ("tracestate", "k=v")]
        assert tracing.current_traceparent() == TRACEPARENT
    assert tracing.outgoing_metadata() == []
