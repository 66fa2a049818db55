"""KV heads read through a staging area: where a holder's pool and ours do not hold the same KV heads.

A tensor-parallel rank's pool holds some of the KV heads (``kvmesh.worker.rank_nixl``). When a reader's rank
and a holder's rank hold the same heads, a READ is whole blocks, a few large descriptors a run. When they do
not (TP2 to TP1, TP1 to TP2), a head is ``block_size`` pieces of every (layer, k/v) plane of a block, and
naming each piece costs a descriptor: a 4,000-token hand-off took 20 to 30 times longer that way here than
whole blocks (docs/tensor_parallel.md). So the holder rank's blocks are read whole, in runs, into a staging
area of this rank (registered once, shaped like a pool of the holder's heads), and the heads wanted are
copied from there into the pool: round by round, as many blocks a round as the area holds.
"""

from __future__ import annotations

import asyncio

import structlog
import torch

from kvmesh.errors import DeadlineExceeded
from kvmesh.worker.kv_nixl import NixlEndpoint, NixlRead
from kvmesh.worker.nixl_layout import HeadSpan, PoolRegion

log = structlog.get_logger(__name__)

# A staging area's size: a hand-off larger than this goes in rounds.
STAGING_BYTES = 32 << 20
# After a failed round, how long to wait for UCX to give up on its READ before the area may be reused;
# past this the area is dropped (a new one is registered for the next READ).
SETTLE_TIMEOUT_S = 60.0


class Staging:
    """A rank's staging areas, one a holder head count, registered with its endpoint on first use and reused;
    one READ at a time in them (``lock``: every read of this rank runs on one event loop)."""

    def __init__(self, endpoint: NixlEndpoint, pool: torch.Tensor) -> None:
        self._endpoint, self.pool = endpoint, pool
        self._areas: dict[int, tuple[torch.Tensor, PoolRegion]] = {}
        self.lock = asyncio.Lock()

    def area(self, heads: int) -> tuple[torch.Tensor, PoolRegion]:
        """The area for blocks of a pool of ``heads`` KV heads (this pool's other dimensions)."""
        if heads not in self._areas:
            layers, kv, _, block_size, _, head_dim = self.pool.shape
            block_nbytes = layers * kv * block_size * heads * head_dim * self.pool.element_size()
            blocks = max(1, STAGING_BYTES // block_nbytes)
            shape = (layers, kv, blocks, block_size, heads, head_dim)
            tensor = torch.empty(shape, dtype=self.pool.dtype, device=self.pool.device)
            self._areas[heads] = (tensor, self._endpoint.register_staging(tensor))
        return self._areas[heads]

    def drop(self, heads: int) -> None:
        """Never reuse this area: a READ into it may still land (it stays registered, and alive)."""
        self._areas.pop(heads, None)


class StagedRead:
    """Heads ``span`` of blocks ``src`` of a holder rank (agent ``agent_name``, pool ``holder``) into this rank's
    blocks ``dst``, through ``staging``. ``run`` returns once every head landed and was copied in place, or
    raises once nothing it started can write anywhere any more: NIXL writes only the staging area, and a copy
    into the pool is waited for."""

    def __init__(
        self,
        staging: Staging,
        endpoint: NixlEndpoint,
        agent_name: str,
        holder: PoolRegion,
        src: list[int],
        dst: list[int],
        span: HeadSpan,
        pool: torch.Tensor,
    ) -> None:
        self._staging, self._endpoint, self._agent_name, self._holder = staging, endpoint, agent_name, holder
        self._src, self._dst, self._span, self._pool = src, dst, span, pool

    async def run(self, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with self._staging.lock:
            # Allocated and registered once, off the event loop.
            area, region = await asyncio.to_thread(self._staging.area, self._holder.num_kv_heads)
            read: NixlRead | None = None
            copy: asyncio.Future | None = None
            try:
                for lo in range(0, len(self._dst), region.num_blocks):
                    if loop.time() >= deadline:  # queued behind another READ: post nothing that cannot land
                        raise DeadlineExceeded(f"staged NIXL READ past its {timeout_s:.1f} s")
                    src, dst = self._src[lo : lo + region.num_blocks], self._dst[lo : lo + region.num_blocks]
                    into = list(range(len(src)))
                    read = await asyncio.to_thread(self._endpoint.post, "READ", self._agent_name, src, into, region)
                    await read.wait(deadline - loop.time())
                    read = None
                    copy = asyncio.ensure_future(asyncio.to_thread(self._copy, area, dst))
                    await asyncio.shield(copy)
                    copy = None
            except BaseException:
                # Nothing may land in the area, nor be copied into the pool, once this returns.
                if copy is not None:
                    await asyncio.gather(copy, return_exceptions=True)
                if read is not None and not await read.settle(SETTLE_TIMEOUT_S):
                    log.error("an abandoned staged NIXL READ never ended; its staging area is dropped")
                    self._staging.drop(self._holder.num_kv_heads)
                raise

    def _copy(self, area: torch.Tensor, dst: list[int]) -> None:
        span = self._span
        heads = area[:, :, : len(dst), :, span.remote_first : span.remote_first + span.count]
        index = torch.tensor(dst, device=self._pool.device)
        self._pool[:, :, index, :, span.local_first : span.local_first + span.count] = heads
        if self._pool.device.type == "cuda":  # done before the area takes the next READ (NIXL is not on a stream)
            torch.cuda.current_stream(self._pool.device).synchronize()
