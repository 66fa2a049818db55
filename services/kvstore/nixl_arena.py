"""The kvstore's NIXL data plane: blocks move between a worker's pool and the store without crossing gRPC.

An arena of block slots is registered with NIXL and shaped like a worker's
pool (``[layers, 2, slots, block tokens, kv heads, head dim]``; 1 plane for MLA's latent), so the same
descriptor code (``kvmesh.worker.kv_nixl``) addresses its slots and a worker's
blocks. It takes the KV layout of the first worker that handshakes; a worker
with another layout is refused there, before any byte moves. The kvstore drives
both directions inside the one RPC that asks for them, so no slot and no pin
outlives a call:

- put: it READs the worker's blocks into slots (in chunks, each copied out and
  checksummed as it lands), stores every block whose checksum matches;
- get: it copies the leading present blocks into slots and WRITEs them into the
  blocks the worker reserved, then answers with their checksums (the worker
  verifies what landed before using it). A WRITE rather than a worker-side
  READ: one round trip instead of two (where-are-they, then read-and-release),
  and no lease on the store's slots that a dead worker could strand.

The RAM tier keeps blocks as bytes, so each block is copied once between the
arena and the tier (memcpy speed, several times the transfer's). Every wait
has a deadline: a transfer can stay in progress forever when its peer dies.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import numpy
import structlog
import torch

from kvmesh.api.common.v1 import kv_pb2
from kvmesh.blocks import BlockHash
from kvmesh.checksum import checksum
from kvmesh.engine.config import parse_dtype
from kvmesh.engine.kv_cache import LATENT_KV_LAYOUT, host_zeros_on_huge_pages
from kvmesh.errors import FailedPrecondition, InvalidArgument
from kvmesh.worker.kv_nixl import BlockRead, NixlEndpoint, NixlRead
from kvmesh.worker.nixl_layout import PoolRegion, layout_mismatch
from services.kvstore.block import Block
from services.kvstore.core import KvStore

log = structlog.get_logger(__name__)

# After a failed or abandoned transfer, how long to wait for UCX to give up on it before its
# slots may be reused; past this they never are.
SETTLE_TIMEOUT_S = 60.0


@dataclass
class ArenaCounters:
    handshakes: int = 0
    handshakes_refused: int = 0
    blocks_put: int = 0  # read out of workers' pools and stored
    blocks_got: int = 0  # written into workers' pools
    transfer_failures: int = 0


@dataclass(frozen=True)
class PutOutcome:
    stored: int
    present: int
    evicted: int


class NixlArena:
    def __init__(self, nixl: Any, budget_bytes: int, store: KvStore) -> None:
        self._nixl = nixl
        self._budget_bytes = budget_bytes
        self._store = store
        self.layout: kv_pb2.KVLayout | None = None
        self.endpoint: NixlEndpoint | None = None
        self._pieces: numpy.ndarray | None = None  # [2 * layers, slots, piece bytes] view of the arena
        self._shape: tuple[int, ...] = ()
        self._dtype = ""
        self._free: list[int] = []
        self._slots_freed = asyncio.Condition()
        self._pending: set[asyncio.Task] = set()  # slots on their way back
        self.counters = ArenaCounters()

    @property
    def slots_in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def capacity(self) -> int:
        return 0 if self._pieces is None else self._pieces.shape[1]

    def handshake(
        self, layout: kv_pb2.KVLayout, agent_name: str, metadata: bytes, region: kv_pb2.NixlPoolRegion
    ) -> str:
        """Know a worker's pool; returns this arena's agent name. The first worker's layout
        shapes the arena; FailedPrecondition for one whose layout differs."""
        if self.layout is None:
            self._open(layout)
        mismatch = layout_mismatch(self.layout, layout)
        if mismatch:
            self.counters.handshakes_refused += 1
            raise FailedPrecondition(f"KV layout mismatch with the kvstore's NIXL arena ({mismatch}): refused")
        if not self.endpoint.has_peer(agent_name):
            name = self.endpoint.add_peer(metadata, PoolRegion.from_pb(region))
            if name != agent_name:
                self.endpoint.forget_peer(name)
                raise InvalidArgument(f"agent metadata names {name!r}, the request {agent_name!r}")
            log.info("NIXL worker added", agent=agent_name)
        self.counters.handshakes += 1
        return self.endpoint.name

    def _open(self, layout: kv_pb2.KVLayout) -> None:
        dtype = parse_dtype(layout.dtype)
        planes = 1 if layout.layout == LATENT_KV_LAYOUT else 2  # MLA's latent, or K and V
        self._shape = (layout.num_layers, planes, layout.block_size, layout.num_kv_heads, layout.head_dim)
        block_nbytes = int(numpy.prod(self._shape)) * torch.empty(0, dtype=dtype).element_size()
        slots = max(1, self._budget_bytes // block_nbytes)
        tensor = host_zeros_on_huge_pages((layout.num_layers, planes, slots, *self._shape[2:]), dtype)
        self.endpoint = NixlEndpoint(self._nixl, tensor, "kvstore")
        self._pieces = tensor.view(torch.uint8).numpy().reshape(planes * layout.num_layers, slots, -1)
        self._dtype = layout.dtype
        self._free = list(range(slots))
        self.layout = layout
        log.info("kvstore NIXL arena registered", agent=self.endpoint.name, slots=slots, bytes=slots * block_nbytes)

    def _peer(self, agent_name: str) -> None:
        if self.endpoint is None or not self.endpoint.has_peer(agent_name):
            raise FailedPrecondition(f"NIXL agent {agent_name!r} is unknown here: NixlHandshake first")

    async def put(
        self, agent_name: str, hashes: list[BlockHash], block_ids: list[int], sums: list[bytes], timeout_s: float
    ) -> PutOutcome:
        """READ the worker's blocks, store each whose checksum matches (InvalidArgument after the
        rest are stored, when one did not)."""
        self._peer(agent_name)
        if not len(hashes) == len(block_ids) == len(sums):
            raise InvalidArgument("block_hashes, block_ids and checksums differ in length")
        deadline = asyncio.get_running_loop().time() + timeout_s
        stored = present = evicted = 0
        bad: list[BlockHash] = []
        for lo in range(0, len(hashes), self.capacity):
            hi = lo + self.capacity
            landed = await self._read(agent_name, block_ids[lo:hi], deadline)
            blocks = []
            for h, (data, digest), want in zip(hashes[lo:hi], landed, sums[lo:hi]):
                if digest != want:
                    bad.append(h)
                else:
                    blocks.append((h, Block(data, self._shape, self._dtype, digest)))
            results = await asyncio.to_thread(lambda b=blocks: [self._store.put(h, block) for h, block in b])
            stored += sum(r.stored for r in results)
            present += sum(not r.stored for r in results)
            evicted += sum(r.ram_evictions for r in results)
            self.counters.blocks_put += len(blocks)
        if bad:
            raise InvalidArgument(f"{len(bad)} blocks read over NIXL fail their checksum (first {bad[0].hex()})")
        return PutOutcome(stored, present, evicted)

    async def get(
        self, agent_name: str, hashes: list[BlockHash], block_ids: list[int], timeout_s: float
    ) -> list[bytes]:
        """WRITE the leading present blocks into the worker's ``block_ids``; their checksums."""
        self._peer(agent_name)
        if len(hashes) != len(block_ids):
            raise InvalidArgument("block_hashes and block_ids differ in length")
        deadline = asyncio.get_running_loop().time() + timeout_s
        found = await asyncio.to_thread(self._store.get, hashes)
        blocks: list[Block] = []
        for block in found:  # a prefix: the worker computes from the first miss on
            if block is None or block.shape != self._shape or block.dtype != self._dtype:
                break
            blocks.append(block)
        for lo in range(0, len(blocks), self.capacity):
            part = blocks[lo : lo + self.capacity]
            await self._write(agent_name, part, block_ids[lo : lo + len(part)], deadline)
            self.counters.blocks_got += len(part)
        return [b.checksum for b in blocks]

    async def _read(self, agent_name: str, block_ids: list[int], deadline: float) -> list[tuple[bytes, bytes]]:
        slots = await self._take(len(block_ids))
        read = BlockRead(self.endpoint, agent_name, block_ids, slots, self._copy_out)
        log.debug("NIXL READ of a put started", agent=agent_name, blocks=len(block_ids))
        done = False
        try:
            landed = await read.run(deadline - asyncio.get_running_loop().time())
            done = True
            return landed
        finally:
            self._give_back(slots, None if done else read.settle)

    async def _write(self, agent_name: str, blocks: list[Block], block_ids: list[int], deadline: float) -> None:
        slots = await self._take(len(blocks))
        write: NixlRead | None = None
        done = False
        try:
            await asyncio.to_thread(self._copy_in, slots, blocks)
            post = asyncio.ensure_future(asyncio.to_thread(self.endpoint.post, "WRITE", agent_name, block_ids, slots))
            write = await asyncio.shield(post)
            await write.wait(deadline - asyncio.get_running_loop().time())
            done = True
        finally:
            if write is None or done:
                self._give_back(slots, None)
            else:
                self._give_back(slots, write.settle)

    def _copy_out(self, slots: list[int]) -> list[tuple[bytes, bytes]]:
        """Each slot's block as bytes (in the wire format's piece order) with its checksum."""
        out = []
        for s in slots:
            data = self._pieces[:, s].tobytes()
            out.append((data, checksum(data)))
        return out

    def _copy_in(self, slots: list[int], blocks: list[Block]) -> None:
        for s, block in zip(slots, blocks):
            self._pieces[:, s] = numpy.frombuffer(block.data, dtype=numpy.uint8).reshape(self._pieces.shape[0], -1)

    async def _take(self, n: int) -> list[int]:
        async with self._slots_freed:
            await self._slots_freed.wait_for(lambda: len(self._free) >= n)
            self._free.sort()  # lowest first: a request's slots tend to be consecutive (fewer descriptors)
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def _give_back(self, slots: list[int], settle: Any | None) -> None:
        """Slots back to the free list, once no transfer can touch them any more (``settle``)."""

        async def back() -> None:
            if settle is not None:
                self.counters.transfer_failures += 1
                if not await settle(SETTLE_TIMEOUT_S):
                    log.error("an abandoned NIXL transfer never ended; its arena slots stay taken", slots=len(slots))
                    return
            async with self._slots_freed:
                self._free += slots
                self._slots_freed.notify_all()

        task = asyncio.ensure_future(back())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._pending, return_exceptions=True)
        if self.endpoint is not None:
            self.endpoint.close()
