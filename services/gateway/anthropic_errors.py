"""Errors of POST /v1/messages in Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.

The status and message come from ``openai_errors.error_body``, the one place
that maps exceptions to statuses; this only reshapes its answer, naming the
error type the way Anthropic's API (and its clients) do for that status.
"""

from __future__ import annotations

from services.gateway.anthropic_responses import AnthropicErrorDetail, AnthropicErrorResponse, ErrorType
from services.gateway.openai_errors import error_body

_TYPES: dict[int, ErrorType] = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",  # no worker can take it now
    504: "timeout_error",
}


def anthropic_error_body(exc: BaseException, request_id: str) -> tuple[int, AnthropicErrorResponse]:
    """The status and Anthropic body answering ``exc``."""
    status, body = error_body(exc, request_id)
    kind = _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return status, AnthropicErrorResponse(error=AnthropicErrorDetail(type=kind, message=body.error.message))
