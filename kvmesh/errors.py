"""Domain errors shared by every kvmesh component.

Cores raise these; the service framework's one interceptor maps each to its
gRPC status code (and the gateway's HTTP layer to an HTTP status), so the
mapping lives in exactly one place: ``KvmeshError.code`` names the gRPC code
by its ``grpc.StatusCode`` member name, keeping this module free of gRPC
imports.
"""

from __future__ import annotations


class KvmeshError(Exception):
    """Base of all domain errors. ``code`` is a ``grpc.StatusCode`` member name."""

    code = "INTERNAL"
    http_status = 500
    # A finer machine-readable reason (the OpenAI error code, e.g. "context_length_exceeded"), or None.
    reason: str | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvmeshError):
    """The request itself is wrong (bad parameter, empty prompt, too long)."""

    code = "INVALID_ARGUMENT"
    http_status = 400


class InvalidField(InvalidArgument):
    """One field of a request is wrong. ``field`` is its path in the gRPC request ("sampling.temperature",
    "tools[1].parameters_json"): it travels with the status (trailing metadata ``kvmesh-field``), and the
    HTTP API reports it as the OpenAI parameter it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class RequestFailed(KvmeshError):
    """One request failed inside the engine (its sampling, grammar, penalties, a token it made); the
    worker and every other request go on."""

    code = "INTERNAL"
    http_status = 500


class NotFound(KvmeshError):
    code = "NOT_FOUND"
    http_status = 404


class AlreadyExists(KvmeshError):
    code = "ALREADY_EXISTS"
    http_status = 409


class FailedPrecondition(KvmeshError):
    """The system is not in a state for this (e.g. a worker's KV layout does not match)."""

    code = "FAILED_PRECONDITION"
    http_status = 400


class ResourceExhausted(KvmeshError):
    """Load shed or a budget exceeded (admission control, a block over the store budget)."""

    code = "RESOURCE_EXHAUSTED"
    http_status = 429


class Unavailable(KvmeshError):
    """A dependency is down or no worker can take the request; retrying later may work."""

    code = "UNAVAILABLE"
    http_status = 503


class Unauthenticated(KvmeshError):
    code = "UNAUTHENTICATED"
    http_status = 401


class PermissionDenied(KvmeshError):
    """An authenticated caller whose role may not call this method (kvmesh.runtime.authz)."""

    code = "PERMISSION_DENIED"
    http_status = 403


class DeadlineExceeded(KvmeshError):
    code = "DEADLINE_EXCEEDED"
    http_status = 504


class Aborted(KvmeshError):
    """The operation was cancelled or its lease expired."""

    code = "ABORTED"
    http_status = 409


class ModelLoadError(KvmeshError):
    """A model folder is missing a file, has a corrupt one, or an unsupported architecture."""

    code = "FAILED_PRECONDITION"
    http_status = 500
