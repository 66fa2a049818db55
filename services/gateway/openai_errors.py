"""Every HTTP error as OpenAI shapes it, ``{"error": {"message", "type", "param", "code"}}``, mapped in this one place.

The status comes from the error itself: ``kvmesh.errors`` classes carry their
``http_status`` (the same classes the gRPC interceptor maps to status codes),
aiohttp's own HTTP errors (unknown path, wrong method, body too large) carry
theirs, and anything else is a 500 whose details stay in the server log.

``param`` names the parameter at fault: ``ParamError``s carry it, and the
core's ``InvalidField``s name a field of the gRPC request, which
``openai_param`` spells the way the OpenAI request does.
"""

from __future__ import annotations

import re

from aiohttp import web
from pydantic import ValidationError

from kvmesh.errors import InvalidArgument, InvalidField, KvmeshError
from services.gateway.openai_responses import ErrorDetail, ErrorResponse

# OpenAI's error type and default code per status.
_CLIENT = "invalid_request_error"
_KINDS: dict[int, tuple[str, str | None]] = {
    401: (_CLIENT, "invalid_api_key"),
    404: (_CLIENT, "not_found"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    503: ("server_error", "service_unavailable"),
    504: ("server_error", "timeout"),
}
# Pydantic's error type for a field the body does not define, and what the client reads instead.
EXTRA_FIELD = "extra_forbidden"
UNKNOWN_FIELD = "unknown field, not served (the gateway's --lenient-fields ignores unknown fields instead)"
# How many problems one validation error lists.
_MAX_LISTED = 4
_TYPE_LABELS = {"str", "int", "float", "bool", "none"}


class ParamError(InvalidArgument):
    """A request parameter is wrong; ``param`` names it as the client spelled it (e.g. "messages.0.content")."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param

    @classmethod
    def from_validation(cls, error: ValidationError) -> ParamError:
        listed: list[str] = []
        first_param = None
        for problem in _closest_members(error.errors(include_url=False, include_input=False)):
            unknown = problem["type"] == EXTRA_FIELD
            # An unknown field's name is the client's, whatever its spelling ("anthropic-beta").
            loc = problem["loc"]
            param = ".".join(filter(None, [_param(loc[:-1]), str(loc[-1])])) if unknown else _param(loc)
            first_param = first_param if first_param is not None else param
            why = UNKNOWN_FIELD if unknown else problem["msg"]
            text = f"{param}: {why}" if param else why
            if text not in listed:
                listed.append(text)
        more = len(listed) - _MAX_LISTED
        message = "; ".join(listed[:_MAX_LISTED]) + (f" (and {more} more)" if more > 0 else "")
        return cls(message or "invalid request body", first_param or None)


def _is_label(part: int | str) -> bool:
    """A location part pydantic adds rather than the request's own: the union member it
    tried ("str", "list[TextPart]") or a message's tag ("role=user")."""
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_LABELS)


def _param(loc: tuple[int | str, ...]) -> str:
    """A validation error's location as the client sees it: field names and list indices."""
    return ".".join(str(p) for p in loc if not _is_label(p))


def _closest_members(problems: list[dict]) -> list[dict]:
    """For a value that matched no member of a union, only the errors of the member it came closest to.

    Pydantic reports every member it tried ("prompt: not a string; prompt.0: not a
    string; prompt.0: must be >= 0; ..."). Closest: its errors lie deepest in the
    value, then more of them are about values rather than types, then fewer.
    """
    kept: list[dict] = []
    unions: dict[tuple, dict[str, list[dict]]] = {}
    for problem in problems:
        loc = problem["loc"]
        # The innermost union: a message's tag ("role=user") leads to the alternatives of its content.
        at = next((i for i in reversed(range(len(loc))) if _is_label(loc[i])), None)
        if at is None:
            kept.append(problem)
        else:
            unions.setdefault(loc[:at], {}).setdefault(loc[at], []).append(problem)

    def closeness(errors: list[dict]) -> tuple[int, int, int]:
        about_values = sum(not e["type"].endswith("_type") for e in errors)
        return max(len(e["loc"]) for e in errors), about_values, -len(errors)

    for members in unions.values():
        kept.extend(max(members.values(), key=closeness))
    return kept


# gRPC request fields whose OpenAI parameter is spelled differently (after "[i]" became ".i").
_RENAMED = (
    (re.compile(r"sampling\.structured_output"), "response_format"),
    (re.compile(r"sampling\.repetition_guard\..+"), "repetition_guard"),
    (re.compile(r"sampling\.logit_bias\..+"), "logit_bias"),
    (re.compile(r"sampling\.(\w+)"), r"\1"),
    (re.compile(r"tool_choice\..+"), "tool_choice"),
    (re.compile(r"chat_template_kwargs_json"), "chat_template_kwargs"),
    (re.compile(r"tools\.(\d+)\.parameters_json"), r"tools.\1.function.parameters"),
    (re.compile(r"tools\.(\d+)\.(\w+)"), r"tools.\1.function.\2"),
    (re.compile(r"messages\.(\d+)\.tool_calls\.(\d+)\.(\w+)"), r"messages.\1.tool_calls.\2.function.\3"),
)


def openai_param(field: str) -> str:
    """A ChatRequest field path ("tools[1].parameters_json") as the OpenAI parameter ("tools.1.function.parameters")."""
    dotted = re.sub(r"\[(\d+)\]", r".\1", field)
    for pattern, spelling in _RENAMED:
        if pattern.fullmatch(dotted):
            return pattern.sub(spelling, dotted)
    return dotted


def error_status(exc: BaseException) -> int:
    if isinstance(exc, KvmeshError):
        return exc.http_status
    if isinstance(exc, web.HTTPException):
        return exc.status
    return 500


def error_body(exc: BaseException, request_id: str) -> tuple[int, ErrorResponse]:
    """The status and body answering ``exc``."""
    status = error_status(exc)
    kind, code = _KINDS.get(status, (_CLIENT if status < 500 else "server_error", None))
    if isinstance(exc, KvmeshError):
        message = exc.message
        # A finer machine-readable reason where the error has one (e.g. "context_length_exceeded").
        code = exc.reason or code
    elif isinstance(exc, web.HTTPException):
        message = exc.text or exc.reason
    else:
        message = f"internal error (request_id={request_id})"
    param = openai_param(exc.field) if isinstance(exc, InvalidField) else getattr(exc, "param", None)
    detail = ErrorDetail(message=message, type=kind, param=param, code=code)
    return status, ErrorResponse(error=detail)
