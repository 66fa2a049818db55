"""The router's Redis connection: fail fast, and one domain error for "Redis is down".

redis-py retries a refused connection several times with exponential backoff
by default; a router must instead notice quickly that Redis is gone and keep
routing on load alone. The client here retries once, at once: enough to replace
a pooled connection that a Redis restart closed, not enough to stall routing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvmesh.errors import Unavailable

KEY_PREFIX = "kvmesh:"


class StoreUnavailable(Unavailable):
    """Redis could not be reached or failed a command."""


def connect(url: str, *, timeout_s: float = 0.5, password: str | None = None) -> aioredis.Redis:
    """A client for the shared index: ``timeout_s`` per attempt, one immediate retry; ``password``
    (from a file, so it is in no command line or URL) overrides one in the URL."""
    extra = {} if password is None else {"password": password}
    return aioredis.Redis.from_url(
        url,
        **extra,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
        decode_responses=False,
    )


@contextlib.contextmanager
def redis_errors_as_unavailable() -> Iterator[None]:
    """Turn any redis-py failure into ``StoreUnavailable`` so callers see only domain errors."""
    try:
        yield
    except RedisError as e:
        raise StoreUnavailable(f"redis: {type(e).__name__}: {e}") from e
    except OSError as e:
        raise StoreUnavailable(f"redis: {e}") from e
