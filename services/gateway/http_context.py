"""What the HTTP middlewares attach to each request for the handlers."""

from __future__ import annotations

from aiohttp import web

# The request id (the x-request-id header, or a new one): logs, the mesh's request ids, response ids.
REQUEST_ID = web.RequestKey("request_id", str)
# The caller's tenant (auth.ApiKeys); "" with auth off.
TENANT = web.RequestKey("tenant", str)
