"""The prefix index: which worker holds which KV block, in which tier.

A request's blocks form a hash chain, so what matters for routing is how many
*leading* blocks of the chain a worker already holds: those it need not
compute. GPU hits are per worker (only that worker can use them); kvstore hits
are cluster-wide (any worker can fetch a block from the kvstore), so the index
answers with each worker's GPU prefix and one kvstore prefix.

Two implementations share one interface: ``RedisPrefixIndex`` (the real one:
several router replicas share it) and ``InMemoryPrefixIndex`` (the trace
simulation and unit tests). The index also keeps each worker's last applied
KV-event sequence number, which belongs to the same state: after a Redis
restart both are gone together and the worker must resync.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import redis.asyncio as aioredis

from kvmesh.blocks import HASH_BYTES
from kvmesh.errors import InvalidArgument

from . import index_lua
from .redis_store import KEY_PREFIX, redis_errors_as_unavailable

BlockId = Hashable
"""A block's name: a 16-byte ``kvmesh.blocks`` hash (Redis); any hashable in memory."""


class Tier(enum.Enum):
    GPU = "gpu"
    KVSTORE = "kvstore"


_TIER_BIT = {Tier.GPU: 0, Tier.KVSTORE: 1}


@dataclass(frozen=True)
class PrefixHits:
    """Leading blocks of one chain already held somewhere."""

    # Per worker, leading blocks in that worker's GPU cache (workers with 0 omitted).
    gpu_blocks: dict[str, int] = field(default_factory=dict)
    # Leading blocks present in the kvstore tier (any reporter).
    kvstore_blocks: int = 0


class PrefixIndex(Protocol):
    async def add(self, worker_id: str, tier: Tier, hashes: Sequence[BlockId]) -> None: ...

    async def remove(self, worker_id: str, tier: Tier, hashes: Sequence[BlockId]) -> None: ...

    async def clear(self, worker_id: str, tier: Tier) -> None:
        """Forget every block the worker holds in ``tier``."""
        ...

    async def drop_worker(self, worker_id: str) -> None:
        """Forget the worker entirely: every tier and its sequence number."""
        ...

    async def longest_prefix(self, chain: Sequence[BlockId]) -> PrefixHits: ...

    async def indexed_blocks(self, worker_id: str) -> int:
        """Blocks attributed to the worker, all tiers."""
        ...

    async def last_seq(self, worker_id: str) -> int | None:
        """The worker's last applied event sequence number; None when unknown."""
        ...

    async def set_last_seq(self, worker_id: str, seq: int) -> None: ...

    async def ping(self) -> None:
        """Raise ``StoreUnavailable`` when the backing store is unreachable."""
        ...


class InMemoryPrefixIndex:
    """The index in one process: for simulation, tests, and anything without Redis."""

    def __init__(self) -> None:
        self._holders: dict[Tier, dict[BlockId, set[str]]] = {t: {} for t in Tier}
        self._owned: dict[tuple[str, Tier], set[BlockId]] = {}
        self._seq: dict[str, int] = {}

    async def add(self, worker_id: str, tier: Tier, hashes: Sequence[BlockId]) -> None:
        holders = self._holders[tier]
        self._owned.setdefault((worker_id, tier), set()).update(hashes)
        for h in hashes:
            holders.setdefault(h, set()).add(worker_id)

    async def remove(self, worker_id: str, tier: Tier, hashes: Sequence[BlockId]) -> None:
        owned = self._owned.get((worker_id, tier), set())
        for h in hashes:
            owned.discard(h)
            self._forget(tier, h, worker_id)

    async def clear(self, worker_id: str, tier: Tier) -> None:
        for h in self._owned.pop((worker_id, tier), set()):
            self._forget(tier, h, worker_id)

    async def drop_worker(self, worker_id: str) -> None:
        for tier in Tier:
            await self.clear(worker_id, tier)
        self._seq.pop(worker_id, None)

    def _forget(self, tier: Tier, h: BlockId, worker_id: str) -> None:
        holders = self._holders[tier].get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[tier][h]

    async def longest_prefix(self, chain: Sequence[BlockId]) -> PrefixHits:
        gpu_holders = self._holders[Tier.GPU]
        kv_holders = self._holders[Tier.KVSTORE]
        gpu: dict[str, int] = {}
        live: set[str] | None = None  # workers whose GPU prefix is still growing
        kv_open, kv = True, 0
        for i, h in enumerate(chain):
            here = gpu_holders.get(h, set())
            if live is None:
                live = set(here)
            else:
                for w in live - here:
                    gpu[w] = i
                live &= here
            if kv_open and h not in kv_holders:
                kv_open, kv = False, i
            if not live and not kv_open:
                break
        else:
            for w in live or ():
                gpu[w] = len(chain)
            if kv_open:
                kv = len(chain)
        return PrefixHits({w: n for w, n in gpu.items() if n > 0}, kv)

    async def indexed_blocks(self, worker_id: str) -> int:
        return sum(len(self._owned.get((worker_id, t), ())) for t in Tier)

    async def last_seq(self, worker_id: str) -> int | None:
        return self._seq.get(worker_id)

    async def set_last_seq(self, worker_id: str, seq: int) -> None:
        self._seq[worker_id] = seq

    async def ping(self) -> None:
        return None


class RedisPrefixIndex:
    """The shared index in Redis; the data layout is described in ``index_lua``.

    Every operation is one round trip (bounded batches for bulk writes), and the
    longest-prefix lookup of a 12,500-block chain is one EVALSHA.
    """

    def __init__(self, client: aioredis.Redis, *, prefix: str = KEY_PREFIX, write_batch_blocks: int = 4096) -> None:
        self._r = client
        self._p = prefix
        self._blk = f"{prefix}blk:".encode()
        self._key_len = len(self._blk) + HASH_BYTES
        self._batch = write_batch_blocks
        self._add = client.register_script(index_lua.ADD)
        self._remove = client.register_script(index_lua.REMOVE)
        self._clear_batch = client.register_script(index_lua.CLEAR_BATCH)
        self._longest = client.register_script(index_lua.LONGEST_PREFIX)

    def _keys(self, hashes: Sequence[BlockId]) -> bytes:
        """The blocks' keys, concatenated (the scripts' one-argument chain format)."""
        if not hashes:
            return b""
        joined = self._blk + self._blk.join(hashes)  # type: ignore[arg-type]
        if len(joined) != self._key_len * len(hashes):
            raise InvalidArgument(f"block hashes must be {HASH_BYTES} bytes each")
        return joined

    def _tier_set(self, worker_id: str, tier: Tier) -> str:
        return f"{self._p}wblk:{worker_id}:{tier.value}"

    async def _write(self, script, worker_id: str, tier: Tier, hashes: Sequence[BlockId]) -> None:
        with redis_errors_as_unavailable():
            for start in range(0, len(hashes), self._batch):
                keys = self._keys(hashes[start : start + self._batch])
                await script(args=[self._p, worker_id, tier.value, _TIER_BIT[tier], keys, self._key_len])

    async def add(self, worker_id: str, tier: Tier, hashes: Sequence[BlockId]) -> None:
        await self._write(self._add, worker_id, tier, hashes)

    async def remove(self, worker_id: str, tier: Tier, hashes: Sequence[BlockId]) -> None:
        await self._write(self._remove, worker_id, tier, hashes)

    async def clear(self, worker_id: str, tier: Tier) -> None:
        all_sets = [self._tier_set(worker_id, t) for t in Tier]
        args = [self._p, worker_id, tier.value, _TIER_BIT[tier], self._batch, *all_sets]
        with redis_errors_as_unavailable():
            while await self._clear_batch(args=args):
                pass

    async def drop_worker(self, worker_id: str) -> None:
        for tier in Tier:
            await self.clear(worker_id, tier)
        with redis_errors_as_unavailable():
            await self._r.hdel(f"{self._p}seq", worker_id)

    async def longest_prefix(self, chain: Sequence[BlockId]) -> PrefixHits:
        if not chain:
            return PrefixHits()
        with redis_errors_as_unavailable():
            out = await self._longest(args=[self._p, self._keys(chain), self._key_len])
        kv, rest = int(out[0]), out[1:]
        gpu = {rest[i].decode(): int(rest[i + 1]) for i in range(0, len(rest), 2)}
        return PrefixHits(gpu, kv)

    async def indexed_blocks(self, worker_id: str) -> int:
        with redis_errors_as_unavailable():
            async with self._r.pipeline(transaction=False) as pipe:
                for tier in Tier:
                    pipe.scard(self._tier_set(worker_id, tier))
                return sum(await pipe.execute())

    async def last_seq(self, worker_id: str) -> int | None:
        with redis_errors_as_unavailable():
            raw = await self._r.hget(f"{self._p}seq", worker_id)
        return None if raw is None else int(raw)

    async def set_last_seq(self, worker_id: str, seq: int) -> None:
        with redis_errors_as_unavailable():
            await self._r.hset(f"{self._p}seq", worker_id, seq)

    async def ping(self) -> None:
        with redis_errors_as_unavailable():
            await self._r.ping()
