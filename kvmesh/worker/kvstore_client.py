"""A worker's view of the kvstore: which leading blocks it has, fetch them, store new ones.

Prefill and decode use it as their second tier: before computing a prompt,
the blocks the kvstore holds beyond the local cache are fetched instead of
recomputed; after computing, new full blocks are written behind, so the next
worker (or this one, after eviction) finds them. A kvstore that is down is
never fatal: lookups answer 0 and writes are dropped, and the worker computes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import structlog

from kvmesh.blocks import BlockHash
from kvmesh.engine.kv_cache import BlockPayload
from kvmesh.kv_wire import BlockAssembler, block_to_chunks
from kvmesh.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.runtime import create_channel
from kvmesh.runtime.client_errors import from_rpc_error

log = structlog.get_logger(__name__)


class KVStoreClient:
    def __init__(self, address: str, timeout_s: float = 2.0, max_pending_puts: int = 4) -> None:
        self.address = address
        self._channel = create_channel(address)
        self._stub = kvstore_pb2_grpc.KVStoreServiceStub(self._channel)
        self._timeout_s = timeout_s
        # Write-behind is best effort: past this many puts in flight, new ones are dropped
        # rather than queueing memory behind a slow store.
        self._puts = asyncio.Semaphore(max_pending_puts)
        self._tasks: set[asyncio.Task] = set()
        self.counters = {"lookups": 0, "blocks_fetched": 0, "blocks_put": 0, "puts_dropped": 0, "errors": 0}

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

    def put_behind(self, blocks: list[tuple[BlockHash, BlockPayload]]) -> None:
        """Store ``blocks`` in the background; returns at once."""
        if not blocks:
            return
        if self._puts.locked():
            self.counters["puts_dropped"] += len(blocks)
            return
        task = asyncio.create_task(self._put(blocks))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _put(self, blocks: list[tuple[BlockHash, BlockPayload]]) -> None:
        async with self._puts:
            def chunks():
                for h, payload in blocks:
                    for chunk in block_to_chunks(h, payload):
                        yield kvstore_pb2.PutRequest(chunk=chunk)

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
        await self._channel.close()
