"""The decode worker's logic: adopt a prefill's KV, then stream tokens from the shared batch.

For a remotely prefilled request, the prompt's full blocks are pulled from the
prefill worker (only those this worker's cache lacks; by a NIXL READ or the
gRPC stream, whichever ``KVSource`` the worker runs), imported into the paged
cache as cached blocks, and the lease acknowledged; the request then joins the
continuous batch with the prefill's first token already in place, so only the
partial last block is recomputed. A failed transfer is not fatal: the lease is
aborted and the engine computes whatever blocks did not arrive.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

import structlog

from kvmesh import tracing
from kvmesh.blocks import BlockHash
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.sequence import TokenLogprob
from kvmesh.errors import InvalidField, KvmeshError
from kvmesh.kv_wire import ReceivedBlock
from kvmesh.sampling import SamplingParams
from kvmesh.worker.kv_tiers import fetch_prefix_from_kvstore
from kvmesh.worker.kvstore_client import KVStoreClient
from kvmesh.worker.nixl_layout import NixlBlocks

log = structlog.get_logger(__name__)

# Imports run beside the stream (see _Importer), in batches: from MIN bytes (each engine
# call and thread hop has a fixed cost; the last batch goes whatever its size) to MAX (a
# call holds up the engine's next step while it copies). Past PENDING the stream stops
# reading, and gRPC flow control holds the prefill worker back.
MIN_IMPORT_BATCH_BYTES = 4 << 20
MAX_IMPORT_BATCH_BYTES = 16 << 20
MAX_PENDING_IMPORT_BYTES = 64 << 20


class KVSource(Protocol):
    """How a prefill worker's blocks reach this worker's cache: the gRPC stream, a NIXL READ,
    anything in tests."""

    async def fetch(self, engine: AsyncEngine, remote: RemotePrefill, missing: list[BlockHash], tally: Tally) -> None:
        """Bring ``missing`` (a subset of the lease's blocks) into the engine's cache as cached
        blocks, each checksum-verified, calling ``tally(blocks, bytes)`` as bytes arrive. Raises
        KvmeshError or OSError when they cannot all come; what was imported is only ever whole."""
        ...

    async def release(self, address: str, lease_id: str, ack: bool) -> None: ...


# (blocks, bytes) that arrived: for the worker's counters.
Tally = Callable[[int, int], None]


def report_wire(transport: str, blocks: int, nbytes: int, wire_ns: int) -> None:
    """What a transfer moved, on the current (``kv.transfer``) span. ``wire_ns`` is from asking for the bytes
    to the last one in, never a shorter window: bytes over it is the rate the link really delivered."""
    tracing.set_attributes(
        **{
            "kvmesh.kv.transport": transport,
            "kvmesh.kv.blocks": blocks,
            "kvmesh.kv.bytes": nbytes,
            "kvmesh.kv.wire_ns": wire_ns,
            "kvmesh.kv.gbit_per_s": round(nbytes * 8 / wire_ns, 3) if wire_ns > 0 else None,
        }
    )


class StreamedKVSource(abc.ABC):
    """A ``KVSource`` whose blocks arrive one by one as bytes (``pull``), verified and imported
    beside the stream by an ``_Importer``."""

    @abc.abstractmethod
    def pull(self, address: str, lease_id: str, hashes: list[BlockHash]) -> AsyncIterator[ReceivedBlock]:
        """The blocks, each whole; their checksums are verified before they are imported."""

    transport = "grpc"

    async def fetch(self, engine: AsyncEngine, remote: RemotePrefill, missing: list[BlockHash], tally: Tally) -> None:
        importer = _Importer(engine)
        blocks = nbytes = 0
        start = last = time.perf_counter_ns()
        try:
            async for block in self.pull(remote.address, remote.lease_id, missing):
                last = time.perf_counter_ns()  # the wire is busy until the last block is in
                blocks, nbytes = blocks + 1, nbytes + len(block.payload.data)
                tally(1, len(block.payload.data))
                await importer.put(block)
            await importer.finish()
        finally:
            report_wire(self.transport, blocks, nbytes, last - start)
            await importer.stop()


@dataclass
class RemotePrefill:
    address: str
    lease_id: str
    block_hashes: list[BlockHash]
    first_token: int
    first_logprob: TokenLogprob | None = None
    # Set when the prefill worker's pool is on NIXL: where the blocks lie, for a READ.
    nixl: NixlBlocks | None = None


@dataclass
class DecodeCounters:
    requests: int = 0
    remote_prefills: int = 0
    local_prefills: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    transfer_failures: int = 0
    kvstore_fetched_blocks: int = 0
    active_requests: int = 0


class DecodeWorker:
    def __init__(self, engine: AsyncEngine, kv_source: KVSource, kvstore: KVStoreClient | None = None) -> None:
        self.engine = engine
        self.kv_source = kv_source
        self.kvstore = kvstore
        self.counters = DecodeCounters()

    async def decode(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: bytes = b"",
        remote: RemotePrefill | None = None,
        resume_ids: list[int] | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[tuple[RequestOutput, int]]:
        """Stream the request's outputs, each with the KV transfer time (ns) spent before it.

        ``resume_ids``: a migrated request's output so far (``LLMEngine.add_request``); local prefill only.
        ``adapter``: the LoRA adapter it runs under, the one prefill used (NotFound when not loaded here).
        """
        self.counters.requests += 1
        self.counters.active_requests += 1
        try:
            transfer_ns = 0
            options: dict = {"adapter": adapter}
            if remote is not None:
                self.counters.remote_prefills += 1
                t0 = time.perf_counter_ns()
                with tracing.span("kv.transfer", **{"kvmesh.kv.lease_id": remote.lease_id}):
                    await self._adopt_kv(remote)
                transfer_ns = time.perf_counter_ns() - t0
                options.update(first_token=remote.first_token, first_logprob=remote.first_logprob)
            else:
                self.counters.local_prefills += 1
                hashes = self.engine.prompt_block_hashes(prompt_ids, cache_salt, adapter)
                self.counters.kvstore_fetched_blocks += await fetch_prefix_from_kvstore(
                    self.engine, self.kvstore, hashes
                )
                if resume_ids:
                    options["resume_ids"] = resume_ids
            traceparent = tracing.current_traceparent()
            if traceparent is not None:  # the speculator's span for this request joins its trace
                options["traceparent"] = traceparent
            async for out in self.engine.generate(prompt_ids, params, request_id, cache_salt, **options):
                yield out, transfer_ns
        finally:
            self.counters.active_requests -= 1

    async def _adopt_kv(self, remote: RemotePrefill) -> None:
        wanted = remote.block_hashes
        missing = await self.engine.call(lambda e: [h for h in wanted if h not in e.blocks.hash_to_block])
        tracing.set_attributes(**{"kvmesh.kv.blocks_handed_off": len(wanted), "kvmesh.kv.blocks_missing": len(missing)})
        ok = False
        try:
            if missing:
                await self.kv_source.fetch(self.engine, remote, missing, self._tally)
            ok = True
        except InvalidField:
            raise  # the hand-off the request names is wrong: the caller's error, refused
        except (KvmeshError, OSError) as e:
            # Not fatal: whatever did not arrive is recomputed here.
            self.counters.transfer_failures += 1
            tracing.set_attributes(**{"kvmesh.kv.failed": str(e)})
            log.warning("KV transfer failed; recomputing locally", error=str(e), lease_id=remote.lease_id)
        finally:
            try:
                await asyncio.shield(self.kv_source.release(remote.address, remote.lease_id, ack=ok))
            except (KvmeshError, OSError) as e:  # the holder's TTL frees it anyway
                log.warning("lease release failed", error=str(e), lease_id=remote.lease_id)

    def _tally(self, blocks: int, nbytes: int) -> None:
        self.counters.blocks_pulled += blocks
        self.counters.bytes_pulled += nbytes


class _Importer:
    """Verifies and imports pulled blocks beside the stream, which goes on reading.

    Awaiting each import inside the read loop would stall the stream for a whole step
    whenever the engine is busy (a call runs between steps). Here blocks queue up
    while a call waits, and the next call takes all of them (up to a cap): a busy
    engine costs a few waits per transfer, however many blocks. Checksums are checked
    on a worker thread (zlib releases the GIL), not on the loop that reads the stream.
    Only verified blocks reach ``import_block``, which adopts each one atomically, so
    stopping part way leaves nothing half-imported.
    """

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine
        self._pending: list[ReceivedBlock] = []
        self._pending_bytes = 0
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._finishing = False
        self._task = asyncio.create_task(self._run())

    async def put(self, block: ReceivedBlock) -> None:
        """Queue a block; waits while too much is queued. Raises an earlier batch's error."""
        while self._pending_bytes >= MAX_PENDING_IMPORT_BYTES and not self._task.done():
            self._room.clear()
            await self._room.wait()
        if self._task.done():
            await self._task  # a batch failed (bad checksum, layout mismatch): raise it here
        self._pending.append(block)
        self._pending_bytes += len(block.payload.data)
        self._arrived.set()

    async def finish(self) -> None:
        """Every block is queued: returns once all are imported (or raises the failure)."""
        self._finishing = True
        self._arrived.set()
        await self._task

    async def stop(self) -> None:
        """Abandon what is still queued (the transfer failed or was cancelled)."""
        self._task.cancel()
        # Its own failure was raised by put() or finish() already; this only waits it out.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    async def _run(self) -> None:
        try:
            while True:
                if self._pending_bytes < MIN_IMPORT_BATCH_BYTES and not self._finishing:
                    self._arrived.clear()
                    await self._arrived.wait()
                    continue
                if not self._pending:
                    return
                batch = self._take()
                self._room.set()
                blocks = await asyncio.to_thread(lambda: [b.verified() for b in batch])
                await self._engine.call(lambda e: e.import_blocks(blocks))
        finally:
            self._room.set()  # wake a put() waiting for room: it sees the task ended

    def _take(self) -> list[ReceivedBlock]:
        n, size = 0, 0
        for block in self._pending:
            nbytes = len(block.payload.data)
            if n and size + nbytes > MAX_IMPORT_BATCH_BYTES:
                break
            n, size = n + 1, size + nbytes
        batch, self._pending = self._pending[:n], self._pending[n:]
        self._pending_bytes -= size
        return batch
