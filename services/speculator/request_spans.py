"""One span per request the speculator drafts for, in the request's own trace.

The ``Propose`` stream is shared by all of a decode worker's requests, so no call carries a request's trace
context: its first ``ContextUpdate`` does (``traceparent``). The span runs from that update to the request's
end (``RequestFinished``, or the stream's), and says what speculation did for it: updates received, draft
tokens proposed per source, tokens verification accepted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from opentelemetry.trace import Span

from kvmesh import tracing


@dataclass
class _Request:
    span: Span
    updates: int = 0
    accepted: int = 0
    proposed: Counter[str] = field(default_factory=Counter)


class RequestSpans:
    def __init__(self) -> None:
        self._open: dict[str, _Request] = {}

    def update(self, request_id: str, traceparent: str, accepted_draft_tokens: int) -> None:
        request = self._open.get(request_id)
        if request is None:
            if not traceparent or not tracing.enabled():
                return
            span = tracing.continued_span("speculator.request", traceparent, **{"kvmesh.request_id": request_id})
            request = self._open[request_id] = _Request(span)
        request.updates += 1
        request.accepted += accepted_draft_tokens

    def proposed(self, request_id: str, source: str, tokens: int) -> None:
        request = self._open.get(request_id)
        if request is not None:
            request.proposed[source] += tokens

    def finish(self, request_id: str) -> None:
        request = self._open.pop(request_id, None)
        if request is None:
            return
        request.span.set_attributes(
            {
                "kvmesh.spec.updates": request.updates,
                "kvmesh.spec.accepted_tokens": request.accepted,
                "kvmesh.spec.proposed_tokens": sum(request.proposed.values()),
                **{f"kvmesh.spec.proposed_tokens.{source}": n for source, n in request.proposed.items()},
            }
        )
        request.span.end()

    def close(self) -> None:
        """The stream ended: every request still open ends here."""
        for request_id in list(self._open):
            self.finish(request_id)
