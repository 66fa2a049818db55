"""A worker's view of the kvstore: which leading blocks it has, fetch them, store new ones.

Prefill and decode use it as their second tier: before computing a prompt,
the blocks the kvstore holds beyond the local cache are fetched instead of
recomputed; after computing, new full blocks are written behind, so the next
worker (or this one, after eviction) finds them. A kvstore that is down is
never fatal: lookups answer 0 and writes are dropped, and the worker computes.

The bytes move on the gRPC Put/Get chunk streams, or, where this worker's pool
and the kvstore are both on NIXL, by the kvstore itself (``KVStoreNixl``), with
gRPC carrying only control.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from kvmesh.api.common.v1 import kv_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.blocks import BlockHash
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.kv_cache import BlockPayload
from kvmesh.errors import KvmeshError
from kvmesh.kv_wire import BlockAssembler, block_to_chunks
from kvmesh.runtime import create_channel
from kvmesh.runtime.client_errors import from_rpc_error
from kvmesh.worker.kv_nixl import NixlEndpoint
from kvmesh.worker.kvstore_nixl import KVStoreNixl

log = structlog.get_logger(__name__)


class KVStoreClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = 2.0,
        max_pending_puts: int = 4,
        nixl: NixlEndpoint | None = None,
        layout: kv_pb2.KVLayout | None = None,
    ) -> None:
        self.address = address
        self._channel = create_channel(address, peer="kvstore")
        self._stub = kvstore_pb2_grpc.KVStoreServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._nixl = KVStoreNixl(nixl, layout, self._stub, address, timeout_s) if nixl is not None else None
        # Write-behind is best effort: past this many puts in flight, new ones are dropped
        # rather than queueing memory behind a slow store.
        self._puts = asyncio.Semaphore(max_pending_puts)
        self._tasks: set[asyncio.Task] = set()
        self.counters = {
            "lookups": 0,
            "blocks_fetched": 0,
            "blocks_put": 0,
            "puts_dropped": 0,
            "errors": 0,
            "nixl_blocks_fetched": 0,
            "nixl_blocks_put": 0,
        }

    async def lookup(self, hashes: list[BlockHash]) -> int:
        """How many leading ``hashes`` the store holds (0 when it cannot be reached)."""
        if not hashes:
            return 0
        self.counters["lookups"] += 1
        try:
            resp = await self._stub.Lookup(kvstore_pb2.LookupRequest(block_hashes=hashes), timeout=self._timeout_s)
            return resp.num_present_prefix
        except grpc.aio.AioRpcError as e:
            self._failed("lookup", e)
            return 0

    async def get(self, hashes: list[BlockHash]) -> AsyncIterator[tuple[BlockHash, BlockPayload]]:
        """The blocks, in order, stopping at the first one the store no longer has.

        The whole stream has a deadline (ten times a unary call's, as a put has): a store that
        hangs part way fails the fetch, and the caller computes the rest, instead of waiting forever.
        """
        call = self._stub.Get(kvstore_pb2.GetRequest(block_hashes=hashes), timeout=self._timeout_s * 10)
        assembler = BlockAssembler()
        try:
            async for msg in call:
                kind = msg.WhichOneof("item")
                if kind == "missing_block_hash":
                    return  # evicted since the lookup: the rest is computed
                if kind == "chunk":
                    block = assembler.add(msg.chunk)
                    if block is not None:
                        self.counters["blocks_fetched"] += 1
                        yield block
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"kvstore {self.address}", self._timeout_s * 10) from None
        finally:
            call.cancel()

    async def on_nixl(self) -> bool:
        """Whether blocks move to and from this kvstore over NIXL now (handshaking first if needed)."""
        return self._nixl is not None and await self._nixl.ready()

    async def fetch_nixl(self, engine: AsyncEngine, hashes: list[BlockHash]) -> int:
        """The leading ``hashes`` the store holds, written into the engine's cache by the kvstore
        and verified here; how many. 0 when the transfer failed (the caller computes them)."""
        assert self._nixl is not None
        try:
            n = await self._nixl.fetch(engine, hashes)
        except KvmeshError as e:
            self.counters["errors"] += 1
            log.warning("kvstore fetch over NIXL failed; computing instead", error=e.message, address=self.address)
            return 0
        self.counters["blocks_fetched"] += n
        self.counters["nixl_blocks_fetched"] += n
        return n

    async def put_nixl_behind(self, engine: AsyncEngine, request_id: str, hashes: list[BlockHash]) -> None:
        """Pin a finished request's held blocks ``hashes`` and have the kvstore READ them in the
        background; returns once they are pinned."""
        assert self._nixl is not None
        if self._puts.locked():
            self.counters["puts_dropped"] += len(hashes)
            return
        pinned = await engine.call(lambda e: e.pin_held(request_id, hashes))
        self._spawn(self._put_nixl(engine, pinned))

    async def _put_nixl(self, engine: AsyncEngine, pinned: list[tuple[BlockHash, int]]) -> None:
        async with self._puts:
            try:
                await self._nixl.put(engine, pinned)
            except KvmeshError as e:
                self.counters["errors"] += 1
                log.warning(
                    "kvstore put over NIXL failed; continuing without it", error=e.message, address=self.address
                )
                return
            self.counters["blocks_put"] += len(pinned)
            self.counters["nixl_blocks_put"] += len(pinned)

    def put_behind(self, blocks: list[tuple[BlockHash, BlockPayload]]) -> None:
        """Store ``blocks`` in the background; returns at once."""
        if not blocks:
            return
        if self._puts.locked():
            self.counters["puts_dropped"] += len(blocks)
            return
        self._spawn(self._put(blocks))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _put(self, blocks: list[tuple[BlockHash, BlockPayload]]) -> None:
        async with self._puts:

            def chunks():
                for h, payload in blocks:
                    for chunk in block_to_chunks(h, payload):
                        yield kvstore_pb2.PutRequest(chunk=chunk)

            log.debug("kvstore Put stream started", blocks=len(blocks))
            try:
                await self._stub.Put(chunks(), timeout=self._timeout_s * 10)
                self.counters["blocks_put"] += len(blocks)
            except grpc.aio.AioRpcError as e:
                self._failed("put", e)

    def _failed(self, op: str, e: grpc.aio.AioRpcError) -> None:
        self.counters["errors"] += 1
        log.warning("kvstore call failed; continuing without it", op=op, code=e.code().name, address=self.address)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._nixl is not None:
            await self._nixl.close()
        await self._channel.close()
