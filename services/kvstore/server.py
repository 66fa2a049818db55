"""The kvstore's gRPC servicer: protobuf in, ``KvStore`` calls, protobuf out.

Every core call runs in a worker thread (the core is thread-safe): put, get
and delete do file I/O, and even presence-only calls (lookup, stats) wait on
the core's lock, which an eviction holds while it unlinks files. So a slow
fsync, a large read or a burst of evictions never stalls the event loop.

Put stores each block as soon as its last chunk arrived and its checksum
matched: a bad block later in the same stream fails the call
(INVALID_ARGUMENT) but does not take back the verified blocks before it (a
block is named by its content, so keeping a verified one is always right and a
retried Put finds it present). A block that did not arrive whole is never
stored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc

from kvmesh.api.common.v1 import accounting_pb2, kv_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.blocks import HASH_BYTES
from kvmesh.checksum import CHECKSUM_BYTES
from kvmesh.chunking import DEFAULT_CHUNK_BYTES, Chunk, Reassembler, split
from kvmesh.errors import InvalidArgument, Unavailable
from services.kvstore.block import Block
from services.kvstore.core import KvStore
from services.kvstore.nixl_arena import NixlArena

# docs/contracts.md: at most 1 MiB of data per KVBlockChunk, both ways.
MAX_CHUNK_BYTES = DEFAULT_CHUNK_BYTES
# A NIXL transfer's own deadline: the caller's, less this margin so the answer still reaches it
# (or this cap without a caller deadline).
NIXL_DEADLINE_MARGIN_S = 0.5
NIXL_MAX_TRANSFER_S = 60.0


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServiceServicer):
    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        if not 0 < chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in 1..{MAX_CHUNK_BYTES}, got {chunk_bytes}")
        self._chunk_bytes = chunk_bytes
        self._store: KvStore | None = None
        self._arena: NixlArena | None = None

    def attach(self, store: KvStore, arena: NixlArena | None = None) -> None:
        """Serve ``store`` (and, with NIXL, ``arena`` over it). Opening it indexes the disk tier,
        which can take a while, so it happens in the service's start hook, after the servicer exists."""
        self._store = store
        self._arena = arena

    @property
    def attached(self) -> bool:
        return self._store is not None

    @property
    def store(self) -> KvStore:
        if self._store is None:  # the runtime refuses RPCs until start() attached it; a guard, not a path
            raise Unavailable("the kvstore is still opening")
        return self._store

    async def Put(
        self, request_iterator: AsyncIterator[kvstore_pb2.PutRequest], context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutResponse:
        start = time.perf_counter_ns()
        compute_ns = 0
        stored = present = evicted = 0
        block: _IncomingBlock | None = None
        async for request in request_iterator:
            chunk = request.chunk
            if block is None or block.complete or chunk.block_hash != block.header.block_hash:
                if block is not None and not block.complete:
                    raise InvalidArgument(f"{block.describe_cut_off()} by chunks of another block")
                block = _IncomingBlock(chunk, self.store.max_block_bytes)
            block.add(chunk)
            if block.complete:
                t = time.perf_counter_ns()
                result = await asyncio.to_thread(self.store.put, block.header.block_hash, block.finish())
                compute_ns += time.perf_counter_ns() - t
                stored += result.stored
                present += not result.stored
                evicted += result.ram_evictions
        if block is not None and not block.complete:
            raise InvalidArgument(f"{block.describe_cut_off()} by the end of the stream")
        total_ns = time.perf_counter_ns() - start
        return kvstore_pb2.PutResponse(
            stored_blocks=stored,
            already_present_blocks=present,
            evicted_blocks=evicted,
            timings=accounting_pb2.Timings(compute_ns=compute_ns, transfer_ns=total_ns - compute_ns, total_ns=total_ns),
        )

    async def Get(
        self, request: kvstore_pb2.GetRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kvstore_pb2.GetResponse]:
        start = time.perf_counter_ns()
        hashes = list(request.block_hashes)
        for h in hashes:
            _check_hash(h)
        chunk_bytes = min(request.max_chunk_bytes or self._chunk_bytes, MAX_CHUNK_BYTES)
        compute_ns = 0
        found = 0
        # Read one block ahead while the current one streams: disk reads and
        # checksum verification overlap with sending.
        next_read = self._read(hashes[0]) if hashes else None
        try:
            for i, block_hash in enumerate(hashes):
                current = next_read or self._read(block_hash)
                next_read = self._read(hashes[i + 1]) if i + 1 < len(hashes) else None
                t = time.perf_counter_ns()
                block = await current
                compute_ns += time.perf_counter_ns() - t
                if block is None:
                    yield kvstore_pb2.GetResponse(missing_block_hash=block_hash)
                    continue
                found += 1
                for chunk in split(block.data, chunk_bytes):
                    yield kvstore_pb2.GetResponse(chunk=_chunk_message(block_hash, block, chunk))
        finally:
            if next_read is not None:  # the client went away mid-stream
                next_read.cancel()
        total_ns = time.perf_counter_ns() - start
        yield kvstore_pb2.GetResponse(
            summary=kvstore_pb2.GetSummary(
                found_blocks=found,
                missing_blocks=len(hashes) - found,
                timings=accounting_pb2.Timings(
                    compute_ns=compute_ns, transfer_ns=total_ns - compute_ns, total_ns=total_ns
                ),
            )
        )

    async def Lookup(
        self, request: kvstore_pb2.LookupRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LookupResponse:
        start = time.perf_counter_ns()
        matched = await asyncio.to_thread(self.store.lookup, list(request.block_hashes))
        elapsed = time.perf_counter_ns() - start
        return kvstore_pb2.LookupResponse(
            num_present_prefix=matched, timings=accounting_pb2.Timings(compute_ns=elapsed, total_ns=elapsed)
        )

    async def Delete(
        self, request: kvstore_pb2.DeleteRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.DeleteResponse:
        deleted = await asyncio.to_thread(self.store.delete, list(request.block_hashes))
        return kvstore_pb2.DeleteResponse(deleted_blocks=deleted)

    async def Stats(
        self, request: kvstore_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.StatsResponse:
        stats = await asyncio.to_thread(self.store.stats)
        disk = stats.disk
        return kvstore_pb2.StatsResponse(
            ram_blocks=stats.ram.blocks,
            ram_bytes=stats.ram.bytes,
            ram_budget_bytes=stats.ram.budget_bytes,
            disk_blocks=disk.blocks if disk else 0,
            disk_bytes=disk.bytes if disk else 0,
            disk_budget_bytes=disk.budget_bytes if disk else 0,
            hits=stats.hits_ram + stats.hits_disk,
            misses=stats.misses,
            # A block pushed out of RAM may live on on disk; both tiers' evictions count.
            evictions=stats.ram.evictions + (disk.evictions if disk else 0),
            corrupt_blocks=stats.corrupt_detected,
        )

    async def NixlHandshake(
        self, request: kvstore_pb2.NixlHandshakeRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.NixlHandshakeResponse:
        arena = self._nixl()
        name = arena.handshake(request.layout, request.agent_name, request.agent_metadata, request.region)
        return kvstore_pb2.NixlHandshakeResponse(agent_name=name, layout=arena.layout)

    async def PutNixl(
        self, request: kvstore_pb2.PutNixlRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.PutNixlResponse:
        start = time.perf_counter_ns()
        n = CHECKSUM_BYTES
        sums = [request.checksums[i : i + n] for i in range(0, len(request.checksums), n)]
        out = await self._nixl().put(
            request.agent_name, list(request.block_hashes), list(request.block_ids), sums, _transfer_timeout_s(context)
        )
        total_ns = time.perf_counter_ns() - start
        return kvstore_pb2.PutNixlResponse(
            stored_blocks=out.stored,
            already_present_blocks=out.present,
            evicted_blocks=out.evicted,
            timings=accounting_pb2.Timings(transfer_ns=total_ns, total_ns=total_ns),
        )

    async def GetNixl(
        self, request: kvstore_pb2.GetNixlRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.GetNixlResponse:
        start = time.perf_counter_ns()
        hashes = list(request.block_hashes)
        for h in hashes:
            _check_hash(h)
        sums = await self._nixl().get(request.agent_name, hashes, list(request.block_ids), _transfer_timeout_s(context))
        total_ns = time.perf_counter_ns() - start
        return kvstore_pb2.GetNixlResponse(
            found_blocks=len(sums),
            checksums=b"".join(sums),
            timings=accounting_pb2.Timings(transfer_ns=total_ns, total_ns=total_ns),
        )

    def _nixl(self) -> NixlArena:
        self.store  # noqa: B018 - still opening -> UNAVAILABLE
        if self._arena is None:
            raise Unavailable("this kvstore moves blocks over gRPC only (--kv-transport grpc, or NIXL did not load)")
        return self._arena

    def _read(self, block_hash: bytes) -> asyncio.Future[Block | None]:
        return asyncio.ensure_future(asyncio.to_thread(self._get_one, block_hash))

    def _get_one(self, block_hash: bytes) -> Block | None:
        (block,) = self.store.get([block_hash])
        return block


class _IncomingBlock:
    """One block of a Put stream being reassembled. Every chunk must repeat the
    first chunk's descriptive fields; data is checked against the checksum at the end."""

    def __init__(self, first: kv_pb2.KVBlockChunk, max_bytes: int) -> None:
        _check_hash(first.block_hash)
        self.header = first
        self.reassembler = Reassembler(first.checksum, max_bytes=max_bytes)
        self._received = 0

    @property
    def complete(self) -> bool:
        return self._received == self.header.num_chunks

    def add(self, chunk: kv_pb2.KVBlockChunk) -> None:
        if len(chunk.data) > MAX_CHUNK_BYTES:
            raise InvalidArgument(f"chunk of {len(chunk.data)} bytes is over the {MAX_CHUNK_BYTES}-byte limit")
        first = self.header
        if (chunk.checksum, chunk.dtype, list(chunk.shape)) != (first.checksum, first.dtype, list(first.shape)):
            raise InvalidArgument(
                f"chunk {chunk.chunk_index} of block {first.block_hash.hex()} "
                "disagrees with the block's first chunk on checksum, dtype or shape"
            )
        self.reassembler.add(Chunk(chunk.chunk_index, chunk.num_chunks, chunk.total_bytes, chunk.data))
        self._received += 1

    def describe_cut_off(self) -> str:
        return (
            f"block {self.header.block_hash.hex()} was cut off after "
            f"{self._received} of {self.header.num_chunks} chunks"
        )

    def finish(self) -> Block:
        data = self.reassembler.finish()
        return Block(data, tuple(self.header.shape), self.header.dtype, self.header.checksum)


def _chunk_message(block_hash: bytes, block: Block, chunk: Chunk) -> kv_pb2.KVBlockChunk:
    return kv_pb2.KVBlockChunk(
        block_hash=block_hash,
        chunk_index=chunk.index,
        num_chunks=chunk.count,
        total_bytes=chunk.total_bytes,
        shape=block.shape,
        dtype=block.dtype,
        checksum=block.checksum,
        data=chunk.data,
    )


def _transfer_timeout_s(context: grpc.aio.ServicerContext) -> float:
    remaining = context.time_remaining()
    if remaining is None:
        return NIXL_MAX_TRANSFER_S
    return max(0.0, min(NIXL_MAX_TRANSFER_S, remaining - NIXL_DEADLINE_MARGIN_S))


def _check_hash(block_hash: bytes) -> None:
    if len(block_hash) != HASH_BYTES:
        raise InvalidArgument(f"a block hash is {HASH_BYTES} bytes, got {len(block_hash)}")
