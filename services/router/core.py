"""The router core: registry + index + policy, and what happens when Redis goes away.

Everything shared lives in Redis (the prefix index, each worker's event
sequence, the registry), so any replica can answer any call. Each replica
keeps only what is safe to lose: a mirror of the registry (pulled at most every
``pull_interval_s``) and the tokens it routed to each worker since that
worker's last heartbeat, so a burst between heartbeats does not all land on
the same worker.

The kvstore registers too (role KVSTORE, no layout): its KVSTORE-tier blocks
count as the cluster-wide cache in every plan, and it is never chosen to run a
request.

Redis down: routing goes on over the mirrored registry using load alone
(``redis_available`` is False, ``counters["routes_load_only"]`` counts, a
warning is logged once per outage), registrations and heartbeats are kept
locally, and KV events are answered "resync required". Every
``probe_interval_s`` a call pings Redis; when it answers, the local registry
is written back and every live worker is asked to resync on its next
PublishKVEvents, which rebuilds the index from the workers' own snapshots.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import structlog

from kvmesh.blocks import BlockHash, block_hashes
from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

from .events import KVEvent, KVEventApplier, PublishResult
from .index import BlockId, PrefixHits, PrefixIndex, Tier
from .policy import CacheAwarePolicy, Candidate, Policy, RouteInput, RoutePlan
from .redis_store import StoreUnavailable
from .registry import Lease, WorkerRegistry, WorkerState
from .registry_store import RegistryStore
from .worker import Role, WorkerInfo, WorkerLoad

log = structlog.get_logger()

# Hash prompts longer than this off the event loop (12,500 blocks take ~10 ms).
_HASH_INLINE_MAX_BLOCKS = 256


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


class Router:
    def __init__(
        self,
        index: PrefixIndex,
        registry: WorkerRegistry,
        store: RegistryStore,
        policy: Policy | None = None,
        *,
        now: Callable[[], float] = time.time,
        pull_interval_s: float = 0.05,
        probe_interval_s: float = 1.0,
    ) -> None:
        self.index = index
        self.registry = registry
        self.store = store
        self.policy = policy or CacheAwarePolicy()
        self.events = KVEventApplier(index)
        self._now = now
        self._pull_interval_s = pull_interval_s
        self._probe_interval_s = probe_interval_s
        self._last_pull = -float("inf")
        self._next_probe = 0.0
        self._needs_resync: set[str] = set()
        self._dropped_while_down: set[str] = set()
        # worker -> [(routed at, tokens)]: work sent since its last heartbeat.
        self._pending: dict[str, list[tuple[float, int]]] = defaultdict(list)
        self.redis_available = True
        self.counters: Counter[str] = Counter()

    # -- Redis health -------------------------------------------------------

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

    # -- registry -----------------------------------------------------------

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

    # -- KV events ----------------------------------------------------------

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

    # -- routing ------------------------------------------------------------

    async def route(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: bytes = b"",
        max_new_tokens: int = 0,
        exclude: Collection[str] = (),
        request_id: str = "",
    ) -> RoutePlan:
        """Plan a request from its prompt tokens, hashed into the cluster's blocks."""
        await self._pull()
        layout = self.registry.cluster_layout
        if layout is None:
            raise Unavailable("no prefill or decode worker has registered yet")
        args = (token_ids, layout.block_size, layout.model_fingerprint, cache_salt)
        if len(token_ids) // layout.block_size > _HASH_INLINE_MAX_BLOCKS:
            chain = await asyncio.to_thread(block_hashes, *args)
        else:
            chain = block_hashes(*args)
        return await self.route_chain(
            chain,
            num_tokens=len(token_ids),
            block_size=layout.block_size,
            max_new_tokens=max_new_tokens,
            exclude=exclude,
            request_id=request_id,
        )

    async def route_chain(
        self,
        chain: Sequence[BlockHash],
        *,
        num_tokens: int,
        block_size: int,
        max_new_tokens: int = 0,
        exclude: Collection[str] = (),
        request_id: str = "",
    ) -> RoutePlan:
        """Plan a request from a precomputed chain of ``block_size``-token blocks."""
        await self._maybe_recover()
        await self._pull()
        candidates = self._candidates(exclude)
        if not candidates:
            raise Unavailable("no live prefill or decode worker to route to")
        hits = PrefixHits()
        if self.redis_available:
            try:
                hits = await self.index.longest_prefix(chain)
            except StoreUnavailable as e:
                self._mark_down(e)
        if not self.redis_available:
            self.counters["routes_load_only"] += 1
        live = {c.worker_id for c in candidates}
        # Entries of workers that are gone (or excluded) must not attract requests.
        hits = PrefixHits({w: n for w, n in hits.gpu_blocks.items() if w in live}, hits.kvstore_blocks)
        req = RouteInput(num_tokens, block_size, len(chain), hits, index_available=self.redis_available)
        plan = self.policy.choose(req, candidates)
        now = self._now()
        if plan.prefill_locally:
            self._pending[plan.decode_worker].append((now, plan.uncached_tokens + max_new_tokens))
        else:
            self._pending[plan.prefilling_worker].append((now, plan.uncached_tokens))
            self._pending[plan.decode_worker].append((now, max_new_tokens))
        self.counters["routes"] += 1
        log.debug(
            "routed",
            request_id=request_id,
            prefill=plan.prefill_worker,
            decode=plan.decode_worker,
            local=plan.prefill_locally,
            matched=plan.prefill_matched_blocks,
            total=plan.total_blocks,
        )
        return plan

    def _candidates(self, exclude: Collection[str]) -> list[Candidate]:
        out = []
        for s in self.registry.live():
            if s.worker_id in exclude or not s.info.role.runs_requests:
                continue
            # Work this replica sent after the worker's last report is not in
            # that report yet; older entries are, so they are dropped.
            pending = [p for p in self._pending.get(s.worker_id, ()) if p[0] >= s.heartbeat_at]
            self._pending[s.worker_id] = pending
            load = replace(
                s.load,
                tokens_in_flight=s.load.tokens_in_flight + sum(t for _, t in pending),
                queued_requests=s.load.queued_requests + len(pending),
            )
            out.append(Candidate(s.worker_id, s.info.role, load))
        return out
