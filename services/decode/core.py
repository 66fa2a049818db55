"""The decode worker's logic: adopt a prefill's KV, then stream tokens from the shared batch.

For a remotely prefilled request, the prompt's full blocks are pulled from the
prefill worker (only those this worker's cache lacks), imported into the paged
cache as cached blocks, and the lease acknowledged; the request then joins the
continuous batch with the prefill's first token already in place, so only the
partial last block is recomputed. A failed transfer is not fatal: the lease is
aborted and the engine computes whatever blocks did not arrive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import structlog

from kvmesh.blocks import BlockHash
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.engine.engine import RequestOutput
from kvmesh.engine.kv_cache import BlockPayload
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import TokenLogprob
from kvmesh.errors import KvmeshError

log = structlog.get_logger(__name__)

# Blocks imported per engine-thread call: one call waits for the current step to end,
# so batching keeps a long transfer from costing one step per block.
IMPORT_BATCH_BLOCKS = 32


class KVSource(Protocol):
    """A prefill worker's hand-off endpoint (gRPC in the service, anything in tests)."""

    def pull(self, address: str, lease_id: str, hashes: list[BlockHash]) -> AsyncIterator[tuple[BlockHash, BlockPayload]]: ...

    async def release(self, address: str, lease_id: str, ack: bool) -> None: ...


@dataclass
class RemotePrefill:
    address: str
    lease_id: str
    block_hashes: list[BlockHash]
    first_token: int
    first_logprob: TokenLogprob | None = None


@dataclass
class DecodeCounters:
    requests: int = 0
    remote_prefills: int = 0
    local_prefills: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    transfer_failures: int = 0
    active_requests: int = 0


class DecodeWorker:
    def __init__(self, engine: AsyncEngine, kv_source: KVSource) -> None:
        self.engine = engine
        self.kv_source = kv_source
        self.counters = DecodeCounters()

    async def decode(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: bytes = b"",
        remote: RemotePrefill | None = None,
    ) -> AsyncIterator[tuple[RequestOutput, int]]:
        """Stream the request's outputs, each with the KV transfer time (ns) spent before it."""
        self.counters.requests += 1
        self.counters.active_requests += 1
        try:
            transfer_ns = 0
            options: dict = {}
            if remote is not None:
                self.counters.remote_prefills += 1
                t0 = time.perf_counter_ns()
                await self._adopt_kv(remote)
                transfer_ns = time.perf_counter_ns() - t0
                options = {"first_token": remote.first_token, "first_logprob": remote.first_logprob}
            else:
                self.counters.local_prefills += 1
            async for out in self.engine.generate(prompt_ids, params, request_id, cache_salt, **options):
                yield out, transfer_ns
        finally:
            self.counters.active_requests -= 1

    async def _adopt_kv(self, remote: RemotePrefill) -> None:
        held = await self.engine.call(lambda e: set(e.blocks.hash_to_block))
        missing = [h for h in remote.block_hashes if h not in held]
        ok = False
        try:
            batch: list[tuple[BlockHash, BlockPayload]] = []
            if missing:
                async for h, payload in self.kv_source.pull(remote.address, remote.lease_id, missing):
                    batch.append((h, payload))
                    self.counters.blocks_pulled += 1
                    self.counters.bytes_pulled += len(payload.data)
                    if len(batch) >= IMPORT_BATCH_BLOCKS:
                        await self._import(batch)
                        batch = []
                await self._import(batch)
            ok = True
        except (KvmeshError, OSError) as e:
            # Not fatal: whatever did not arrive is recomputed here.
            self.counters.transfer_failures += 1
            log.warning("KV transfer failed; recomputing locally", error=str(e), lease_id=remote.lease_id)
        finally:
            try:
                await asyncio.shield(self.kv_source.release(remote.address, remote.lease_id, ack=ok))
            except (KvmeshError, OSError) as e:  # the holder's TTL frees it anyway
                log.warning("lease release failed", error=str(e), lease_id=remote.lease_id)

    async def _import(self, blocks: list[tuple[BlockHash, BlockPayload]]) -> None:
        if blocks:
            await self.engine.call(lambda e: [e.import_block(h, p) for h, p in blocks])
