"""The reverse of the server interceptor's mapping: a failed outgoing call -> a domain error.

Clients of other services (the gateway's backends, decode pulling KV, workers
talking to the kvstore) catch ``grpc.aio.AioRpcError`` at the call site and
re-raise it with ``from_rpc_error``, so cores never see gRPC. The code table is
derived from ``kvmesh.errors`` itself, so the mapping lives in one place.
"""

from __future__ import annotations

import grpc

from kvmesh.errors import InvalidArgument, InvalidField, KvmeshError, Unavailable
from kvmesh.runtime.interceptor import FIELD_KEY, REASON_KEY

# The peer failed rather than answered about the request: a caller may retry these
# elsewhere. UNAVAILABLE covers both a peer that cannot be reached and one that says
# it cannot serve (not ready, no worker), so its details are passed on as they are.
_PEER_FAILED = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}


# A peer refusing this service's own role (kvmesh.runtime.authz) says the mesh is misconfigured, not
# that the request is wrong: an internal error here, never passed on to a client as its own 403.
_MESH_REFUSED = {grpc.StatusCode.PERMISSION_DENIED}


def _domain_classes() -> dict[str, type[KvmeshError]]:
    # The first class declaring a code is its canonical one.
    by_code: dict[str, type[KvmeshError]] = {}
    pending = list(KvmeshError.__subclasses__())
    while pending:
        cls = pending.pop(0)
        by_code.setdefault(cls.code, cls)
        pending.extend(cls.__subclasses__())
    return by_code


_BY_CODE = _domain_classes()


def from_rpc_error(exc: grpc.aio.AioRpcError, peer: str = "", timeout_s: float | None = None) -> KvmeshError:
    """The domain error for a failed call; ``peer`` (e.g. "router (host:port)") prefixes peer failures."""
    code, details = exc.code(), exc.details() or exc.code().name
    prefix = f"{peer}: " if peer else ""
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Unavailable(f"{prefix}no answer within {timeout_s:g} s" if timeout_s else f"{prefix}{details}")
    if code == grpc.StatusCode.CANCELLED:
        return Unavailable(f"{prefix}the call was cancelled on the server side: {details}")
    if code in _PEER_FAILED:
        return Unavailable(f"{prefix}{details}")
    cls = _BY_CODE.get(code.name)
    if cls is None or cls is KvmeshError or code in _MESH_REFUSED:
        return KvmeshError(f"{prefix}{code.name}: {details}")
    # The peer's own answer about the request: pass it on as it is, with the field and reason it named.
    said = dict(exc.trailing_metadata() or ())
    err = InvalidField(said[FIELD_KEY], details) if FIELD_KEY in said and cls is InvalidArgument else cls(details)
    if REASON_KEY in said:
        err.reason = said[REASON_KEY]
    return err
