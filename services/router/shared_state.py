"""The router's shared state in Redis, and what it does while Redis is away.

Everything shared lives in Redis (the prefix index, each worker's event sequence, the registry); each
replica keeps a mirror of the registry, pulled at most every ``pull_interval_s``. Redis down: calls go on
over the mirror (``redis_available`` is False, a warning is logged once per outage), and every
``probe_interval_s`` a call pings Redis; when it answers, the local registry is written back and every live
worker is asked to resync on its next PublishKVEvents, which rebuilds the index from the workers' own
snapshots. Redis restarted empty is the same: republish, then resync.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import structlog

from kvmesh.errors import NotFound

from .events import KVEventApplier
from .index import PrefixIndex
from .redis_store import StoreUnavailable
from .registry import WorkerRegistry
from .registry_store import RegistryStore

log = structlog.get_logger()


class SharedState:
    """Mixed into ``Router``: the Redis connection's health, the registry mirror and the resync set."""

    index: PrefixIndex
    registry: WorkerRegistry
    store: RegistryStore
    events: KVEventApplier
    redis_available: bool
    counters: Counter[str]
    _now: Callable[[], float]
    _pull_interval_s: float
    _probe_interval_s: float
    _last_pull: float
    _next_probe: float
    # Workers whose index entries are unknown (registered or published while Redis was down).
    _needs_resync: set[str]
    # Workers dropped while Redis was down: their records and entries are deleted on recovery.
    _dropped_while_down: set[str]
    # worker -> [(routed at, tokens)]: work sent since its last heartbeat.
    _pending: dict[str, list[tuple[float, int]]]

    def _mark_down(self, err: StoreUnavailable) -> None:
        self.counters["redis_errors"] += 1
        if self.redis_available:
            self.redis_available = False
            self.counters["redis_outages"] += 1
            self._next_probe = self._now() + self._probe_interval_s
            log.warning("redis_unavailable", error=err.message, routing="load_only")

    async def _maybe_recover(self) -> None:
        if self.redis_available or self._now() < self._next_probe:
            return
        self._next_probe = self._now() + self._probe_interval_s
        try:
            await self.index.ping()
            await self._republish()
        except StoreUnavailable:
            return
        self.redis_available = True
        self.counters["redis_recoveries"] += 1
        log.info("redis_recovered", workers_to_resync=len(self._needs_resync))

    async def _republish(self) -> None:
        """Write back what Redis missed or lost, then have every live worker resync its entries.

        Only registrations fresher than Redis's copy are written, so a replica
        that was cut off never overwrites heartbeats another replica stored.
        """
        _, shared = await self.store.load()
        stored_at = {s.worker_id: s.heartbeat_at for s in shared}
        if self.registry.cluster_layout is not None:
            await self.store.claim_layout(self.registry.cluster_layout)
        fresher = [s for s in self.registry.all_states() if s.heartbeat_at > stored_at.get(s.worker_id, -float("inf"))]
        await self.store.save(*fresher)
        for worker_id in self._dropped_while_down:
            await self.store.delete(worker_id)
            await self.index.drop_worker(worker_id)
        self._dropped_while_down.clear()
        self._needs_resync = {s.worker_id for s in self.registry.live()}

    def workers_needing_resync(self) -> set[str]:
        """Workers whose index entries are unknown; their next PublishKVEvents says resync."""
        return set(self._needs_resync)

    async def _pull(self, *, force: bool = False) -> None:
        """Refresh the registry mirror from Redis (what other replicas registered or heard)."""
        if not self.redis_available or (not force and self._now() - self._last_pull < self._pull_interval_s):
            return
        try:
            layout, states = await self.store.load()
            if layout is None and self.registry.cluster_layout is not None:
                # Redis restarted empty between two calls: nothing failed, but
                # the shared registry and index are gone. Restore, then read.
                self.counters["redis_state_losses"] += 1
                log.warning("redis_state_lost", action="republish_and_resync")
                await self._republish()
                layout, states = await self.store.load()
        except StoreUnavailable as e:
            self._mark_down(e)
            return
        self._last_pull = self._now()
        if layout is not None:
            self.registry.adopt_layout(layout)
        self.registry.merge(states)

    async def _check_lease(self, worker_id: str, lease_id: str | None) -> None:
        try:
            self.registry.check_lease(worker_id, lease_id)
        except NotFound:
            await self._pull(force=True)  # it may have registered through another replica
            self.registry.check_lease(worker_id, lease_id)
