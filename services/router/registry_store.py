"""The registry shared through Redis, so every router replica routes over the same workers.

- ``P layout``: the cluster's KV layout, set once by the first registration
  anywhere (SET NX), so two replicas can never admit different layouts.
- ``P workers``: worker id -> its state as JSON (info, lease, load, expiry).

A heartbeat landing on any replica rewrites the worker's state; the others see
it on their next pull. A lapsed worker is deleted by whichever replica notices
first, and only if its stored lease really lapsed (a script compares the
stored expiry), so a heartbeat racing the expiry is never lost.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from .redis_store import KEY_PREFIX, redis_errors_as_unavailable
from .registry import WorkerState
from .worker import KVLayout

_DELETE_IF_EXPIRED = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
if cjson.decode(raw)['expires_at'] > tonumber(ARGV[2]) then return 0 end
return redis.call('HDEL', KEYS[1], ARGV[1])
"""


class RegistryStore:
    def __init__(self, client: aioredis.Redis, *, prefix: str = KEY_PREFIX) -> None:
        self._r = client
        self._layout_key = f"{prefix}layout"
        self._workers_key = f"{prefix}workers"
        self._delete_if_expired = client.register_script(_DELETE_IF_EXPIRED)

    async def claim_layout(self, layout: KVLayout) -> KVLayout:
        """The cluster's layout: ``layout`` if none was set yet, else the one set first."""
        with redis_errors_as_unavailable():
            await self._r.set(self._layout_key, json.dumps(layout.to_json()), nx=True)
            raw = await self._r.get(self._layout_key)
        return KVLayout.from_json(json.loads(raw))

    async def save(self, *states: WorkerState) -> None:
        if not states:
            return
        mapping = {s.worker_id: json.dumps(s.to_json()) for s in states}
        with redis_errors_as_unavailable():
            await self._r.hset(self._workers_key, mapping=mapping)

    async def delete(self, worker_id: str) -> bool:
        with redis_errors_as_unavailable():
            return bool(await self._r.hdel(self._workers_key, worker_id))

    async def delete_if_expired(self, worker_id: str, now: float) -> bool:
        """Delete the worker only if its stored lease lapsed; True when this call deleted it."""
        with redis_errors_as_unavailable():
            return bool(await self._delete_if_expired(keys=[self._workers_key], args=[worker_id, now]))

    async def load(self) -> tuple[KVLayout | None, list[WorkerState]]:
        with redis_errors_as_unavailable():
            async with self._r.pipeline(transaction=False) as pipe:
                pipe.get(self._layout_key)
                pipe.hgetall(self._workers_key)
                raw_layout, raw_workers = await pipe.execute()
        layout = KVLayout.from_json(json.loads(raw_layout)) if raw_layout else None
        states = [WorkerState.from_json(json.loads(v)) for v in raw_workers.values()]
        return layout, states
