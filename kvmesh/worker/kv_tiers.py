"""The kvstore as a worker's second KV tier: fill the prefix cache from it, write new blocks to it."""

from __future__ import annotations

import structlog

from kvmesh.blocks import BlockHash
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.errors import KvmeshError
from kvmesh.worker.kvstore_client import KVStoreClient

log = structlog.get_logger(__name__)

# Blocks imported per engine-thread call (each call waits for the current step to end).
_IMPORT_BATCH = 32


async def fetch_prefix_from_kvstore(
    engine: AsyncEngine, kvstore: KVStoreClient | None, hashes: list[BlockHash], min_blocks: int = 1
) -> int:
    """Import the leading blocks of ``hashes`` that the kvstore has beyond the local cache.

    Returns how many were imported. Fetching is chosen over recomputing when at least
    ``min_blocks`` would come from the store: moving a block's bytes costs far less than the
    forward pass that makes them, except for tiny models, which set a higher bar.
    """
    if kvstore is None or not hashes:
        return 0
    local = await engine.call(lambda e: len(e.blocks.match_prefix(hashes)))
    if local == len(hashes):
        return 0
    in_store = await kvstore.lookup(hashes)
    if in_store - local < max(min_blocks, 1):
        return 0
    if await kvstore.on_nixl():
        return await kvstore.fetch_nixl(engine, hashes[local:in_store])
    imported = 0
    batch = []
    try:
        async for h, payload in kvstore.get(hashes[local:in_store]):
            batch.append((h, payload))
            if len(batch) >= _IMPORT_BATCH:
                imported += await _import(engine, batch)
                batch = []
    except KvmeshError as e:  # not fatal: the rest is computed
        log.warning("kvstore fetch failed part way", error=e.message, imported=imported + len(batch))
    # What arrived whole is kept even if the stream broke: each block was checksum-verified.
    imported += await _import(engine, batch)
    return imported


async def _import(engine: AsyncEngine, blocks: list) -> int:
    if not blocks:
        return 0
    return await engine.call(lambda e: e.import_blocks(blocks))


async def store_held_blocks(
    engine: AsyncEngine, kvstore: KVStoreClient | None, request_id: str, hashes: list[BlockHash]
) -> None:
    """Write a finished prefill's held blocks ``hashes`` to the kvstore, behind the request."""
    if kvstore is None or not hashes:
        return
    # Last block first: the store's LRU then holds a chain's first blocks as the most recent,
    # so eviction trims chains from the tail — a prefix without its head matches nothing.
    if await kvstore.on_nixl():
        await kvstore.put_nixl_behind(engine, request_id, hashes[::-1])
        return
    blocks = await engine.call(lambda e: e.export_held(request_id, hashes))
    kvstore.put_behind(blocks[::-1])
