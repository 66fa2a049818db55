"""A client hanging up cancels its request in the mesh: nothing stays in flight, decode frees its KV."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.parse

import pytest

from tests.e2e.mesh_helpers import metrics
from tests.openai.conftest import MODEL

pytestmark = pytest.mark.timeout(300)

LONG = {"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 450,
        "extra_body": {"ignore_eos": True}}


def _usage(mesh) -> tuple[float, float, float]:
    return (
        metrics(mesh, "gateway")["kvmesh_gateway_inflight_requests"],
        metrics(mesh, "decode-0")["kvmesh_engine_kv_blocks_in_use"],
        metrics(mesh, "prefill-0")["kvmesh_prefill_active_leases"],
    )


def _back_to(mesh, baseline: tuple[float, float, float]) -> tuple[float, float, float]:
    """The usage once it is back at ``baseline`` (or whatever it was after 10 s, for the assertion)."""
    for _ in range(100):
        now = _usage(mesh)
        if now == baseline:
            break
        time.sleep(0.1)
    return now


def test_hanging_up_mid_stream(mesh, client) -> None:
    baseline = _usage(mesh)
    stream = client.chat.completions.create(stream=True, **LONG)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    inflight, blocks, _ = _usage(mesh)
    assert inflight == baseline[0] + 1 and blocks > baseline[1]

    stream.close()

    assert _back_to(mesh, baseline) == baseline


def _gateway_inflight(mesh) -> float:
    return metrics(mesh, "gateway")["kvmesh_gateway_inflight_requests"]


def test_hanging_up_before_a_whole_response(mesh, base_url) -> None:
    baseline = _usage(mesh)
    cancelled = "kvmesh_gateway_requests_total{method=chat,outcome=cancelled}"
    routed = "kvmesh_router_decisions_total{outcome=disaggregated}"
    before = metrics(mesh, "gateway").get(cancelled, 0.0)
    routed_before = metrics(mesh, "router").get(routed, 0.0)
    body = json.dumps({k: v for k, v in LONG.items() if k != "extra_body"} | {"ignore_eos": True, "n": 4}).encode()
    url = urllib.parse.urlsplit(base_url)
    # The client must hang up before the whole response is done, but four 450-token choices take this tiny
    # model well under a second (one took 0.4 s), no longer than one poll of three processes' metrics can take
    # on a loaded machine. Waiting for "all four in flight, decode holding KV" and then hanging up raced the
    # generation: one choice could finish before the others reached decode, or all of them before the hang-up
    # ("ok", not "cancelled"). With the prefill worker stopped no choice gets past its prefill, and no KV lease
    # is handed out, until the gateway has dealt with the hang-up.
    mesh.kill("prefill-0", signal.SIGSTOP)
    try:
        with socket.create_connection((url.hostname, url.port), timeout=30) as conn:
            conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: kvmesh\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            for _ in range(500):  # only the gateway and the router answer while prefill is stopped
                inflight, n_routed = _gateway_inflight(mesh), metrics(mesh, "router").get(routed, 0.0)
                if (inflight, n_routed) == (baseline[0] + 4, routed_before + 4):
                    break
                time.sleep(0.01)
            assert (inflight, n_routed) == (baseline[0] + 4, routed_before + 4)
        # The connection is closed with the four choices routed and waiting on their prefill.
        for _ in range(100):
            if _gateway_inflight(mesh) == baseline[0]:
                break
            time.sleep(0.1)
    finally:
        mesh.kill("prefill-0", signal.SIGCONT)

    assert _back_to(mesh, baseline) == baseline
    assert metrics(mesh, "gateway")[cancelled] - before == 4
