"""What the HTTP middlewares attach to each request for the handlers."""

from __future__ import annotations

from aiohttp import web

# The request id (the x-request-id header, or a new one): logs, the mesh's request ids, response ids.
REQUEST_ID = web.RequestKey("request_id", str)
# The caller's tenant (auth.ApiKeys); "" with auth off.
TENANT = web.RequestKey("tenant", str)
# time.perf_counter_ns() when the request arrived: a streamed answer's Server-Timing.
RECEIVED_NS = web.RequestKey("received_ns", int)
# The request's trace context (None when untraced), named in the response's traceresponse header.
TRACEPARENT = web.RequestKey("traceparent", str | None)
