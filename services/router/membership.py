"""Workers joining, renewing, leaving and reporting their KV: the router's membership calls.

A worker registers (its KV layout must match the cluster's), renews its lease with heartbeats carrying its
load, publishes KV events (block stored or evicted) in sequence, and resyncs its whole entry set when the
router asks (a gap in its sequence, or entries lost with Redis). The kvstore registers too (role KVSTORE,
no layout): its blocks count as the cluster-wide cache. With Redis down, registrations and heartbeats are
kept locally and KV events are answered "resync required" (``shared_state``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog

from kvmesh.errors import FailedPrecondition, InvalidArgument, Unavailable

from .events import KVEvent, PublishResult
from .index import BlockId, Tier
from .redis_store import StoreUnavailable
from .registry import Lease, WorkerState
from .shared_state import SharedState
from .worker import Role, WorkerInfo, WorkerLoad

log = structlog.get_logger()


@dataclass(frozen=True)
class Registration:
    lease: Lease
    # The sequence number of the worker's first PublishKVEvents.
    expected_seq: int


@dataclass(frozen=True)
class ResyncResult:
    indexed_blocks: int
    expected_seq: int


@dataclass(frozen=True)
class WorkerStatus:
    state: WorkerState
    # None while the index is unavailable.
    indexed_blocks: int | None


class Membership(SharedState):
    """Mixed into ``Router``: the calls workers make about themselves."""

    async def register(self, info: WorkerInfo) -> Registration:
        """Admit a worker (FailedPrecondition on a layout mismatch); drops its old index entries."""
        await self._maybe_recover()
        try:
            # Checked before claiming, so a refused layout never becomes the cluster's.
            self.registry.check_layout(info)
            if self.redis_available and info.layout is not None and info.role.runs_requests:
                try:
                    self.registry.adopt_layout(await self.store.claim_layout(info.layout))
                except StoreUnavailable as e:
                    self._mark_down(e)
            lease = self.registry.register(info)
        except (FailedPrecondition, InvalidArgument):
            self.counters["registrations_refused"] += 1
            raise
        self._pending.pop(info.worker_id, None)
        self._dropped_while_down.discard(info.worker_id)
        expected = 1
        if self.redis_available:
            try:
                await self.store.save(self.registry.get(info.worker_id))
                expected = await self.events.reset(info.worker_id)
            except StoreUnavailable as e:
                self._mark_down(e)
        if not self.redis_available:
            self._needs_resync.add(info.worker_id)
        self.counters["registrations"] += 1
        log.info(
            "worker_registered",
            worker_id=info.worker_id,
            role=info.role.value,
            address=info.address,
        )
        return Registration(lease, expected)

    async def heartbeat(self, worker_id: str, lease_id: str | None, load: WorkerLoad) -> Lease:
        """Renew the lease; NotFound means the worker must register again."""
        await self._maybe_recover()
        await self._check_lease(worker_id, lease_id)
        lease = self.registry.heartbeat(worker_id, lease_id, load)
        if self.redis_available:
            try:
                await self.store.save(self.registry.get(worker_id))
            except StoreUnavailable as e:
                self._mark_down(e)
        return lease

    async def deregister(self, worker_id: str, lease_id: str | None = None) -> bool:
        """Remove a draining worker now; False when it was not registered."""
        if self.registry.get(worker_id) is None:
            await self._pull(force=True)
        if not self.registry.deregister(worker_id, lease_id):
            return False
        self._pending.pop(worker_id, None)
        self._needs_resync.discard(worker_id)
        if self.redis_available:
            try:
                await self.store.delete(worker_id)
                await self.index.drop_worker(worker_id)
            except StoreUnavailable as e:
                self._mark_down(e)
        if not self.redis_available:
            self._dropped_while_down.add(worker_id)
        log.info("worker_deregistered", worker_id=worker_id)
        return True

    async def expire_leases(self) -> list[str]:
        """Drop workers whose lease lapsed, with their index entries. Call periodically."""
        await self._maybe_recover()
        await self._pull()
        gone = self.registry.expire()
        for worker_id in gone:
            self.counters["leases_expired"] += 1
            log.warning("worker_lease_expired", worker_id=worker_id)
            self._pending.pop(worker_id, None)
            self._needs_resync.discard(worker_id)
            if not self.redis_available:
                self._dropped_while_down.add(worker_id)
                continue
            try:
                # Only the replica that deletes the record drops the entries,
                # and only if no heartbeat renewed the lease meanwhile.
                if await self.store.delete_if_expired(worker_id, self._now()):
                    await self.index.drop_worker(worker_id)
            except StoreUnavailable as e:
                self._mark_down(e)
                self._dropped_while_down.add(worker_id)
        return gone

    async def list_workers(self, role: Role | None = None) -> list[WorkerStatus]:
        await self._maybe_recover()
        await self._pull()
        out = []
        for s in self.registry.live(role):
            blocks = None
            if self.redis_available:
                try:
                    blocks = await self.index.indexed_blocks(s.worker_id)
                except StoreUnavailable as e:
                    self._mark_down(e)
            out.append(WorkerStatus(s, blocks))
        return out

    async def publish_kv_events(
        self, worker_id: str, lease_id: str | None, seq: int, events: Sequence[KVEvent]
    ) -> PublishResult:
        await self._maybe_recover()
        await self._check_lease(worker_id, lease_id)
        if self.redis_available and worker_id not in self._needs_resync:
            try:
                result = await self.events.publish(worker_id, seq, events)
            except StoreUnavailable as e:
                self._mark_down(e)
            else:
                self.counters["kv_event_batches"] += 1
                if result.resync_required:
                    self.counters["resyncs_requested"] += 1
                    log.info("worker_resync_required", worker_id=worker_id, reason=result.message)
                return result
        self._needs_resync.add(worker_id)
        self.counters["resyncs_requested"] += 1
        return PublishResult(accepted=False, resync_required=True, expected_seq=None)

    async def resync(
        self,
        worker_id: str,
        lease_id: str | None,
        seq: int,
        snapshot: Mapping[Tier, Sequence[BlockId]],
    ) -> ResyncResult:
        """Replace the worker's index entries with its snapshot (as of ``seq``)."""
        await self._maybe_recover()
        await self._check_lease(worker_id, lease_id)
        if not self.redis_available:
            raise Unavailable("the prefix index (Redis) is unavailable; resync later")
        try:
            n = await self.events.resync(worker_id, seq, snapshot)
        except StoreUnavailable as e:
            self._mark_down(e)
            raise
        self._needs_resync.discard(worker_id)
        self.counters["resyncs_completed"] += 1
        return ResyncResult(n, seq + 1)
