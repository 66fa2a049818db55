"""One request through the split mesh is one trace: every hop's span, parented the way the request went."""

from __future__ import annotations

import asyncio
import json
import random
import secrets
import urllib.request

from kvmesh.runtime.interceptor import BACKGROUND_METHODS
from kvmesh.runtime.otlp_receiver import ReceivedSpan
from tests.e2e.mesh_helpers import http_url, metrics, poll

BLOCK = 16


def _post(url: str, body: dict, headers: dict[str, str]) -> tuple[dict, dict[str, str]]:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read()), dict(response.headers)


def _one(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan:
    found = [s for s in spans if s.service == service and s.name == name]
    assert len(found) == 1, f"{len(found)} spans {name!r} of {service}: {sorted((s.service, s.name) for s in spans)}"
    return found[0]


def _complete(spans: list[ReceivedSpan]) -> bool:
    names = {(s.service, s.name) for s in spans}
    wanted = {
        ("kvmesh-gateway", "POST /v1/completions"),
        ("kvmesh-router", "kvmesh.api.router.v1.RouterService/Route"),
        ("kvmesh-prefill", "kvmesh.api.prefill.v1.PrefillService/Prefill"),
        ("kvmesh-decode", "kvmesh.api.decode.v1.DecodeService/Decode"),
        ("kvmesh-decode", "kv.transfer"),
        ("kvmesh-speculator", "speculator.request"),
    }
    return wanted <= names and any(s.service == "kvmesh-kvstore" for s in spans)


async def _traced_completion(mesh, prompt: list[int], trace_id: str, caller: str) -> tuple[dict, dict[str, str]]:
    # ignore_eos: a random prompt of the random model may well be answered with EOS early.
    body = {
        "model": "llama",
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0,
        "return_timings": True,
        "ignore_eos": True,
    }
    headers = {"traceparent": f"00-{trace_id}-{caller}-01"}
    return await asyncio.to_thread(_post, f"{http_url(mesh)}/v1/completions", body, headers)


async def test_one_request_is_one_trace_through_every_hop(mesh, otlp) -> None:
    trace_id, caller = secrets.token_hex(16), secrets.token_hex(8)
    pulled = metrics(mesh, "decode-0").get("kvmesh_decode_bytes_pulled_total", 0)
    # Five full blocks nobody has cached yet: a hand-off with KV to move.
    prompt = random.Random(trace_id).choices(range(50, 500), k=5 * BLOCK)
    answer, response_headers = await _traced_completion(mesh, prompt, trace_id, caller)

    # The client sees the trace it is in and where the time went.
    assert response_headers["traceresponse"].split("-")[1] == trace_id
    timing = response_headers["Server-Timing"]
    for phase in ("tokenize", "route", "prefill", "kv_transfer", "first_token", "total"):
        assert f"{phase};dur=" in timing
        assert answer["usage"]["timings"][phase] >= 0

    spans = await asyncio.to_thread(otlp.wait_for, _complete, trace_id)
    assert _complete(spans), sorted((s.service, s.name) for s in spans)
    by_id = {s.span_id: s for s in spans}
    http = _one(spans, "kvmesh-gateway", "POST /v1/completions")
    assert http.parent_span_id == caller  # the incoming traceparent is continued
    for s in spans:  # one tree: every other span's parent is in the trace
        assert s is http or s.parent_span_id in by_id, f"{s.service} {s.name} has no parent in the trace"

    request = _one(spans, "kvmesh-gateway", "gateway.generate")
    assert request.parent_span_id == http.span_id
    assert request.attributes["gen_ai.usage.output_tokens"] == 8
    assert request.attributes["gen_ai.usage.input_tokens"] == len(prompt)
    for phase in ("tokenize", "route", "prefill", "decode"):
        assert _one(spans, "kvmesh-gateway", phase).parent_span_id == request.span_id
    route = _one(spans, "kvmesh-gateway", "route")
    assert route.attributes["kvmesh.route.decode_worker"] == "decode-0"
    assert route.attributes["kvmesh.route.total_blocks"] == len(prompt) // BLOCK
    assert _one(spans, "kvmesh-router", "kvmesh.api.router.v1.RouterService/Route").parent_span_id == route.span_id

    prefill = _one(spans, "kvmesh-prefill", "kvmesh.api.prefill.v1.PrefillService/Prefill")
    assert prefill.parent_span_id == _one(spans, "kvmesh-gateway", "prefill").span_id
    compute = _one(spans, "kvmesh-prefill", "prefill.compute")
    assert compute.parent_span_id == prefill.span_id
    assert compute.attributes["kvmesh.computed_tokens"] + compute.attributes["kvmesh.reused_tokens"] == len(prompt)
    assert _one(spans, "kvmesh-prefill", "prefill.queue").parent_span_id == prefill.span_id

    decode = _one(spans, "kvmesh-decode", "kvmesh.api.decode.v1.DecodeService/Decode")
    assert decode.parent_span_id == _one(spans, "kvmesh-gateway", "decode").span_id
    assert decode.instance == "decode-0"
    assert "first_token" in decode.events
    assert decode.attributes["kvmesh.prefill"] == "remote"
    transfer = _one(spans, "kvmesh-decode", "kv.transfer")
    assert transfer.parent_span_id == decode.span_id
    # The KV span's bytes are the bytes the worker pulled for this request, no more, no fewer.
    moved = metrics(mesh, "decode-0")["kvmesh_decode_bytes_pulled_total"] - pulled
    assert transfer.attributes["kvmesh.kv.bytes"] == moved
    assert transfer.attributes["kvmesh.kv.blocks"] == transfer.attributes["kvmesh.kv.blocks_missing"]
    if moved:
        wire_s = transfer.attributes["kvmesh.kv.wire_ns"] / 1e9
        assert 0 < wire_s <= (transfer.end_ns - transfer.start_ns) / 1e9  # never a window shorter than the wire's
        assert transfer.attributes["kvmesh.kv.transport"] in ("grpc", "nixl")

    # Speculation acted for the request on the speculator, in the same trace, under the decode stream.
    speculation = _one(spans, "kvmesh-speculator", "speculator.request")
    assert speculation.parent_span_id == decode.span_id
    assert speculation.attributes["kvmesh.spec.updates"] >= 1
    assert any(s.service == "kvmesh-kvstore" and s.parent_span_id in by_id for s in spans)

    # Sent again, the prompt's blocks are cached where the router says: its prediction is what the worker found.
    again = secrets.token_hex(16)
    await _traced_completion(mesh, prompt, again, caller)
    spans = await asyncio.to_thread(otlp.wait_for, _complete, again)
    predicted = _one(spans, "kvmesh-gateway", "route").attributes["kvmesh.route.predicted_cached_tokens"]
    # Wherever it is prefilled now (the decode worker holds the whole prompt too), on that worker's count.
    found = _one(spans, "kvmesh-gateway", "gateway.generate").attributes["kvmesh.cached_tokens"]
    assert predicted == found > 0
    counted = metrics(mesh, "gateway")
    assert counted["kvmesh_gateway_prompt_cached_tokens_total{kind=found}"] >= found
    assert counted["kvmesh_gateway_prompt_cached_tokens_total{kind=predicted}"] >= predicted


def _heartbeats(mesh) -> float:
    return sum(
        value
        for sample, value in metrics(mesh, "router").items()
        if sample.startswith("kvmesh_rpc_requests_total{") and "method=Heartbeat" in sample
    )


async def test_background_calls_start_no_trace(mesh, otlp) -> None:
    # Two heartbeats answered since now, each exported within 0.1 s had it made a span.
    seen = _heartbeats(mesh)
    beats = await asyncio.to_thread(poll, lambda: _heartbeats(mesh), lambda n: n >= seen + 2, 300)
    assert beats >= seen + 2
    await asyncio.sleep(0.5)
    background = {m.lstrip("/") for m in BACKGROUND_METHODS}
    assert "kvmesh.api.router.v1.RouterService/Heartbeat" in background
    spans = otlp.spans()
    # Inside a request's trace a background call keeps its span (a NIXL handshake made for the request).
    roots = [s for s in spans if s.name in background and not s.parent_span_id]
    assert spans and not roots, f"background calls started traces: {sorted({s.name for s in roots})}"
