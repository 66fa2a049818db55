"""The reverse of the server interceptor's mapping: a failed outgoing call -> a domain error.

Clients of other services (the gateway's backends, decode pulling KV, workers
talking to the router) catch ``grpc.aio.AioRpcError`` at the call site and
re-raise it as the ``KvmeshError`` with the same code, so cores never see gRPC.
"""

from __future__ import annotations

import grpc

from kvmesh import errors

_BY_CODE: dict[str, type[errors.KvmeshError]] = {
    cls.code: cls
    for cls in (
        errors.InvalidArgument,
        errors.NotFound,
        errors.AlreadyExists,
        errors.FailedPrecondition,
        errors.ResourceExhausted,
        errors.Unavailable,
        errors.Unauthenticated,
        errors.DeadlineExceeded,
        errors.Aborted,
    )
}


def from_rpc_error(e: grpc.aio.AioRpcError, peer: str = "") -> errors.KvmeshError:
    """The domain error for a failed call; ``peer`` names who failed, for the message."""
    code = e.code().name
    who = f"{peer}: " if peer else ""
    if code == "CANCELLED":
        return errors.Aborted(f"{who}call cancelled")
    cls = _BY_CODE.get(code, errors.Unavailable if code in ("UNKNOWN", "INTERNAL") else errors.KvmeshError)
    return cls(f"{who}{e.details() or code.lower()}")
