"""A client hanging up cancels its request in the mesh: nothing stays in flight, decode frees its KV."""

from __future__ import annotations

import json
import signal

import pytest

from tests.e2e.mesh_helpers import metrics, poll
from tests.openai.conftest import MODEL, post_raw

pytestmark = pytest.mark.timeout(300)

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Count to a thousand."}],
    "max_tokens": 450,
    "extra_body": {"ignore_eos": True},
}


def _usage(mesh) -> tuple[float, float, float]:
    return (
        metrics(mesh, "gateway")["kvmesh_gateway_inflight_requests"],
        metrics(mesh, "decode-0")["kvmesh_engine_kv_blocks_in_use"],
        metrics(mesh, "prefill-0")["kvmesh_prefill_active_leases"],
    )


def _back_to(mesh, baseline: tuple[float, float, float]) -> tuple[float, float, float]:
    """The usage once it is back at ``baseline`` (or whatever it was after 10 s, for the assertion)."""
    return poll(lambda: _usage(mesh), lambda now: now == baseline)


def _decode_rpcs(mesh, code: str) -> float:
    return metrics(mesh, "decode-0").get(
        f"kvmesh_rpc_requests_total{{code={code},method=Decode,service=kvmesh.api.decode.v1.DecodeService}}", 0.0
    )


def _hang_up_after_three_events(mesh, base_url: str, baseline: tuple[float, float, float]) -> str:
    """Stream LONG, hang up with decode stopped once three events are in; the code decode's RPC ended with."""
    before = {code: _decode_rpcs(mesh, code) for code in ("OK", "CANCELLED")}
    body = json.dumps({k: v for k, v in LONG.items() if k != "extra_body"} | {"ignore_eos": True, "stream": True})
    with post_raw(base_url, body.encode()) as conn:
        received = b""
        while received.count(b"data: ") < 3:  # the role, prefill's first token, decode's first
            received += conn.recv(65536)
        mesh.kill("decode-0", signal.SIGSTOP)
    try:  # the connection is closed with decode stopped
        _wait_for_gateway_inflight(mesh, baseline[0])
    finally:
        mesh.kill("decode-0", signal.SIGCONT)
    assert _back_to(mesh, baseline) == baseline
    # The RPC's status is counted as its handler unwinds, after the KV is freed.
    ended = poll(lambda: [code for code, n in before.items() if _decode_rpcs(mesh, code) > n], bool)
    assert ended, "decode's Decode RPC never ended"
    return ended[0]


def test_hanging_up_mid_stream(mesh, base_url) -> None:
    # This tiny model makes 450 tokens in about 0.4 s, and on a loaded machine the events a client has read can
    # trail decode by all of that: decode may finish ("OK") before the hang-up however early the client hangs
    # up. Such a try proves nothing, so the test tries again; a hang-up that never reaches decode mid-sequence
    # ends "OK" every time and fails.
    baseline = _usage(mesh)
    codes = []
    while len(codes) < 5 and "CANCELLED" not in codes:
        codes.append(_hang_up_after_three_events(mesh, base_url, baseline))
    assert codes[-1] == "CANCELLED", codes


def _gateway_inflight(mesh) -> float:
    return metrics(mesh, "gateway")["kvmesh_gateway_inflight_requests"]


def _wait_for_gateway_inflight(mesh, value: float) -> None:
    """Until the gateway has ``value`` requests in flight (10 s at most: the caller's assertions say what was)."""
    poll(lambda: _gateway_inflight(mesh), lambda n: n == value)


def test_hanging_up_before_a_whole_response(mesh, base_url) -> None:
    baseline = _usage(mesh)
    cancelled = "kvmesh_gateway_requests_total{method=chat,outcome=cancelled}"
    routed = "kvmesh_router_decisions_total{outcome=disaggregated}"
    before = metrics(mesh, "gateway").get(cancelled, 0.0)
    routed_before = metrics(mesh, "router").get(routed, 0.0)
    body = json.dumps({k: v for k, v in LONG.items() if k != "extra_body"} | {"ignore_eos": True, "n": 4}).encode()
    # The client must hang up before the whole response is done, but four 450-token choices take this tiny
    # model well under a second (one took 0.4 s), no longer than one poll of three processes' metrics can take
    # on a loaded machine. Waiting for "all four in flight, decode holding KV" and then hanging up raced the
    # generation: one choice could finish before the others reached decode, or all of them before the hang-up
    # ("ok", not "cancelled"). With the prefill worker stopped no choice gets past its prefill, and no KV lease
    # is handed out, until the gateway has dealt with the hang-up.
    mesh.kill("prefill-0", signal.SIGSTOP)
    try:
        with post_raw(base_url, body):
            # Only the gateway and the router answer while prefill is stopped.
            seen = poll(
                lambda: (_gateway_inflight(mesh), metrics(mesh, "router").get(routed, 0.0)),
                lambda seen: seen == (baseline[0] + 4, routed_before + 4),
                polls=500,
                interval_s=0.01,
            )
            assert seen == (baseline[0] + 4, routed_before + 4)
        # The connection is closed with the four choices routed and waiting on their prefill.
        _wait_for_gateway_inflight(mesh, baseline[0])
    finally:
        mesh.kill("prefill-0", signal.SIGCONT)

    assert _back_to(mesh, baseline) == baseline
    assert metrics(mesh, "gateway")[cancelled] - before == 4
