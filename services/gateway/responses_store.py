"""Where the gateway keeps stored responses, for ``previous_response_id`` and GET/DELETE /v1/responses/{id}.

A stored response is the response object and its conversation so far (the
continued conversation, this request's input and its output, as input items),
so a follow-up is the stored conversation plus its own input. Records are
keyed by (tenant, id): another tenant's id is as unknown as one that never
existed, and both are a 404. Every record expires ``ttl_s`` after it was
written.

Two stores: Redis (``--redis-url``), which every gateway replica shares, so a
follow-up may land on any replica; and, without Redis, one in this process,
bounded in records, which only serves follow-ups that come back to the same
gateway (one replica, or sticky sessions).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict
from redis.exceptions import RedisError

from kvmesh.errors import NotFound, Unavailable
from services.gateway.responses_objects import Response
from services.gateway.responses_requests import Item

DEFAULT_TTL_S = 24 * 3600.0
DEFAULT_MAX_RECORDS = 10_000
KEY_PREFIX = "kvmesh:responses:"


class StoredResponse(BaseModel):
    model_config = ConfigDict(strict=True)

    response: Response
    conversation: list[Item]


class ResponseNotFound(NotFound):
    """No stored response by that id for this tenant (never stored, expired, deleted, or another tenant's)."""

    def __init__(self, response_id: str, param: str | None) -> None:
        super().__init__(f"no stored response with id {response_id!r} (responses are kept for a limited time)")
        self.param = param


class ResponseStore(abc.ABC):
    """Records by (tenant, response id), each for ``ttl_s`` seconds."""

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s

    async def put(self, tenant: str, stored: StoredResponse) -> None:
        await self._put(tenant, stored.response.id, stored.model_dump_json().encode())

    async def get(self, tenant: str, response_id: str, param: str | None = None) -> StoredResponse:
        """Raises ``ResponseNotFound`` (naming ``param``) when there is none."""
        data = await self._get(tenant, response_id)
        if data is None:
            raise ResponseNotFound(response_id, param)
        return StoredResponse.model_validate_json(data)

    async def delete(self, tenant: str, response_id: str) -> None:
        if not await self._delete(tenant, response_id):
            raise ResponseNotFound(response_id, None)

    @abc.abstractmethod
    async def _put(self, tenant: str, response_id: str, data: bytes) -> None: ...

    @abc.abstractmethod
    async def _get(self, tenant: str, response_id: str) -> bytes | None: ...

    @abc.abstractmethod
    async def _delete(self, tenant: str, response_id: str) -> bool: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Let go of connections."""


class LocalResponseStore(ResponseStore):
    """In this process: the ``max_records`` most recently written, each until its TTL."""

    def __init__(
        self,
        ttl_s: float = DEFAULT_TTL_S,
        max_records: int = DEFAULT_MAX_RECORDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(ttl_s)
        if max_records <= 0:
            raise ValueError(f"max_records must be > 0, got {max_records}")
        self._max = max_records
        self._clock = clock
        self._records: OrderedDict[tuple[str, str], tuple[float, bytes]] = OrderedDict()

    async def close(self) -> None:
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)

    async def _put(self, tenant: str, response_id: str, data: bytes) -> None:
        now = self._clock()
        self._records[(tenant, response_id)] = (now + self.ttl_s, data)
        self._records.move_to_end((tenant, response_id))
        # Oldest first: expired records and, past the bound, the least recently written.
        while self._records:
            expires, _ = next(iter(self._records.values()))
            if expires > now and len(self._records) <= self._max:
                break
            self._records.popitem(last=False)

    async def _get(self, tenant: str, response_id: str) -> bytes | None:
        record = self._records.get((tenant, response_id))
        if record is None:
            return None
        expires, data = record
        if expires <= self._clock():
            del self._records[(tenant, response_id)]
            return None
        return data

    async def _delete(self, tenant: str, response_id: str) -> bool:
        if await self._get(tenant, response_id) is None:
            return False
        del self._records[(tenant, response_id)]
        return True


class RedisResponseStore(ResponseStore):
    """In Redis, shared by every gateway replica: a key per record with the TTL as its expiry."""

    def __init__(self, client: aioredis.Redis, ttl_s: float = DEFAULT_TTL_S, prefix: str = KEY_PREFIX) -> None:
        super().__init__(ttl_s)
        self._client = client
        self._prefix = prefix

    @classmethod
    def connect(
        cls, url: str, *, password: str | None = None, ttl_s: float = DEFAULT_TTL_S, timeout_s: float = 2.0
    ) -> RedisResponseStore:
        """``password`` (from a file, so it is in no command line or URL) overrides one in the URL."""
        extra = {} if password is None else {"password": password}
        client = aioredis.Redis.from_url(url, **extra, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        return cls(client, ttl_s)

    def _key(self, tenant: str, response_id: str) -> str:
        # The tenant as a hash: a fixed-length part no id can reach into, and no tenant name in Redis.
        return f"{self._prefix}{hashlib.sha256(tenant.encode()).hexdigest()}:{response_id}"

    async def _put(self, tenant: str, response_id: str, data: bytes) -> None:
        with _unavailable():
            await self._client.set(self._key(tenant, response_id), data, px=int(self.ttl_s * 1000))

    async def _get(self, tenant: str, response_id: str) -> bytes | None:
        with _unavailable():
            return await self._client.get(self._key(tenant, response_id))

    async def _delete(self, tenant: str, response_id: str) -> bool:
        with _unavailable():
            return bool(await self._client.delete(self._key(tenant, response_id)))

    async def close(self) -> None:
        await self._client.aclose()


@contextlib.contextmanager
def _unavailable() -> Iterator[None]:
    try:
        yield
    except (RedisError, OSError) as e:
        raise Unavailable(f"the response store (Redis) failed: {type(e).__name__}: {e}") from e
