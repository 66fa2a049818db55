"""gRPC transport settings shared by every server and every client in the mesh."""

from __future__ import annotations

import grpc

from kvmesh.runtime import tls
from kvmesh.runtime.request_id import client_interceptors

# A 1M-token prompt is ~5 MB of token ids; KV moves in chunks of at most 1 MiB,
# so this bounds request size, not KV transfers.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024

_MESSAGE_SIZE = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]

# Both ends ping a connection every KEEPALIVE_TIME_MS and drop it when a ping is not answered within
# KEEPALIVE_TIMEOUT_MS (gRPC also sets TCP_USER_TIMEOUT from it), so a peer that vanished without closing
# its sockets (a host partitioned off the network, a crashed or frozen process) fails the calls to it
# within ~10 s instead of TCP's ~15 minutes: the gateway migrates a stream from a decode worker it cannot
# reach, and a decode worker frees a stream whose gateway is gone. Pings continue on a call that sends
# nothing (a server stream's client, a stream's server while the engine thinks): no limit on pings
# without data.
KEEPALIVE_TIME_MS = 5_000
KEEPALIVE_TIMEOUT_MS = 5_000
_KEEPALIVE = [
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.http2.max_pings_without_data", 0),
]

SERVER_OPTIONS = [
    *_MESSAGE_SIZE,
    *_KEEPALIVE,
    # Linux gRPC enables SO_REUSEPORT by default: a second process on the same
    # port would silently share traffic instead of failing to bind.
    ("grpc.so_reuseport", 0),
    # Accept the clients' keepalive pings (the default policy answers pings more often than every
    # 5 minutes with GOAWAY "too_many_pings"), a little more often than they are sent.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_TIME_MS * 4 // 5),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_TIME_MS),
]

CHANNEL_OPTIONS = [
    *_MESSAGE_SIZE,
    *_KEEPALIVE,
    # A peer that died comes back on the same address (the supervisor restarts it there):
    # reconnect within 2 s rather than gRPC's default backoff of up to 2 minutes, during
    # which every call to it would fail at once although it serves again.
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2_000),
]


def create_channel(address: str, identity: tls.TlsFiles | None = None, *, peer: str | None = None) -> grpc.aio.Channel:
    """A channel to another kvmesh service that carries the current request id on every call, over mutual
    TLS as ``identity`` (default: this process's own, ``tls.use_client_tls``; none: plaintext), talking
    only to a server whose certificate is ``peer``'s role (None: any mesh member)."""
    identity = identity or tls.client_tls()
    if identity is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=client_interceptors())
    return grpc.aio.secure_channel(
        address,
        tls.channel_credentials(identity),
        options=[*CHANNEL_OPTIONS, *tls.channel_options(peer)],
        interceptors=client_interceptors(),
    )


def create_blocking_channel(address: str, identity: tls.TlsFiles | None) -> grpc.Channel:
    """A synchronous channel (the supervisor's and ``kvmesh health``'s checks), over mutual TLS as ``identity``."""
    if identity is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(identity), options=list(tls.channel_options(None)))
