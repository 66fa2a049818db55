"""The prefill worker's logic: run a prompt to its first token and hold its KV for decode.

The engine computes only what its prefix cache lacks (chunked by its token
budget). The request runs with ``max_tokens=1`` and ``hold_prompt_blocks``, so
the moment it finishes its full prompt blocks are held — no other request can
evict them between finishing and the lease taking over. The lease then serves
``pull`` (or, on NIXL, the decode worker's READ of its blocks) until decode
releases it or its TTL runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import structlog

from kvmesh import tracing
from kvmesh.blocks import BlockHash
from kvmesh.checksum import checksum
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.kv_cache import BlockPayload
from kvmesh.engine.sequence import TokenLogprob
from kvmesh.errors import InvalidArgument, NotFound
from kvmesh.sampling import SamplingParams
from kvmesh.worker.kv_nixl import block_checksums
from kvmesh.worker.kv_tiers import fetch_prefix_from_kvstore, store_held_blocks
from kvmesh.worker.kvstore_client import KVStoreClient
from kvmesh.worker.nixl_layout import NixlBlocks
from kvmesh.worker.rank_nixl import RankEndpoints
from services.prefill.leases import Lease, LeaseTable

log = structlog.get_logger(__name__)

# A pull exports its blocks in batches on the engine thread. Each call waits for the
# running step to end, so a busy engine should cost one wait per many blocks: batches
# grow from ~1 MiB (the first bytes leave early) to ~16 MiB (a long transfer needs few
# calls), which also bounds the engine thread's time per call and the bytes buffered.
FIRST_EXPORT_BATCH_BYTES = 1 << 20
MAX_EXPORT_BATCH_BYTES = 16 << 20


@dataclass(frozen=True)
class ExportedBlock:
    block_hash: BlockHash
    payload: BlockPayload
    checksum: bytes  # over payload.data (kvmesh.checksum)


@dataclass
class PrefillResult:
    first_token: int
    first_logprob: TokenLogprob | None
    # Set when the first token already ends the request; then there is no lease.
    finish_reason: str | None
    lease: Lease | None
    block_hashes: list[BlockHash]
    computed_tokens: int
    reused_tokens: int
    total_ns: int
    queue_ns: int  # waiting for a batch slot
    compute_ns: int  # from the first step to the first token
    transfer_ns: int  # fetching cached blocks from the kvstore, storing computed ones there
    # With a lease on a NIXL worker: where its blocks lie, for the decode worker's READ.
    nixl: NixlBlocks | None = None


@dataclass
class PrefillCounters:
    requests: int = 0
    computed_tokens: int = 0
    reused_tokens: int = 0
    leases_acked: int = 0
    leases_aborted: int = 0
    leases_expired: int = 0
    blocks_sent: int = 0
    kvstore_fetched_blocks: int = 0


class PrefillWorker:
    def __init__(
        self,
        engine: AsyncEngine,
        default_ttl_ms: int = 30_000,
        max_ttl_ms: int = 300_000,
        kvstore: KVStoreClient | None = None,
        nixl: RankEndpoints | None = None,
    ) -> None:
        self.engine = engine
        self.kvstore = kvstore
        self.nixl = nixl
        self.leases = LeaseTable()
        self.default_ttl_ms = default_ttl_ms
        self.max_ttl_ms = max_ttl_ms
        self.counters = PrefillCounters()
        self._block_nbytes = engine.kv.block_nbytes  # a constant of the pool's layout

    async def prefill(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        cache_salt: bytes = b"",
        hand_off: bool = True,
        lease_ttl_ms: int = 0,
        adapter: str | None = None,
    ) -> PrefillResult:
        """``adapter``: the LoRA adapter to run under (NotFound when it is not loaded here)."""
        t0 = time.perf_counter_ns()
        hashes = self.engine.prompt_block_hashes(token_ids, cache_salt, adapter)
        with tracing.span("kvstore.fetch") as span:
            fetched = await fetch_prefix_from_kvstore(self.engine, self.kvstore, hashes)
            span.set_attribute("kvmesh.kv.blocks", fetched)
        self.counters.kvstore_fetched_blocks += fetched
        fetched_ns = time.perf_counter_ns()
        # min_tokens as far as the one token goes: it must not be an end token when more were asked for.
        one_token = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        out = None
        stream = self.engine.generate(
            token_ids, one_token, request_id, cache_salt, hold_prompt_blocks=True, adapter=adapter
        )
        async for out in stream:  # noqa: B007 (the last output is the one wanted)
            pass
        computed_ns = time.perf_counter_ns()
        assert out is not None and out.finished  # max_tokens=1: one output, finished
        tracing.record_span("prefill.queue", tracing.wall_ns(out.added_ns), tracing.wall_ns(out.admitted_ns))
        tracing.record_span(
            "prefill.compute",
            tracing.wall_ns(out.admitted_ns),
            tracing.wall_ns(computed_ns),
            **{
                "kvmesh.computed_tokens": len(token_ids) - out.num_cached_tokens,
                "kvmesh.reused_tokens": out.num_cached_tokens,
            },
        )
        # "length" only because of our max_tokens=1; the real request goes on unless it asked for 1.
        reason = out.finish_reason if (out.finish_reason != "length" or params.max_tokens == 1) else None
        lease = None
        nixl = None
        stored_ns = 0
        try:
            hashes, block_ids = await self.engine.call(
                lambda e: (e.held_hashes(request_id), e.held_block_ids(request_id))
            )
            # Blocks computed here (not reused) go to the cluster-wide tier, behind the request.
            computed_from = out.num_cached_tokens // self.engine.block_size
            stored_from = time.perf_counter_ns()
            with tracing.span("kvstore.store", **{"kvmesh.kv.blocks": len(hashes) - computed_from}):
                await store_held_blocks(self.engine, self.kvstore, request_id, hashes[computed_from:])
            stored_ns = time.perf_counter_ns() - stored_from
            if reason is None and hand_off and hashes:
                if self.nixl is not None:
                    nixl = await self._nixl_blocks(block_ids)
                ttl = min(lease_ttl_ms or self.default_ttl_ms, self.max_ttl_ms)
                lease = self.leases.create(request_id, hashes, ttl)
        finally:
            if lease is None:  # nothing to hand off, or cancelled right here: never strand the hold
                await asyncio.shield(self.engine.call(lambda e: e.release_held(request_id)))
        reused = out.num_cached_tokens
        self.counters.requests += 1
        self.counters.reused_tokens += reused
        self.counters.computed_tokens += len(token_ids) - reused
        done = time.perf_counter_ns()
        return PrefillResult(
            first_token=out.new_token_ids[0],
            first_logprob=out.new_logprobs[0] if out.new_logprobs else None,
            finish_reason=reason,
            lease=lease,
            block_hashes=hashes,
            computed_tokens=len(token_ids) - reused,
            reused_tokens=reused,
            total_ns=done - t0,
            queue_ns=out.admitted_ns - out.added_ns,
            compute_ns=computed_ns - out.admitted_ns,
            transfer_ns=(fetched_ns - t0) + stored_ns,
            nixl=nixl,
        )

    async def _nixl_blocks(self, block_ids: list[int]) -> NixlBlocks:
        """The held blocks' places in the pool and their checksums (on worker threads; held
        blocks are pinned and no longer written)."""
        sums = await block_checksums(self.engine.kv, block_ids)
        return NixlBlocks(self.nixl.name, block_ids, sums)

    async def pull(self, lease_id: str, hashes: list[BlockHash]) -> AsyncIterator[ExportedBlock]:
        """The lease's blocks (or the named subset, in that order), each once, checksummed.

        Pipelined: while one batch streams out, the next is exported on the engine thread
        and checksummed on a worker thread (zlib releases the GIL), so neither the engine's
        step waits nor the checksum stall the stream.
        """
        lease = self.leases.get(lease_id)
        wanted = hashes or lease.block_hashes
        unknown = set(wanted) - set(lease.block_hashes)
        if unknown:
            raise InvalidArgument(f"{len(unknown)} requested blocks are not part of lease {lease_id}")
        batches = _export_batches(wanted, self._block_nbytes)
        upcoming = self._prefetch(lease, next(batches, None))
        try:
            while upcoming is not None:
                blocks = await upcoming
                upcoming = self._prefetch(lease, next(batches, None))
                for block in blocks:
                    self.counters.blocks_sent += 1
                    yield block
        finally:
            if upcoming is not None:  # the stream ended early: nobody reads this batch
                upcoming.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await upcoming

    def _prefetch(self, lease: Lease, batch: list[BlockHash] | None) -> asyncio.Task | None:
        return asyncio.ensure_future(self._export(lease, batch)) if batch else None

    async def _export(self, lease: Lease, batch: list[BlockHash]) -> list[ExportedBlock]:
        self.leases.get(lease.lease_id)  # still valid? (released or expired mid-stream -> NOT_FOUND)
        blocks = await self.engine.call(lambda e: e.export_held(lease.request_id, batch))
        if len(blocks) < len(batch):  # released between the check and the export
            raise NotFound(f"lease {lease.lease_id!r} was released while its blocks were streaming")
        digests = await asyncio.to_thread(lambda: [checksum(p.data) for _, p in blocks])
        return [ExportedBlock(h, p, d) for (h, p), d in zip(blocks, digests)]

    async def release(self, lease_id: str, ack: bool) -> int | None:
        """End a lease; returns the blocks unpinned, None when it was already gone (idempotent)."""
        lease = self.leases.pop(lease_id)
        if lease is None:
            return None
        if ack:
            self.counters.leases_acked += 1
        else:
            self.counters.leases_aborted += 1
        return await self.engine.call(lambda e: e.release_held(lease.request_id))

    async def reap_expired_leases(self, interval_s: float = 0.2) -> None:
        """Runs for the service's lifetime: unpins leases nobody released in time."""
        while True:
            for lease in self.leases.pop_expired():
                self.counters.leases_expired += 1
                n = await self.engine.call(lambda e, rid=lease.request_id: e.release_held(rid))
                log.warning("lease expired; blocks unpinned", lease_id=lease.lease_id, blocks=n)
            await asyncio.sleep(interval_s)

    async def release_on_notifications(self, busy_interval_s: float = 0.002, idle_interval_s: float = 0.02) -> None:
        """Runs for the service's lifetime on a NIXL worker: a decode worker's READ of a lease's
        blocks ends with a notification naming the lease, which releases it (as an ACK) at once.
        Polls often while leases are open, rarely when none is (NIXL's progress thread serves the
        READs themselves; this only picks up their notifications)."""
        assert self.nixl is not None
        while True:
            for msg in self.nixl.notifications():
                lease_id = msg.decode(errors="replace")
                if await self.release(lease_id, ack=True) is None:
                    log.info("READ notification for a lease already gone", lease_id=lease_id)
            await asyncio.sleep(busy_interval_s if len(self.leases) else idle_interval_s)

    async def release_all(self) -> None:
        """Shutdown: nobody will pull these any more."""
        for lease in self.leases.all():
            await self.release(lease.lease_id, ack=False)


def _export_batches(hashes: list[BlockHash], block_nbytes: int) -> Iterator[list[BlockHash]]:
    size = max(1, FIRST_EXPORT_BATCH_BYTES // block_nbytes)
    cap = max(1, MAX_EXPORT_BATCH_BYTES // block_nbytes)
    i = 0
    while i < len(hashes):
        yield hashes[i : i + size]
        i += size
        size = min(2 * size, cap)
