"""Where one request's time went, from the timings each hop reported: for metrics, headers and clients.

The phases, each measured by the service that did the work (``common.v1.Timings``), in the order a
request meets them: ``tokenize`` (template and tokenizer, here), ``route`` (the router's decision),
``prefill_queue`` and ``prefill`` (waiting for a batch slot, then the forward to the first token, on the
prefill worker), ``kvstore`` (cached blocks fetched from and computed ones stored to the kvstore, by the
prefill worker), ``kv_transfer`` (the hand-off into the decode worker's cache), ``decode_queue``, then
``first_token`` and ``total`` (here, from the request's arrival). Phases a request did not go through
(a local prefill has no ``prefill``) are absent.
"""

from __future__ import annotations

from kvmesh.api.gateway.v1 import gateway_pb2

PHASES = (
    "tokenize",
    "route",
    "prefill_queue",
    "prefill",
    "kvstore",
    "kv_transfer",
    "decode_queue",
    "first_token",
    "total",
)


def phases(end: gateway_pb2.StreamEnd) -> dict[str, int]:
    """The request's phases in nanoseconds (zero ones left out)."""
    ns = {
        "tokenize": end.timings.compute_ns,
        "route": end.route_timings.total_ns,
        "prefill_queue": end.prefill_timings.queue_ns,
        "prefill": end.prefill_timings.compute_ns,
        "kvstore": end.prefill_timings.transfer_ns,
        "kv_transfer": end.decode_timings.transfer_ns,
        "decode_queue": end.decode_timings.queue_ns,
        "first_token": end.timings.first_token_ns,
        "total": end.timings.total_ns,
    }
    return {name: value for name, value in ns.items() if value > 0}


def server_timing(ns: dict[str, int]) -> str:
    """A ``Server-Timing`` header value (durations in milliseconds, as the header defines them)."""
    return ", ".join(f"{name};dur={value / 1e6:.3f}" for name, value in ns.items())


def slowest(ends: list[gateway_pb2.StreamEnd]) -> gateway_pb2.StreamEnd | None:
    """Of a request's choices (``n`` > 1, several prompts), the one that took longest: the client's wait."""
    return max(ends, key=lambda e: e.timings.total_ns, default=None)
