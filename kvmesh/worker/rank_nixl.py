"""A worker's KV pool on NIXL rank by rank: every tensor-parallel rank its own agent over its own KV heads.

A tensor-parallel worker's pool is split by KV head (``TPLayout.kv_head_range``): rank r's pool holds its
heads of every block, under the block ids rank 0's block manager gives them. So every rank registers its
own pool with an agent of its own (``serve_rank``, the rank service each follower runs beside its steps,
``TensorParallelGroup.start_rank_service``), and a hand-off's blocks never gather in one process: each rank
of the reader READs exactly its heads from the ranks of the holder that hold them (``ShardedRead``), from
each holder rank it shares heads with (``HeadSpan``): whole blocks straight into the pool where both hold
the same heads, through a staging area where they do not (``kvmesh.worker.kv_staging``). A worker of one
rank is the case of one rank.

Every rank checksums its part of what landed, with every head it does not hold zeroed, and rank 0 combines
the owners' parts into each block's checksum (``kvmesh.engine.kv_checksum``), compared with the holder's
before the blocks are used: the one checksum a block has, whatever the degrees on either side. A rank
holding a copy of another's heads (more ranks than KV heads) must give its owner's part exactly.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

import structlog
import torch

from kvmesh.api.common.v1 import kv_pb2
from kvmesh.engine.kv_cache import KVCache
from kvmesh.engine.kv_checksum import combine_block_checksums, partial_block_checksums
from kvmesh.engine.sharded_kv import ShardedKVCache
from kvmesh.engine.tensor_parallel import RankLost
from kvmesh.errors import FailedPrecondition, InvalidArgument, KvmeshError, Unavailable
from kvmesh.worker.kv_nixl import BlockRead, NixlEndpoint, load_nixl
from kvmesh.worker.kv_staging import StagedRead, Staging
from kvmesh.worker.nixl_layout import HeadSpan, PoolRegion

log = structlog.get_logger(__name__)

# After a READ was abandoned, how long a rank waits for UCX to give up on it before it answers.
SETTLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RankPool:
    """One rank's agent and pool, as a peer reaches them: its pool holds KV heads ``first_head`` onwards."""

    agent_name: str
    metadata: bytes
    region: PoolRegion
    first_head: int

    @classmethod
    def from_pb(cls, pb: kv_pb2.NixlRank) -> RankPool:
        return cls(pb.agent_name, pb.agent_metadata, PoolRegion.from_pb(pb.region), pb.first_kv_head)

    def to_pb(self) -> kv_pb2.NixlRank:
        return kv_pb2.NixlRank(
            agent_name=self.agent_name,
            agent_metadata=self.metadata,
            region=self.region.to_pb(),
            first_kv_head=self.first_head,
        )


def head_spans(mine: tuple[int, int], theirs: list[RankPool]) -> list[tuple[RankPool, HeadSpan]]:
    """Where a rank holding heads ``mine`` (first, count) reads each of them: from the first of ``theirs``
    holding it. FailedPrecondition where none does (the peer's ranks do not hold every head)."""
    first, count = mine
    out, covered = [], first
    for pool in theirs:
        lo, hi = max(covered, pool.first_head), min(first + count, pool.first_head + pool.region.num_kv_heads)
        if lo == covered and lo < hi:
            out.append((pool, HeadSpan(lo - pool.first_head, lo - first, hi - lo)))
            covered = hi
    if covered != first + count:
        raise FailedPrecondition(f"the peer's ranks hold no copy of KV head {covered}")
    return out


class RankRead:
    """One rank's READs of a hand-off: its heads of blocks ``src`` (the same ids on every rank of the peer)
    into its blocks ``dst`` of ``pool``, from each peer rank ``spans`` names: straight into the pool where both
    hold the same heads, through ``staging`` where not; then its part of the checksums (``checksums``)."""

    def __init__(
        self,
        endpoint: NixlEndpoint,
        staging: Staging,
        spans: list[tuple[str, HeadSpan]],
        src: list[int],
        dst: list[int],
        checksums: Callable[[list[int]], list[int]],
    ) -> None:
        self._checksums, self._dst = checksums, dst
        self._direct: list[BlockRead] = []
        reads: list[BlockRead | StagedRead] = []
        # One READ straight into the pool: its chunks are checksummed as they land. Else after the last.
        self._sums_as_landed = len(spans) == 1
        on_landed = checksums if self._sums_as_landed else (lambda ids: [0] * len(ids))
        for agent, span in spans:
            holder = endpoint.peer_region(agent)
            if span.whole(holder, endpoint.region):
                self._direct.append(BlockRead(endpoint, agent, src, dst, on_landed))
                reads.append(self._direct[-1])
            else:
                self._sums_as_landed = False
                reads.append(StagedRead(staging, endpoint, agent, holder, src, dst, span, staging.pool))
        self._reads = reads
        self._tasks: list[asyncio.Future] = []

    async def run(self, timeout_s: float) -> list[int]:
        self._tasks = [asyncio.ensure_future(r.run(timeout_s)) for r in self._reads]
        results = await asyncio.gather(*map(asyncio.shield, self._tasks))
        if self._sums_as_landed:
            return results[0]
        return await asyncio.to_thread(self._checksums, self._dst)

    async def settle(self, timeout_s: float) -> bool:
        """True once no READ can land in this rank's blocks any more."""
        await asyncio.gather(*self._tasks, return_exceptions=True)  # each has a deadline
        settled = [await r.settle(timeout_s) for r in self._direct]  # a staged READ settled before it ended
        return all(settled)


def _pool_checksums(pool: torch.Tensor, first_head: int, total_heads: int) -> Callable[[list[int]], list[int]]:
    return lambda ids: partial_block_checksums(pool, ids, first_head, total_heads)


def serve_rank(side: Connection, pool: torch.Tensor, first_head: int, total_heads: int, settings: dict) -> RankPool:
    """A follower's rank service (``TensorParallelGroup.start_rank_service``): its pool registered with an agent
    of its own, then, on a thread, each call rank 0 makes on the side channel (``ShardedRead``)."""
    nixl = load_nixl()
    if nixl is None:
        raise RuntimeError("NIXL is not installed")
    endpoint = NixlEndpoint(nixl, pool, settings["role"], settings["progress_pause_us"])
    checksums = _pool_checksums(pool, first_head, total_heads)
    args = (side, endpoint, Staging(endpoint, pool), checksums)
    threading.Thread(target=_serve, args=args, name="rank-nixl", daemon=True).start()
    return RankPool(endpoint.name, endpoint.metadata(), endpoint.region, first_head)


def _serve(
    side: Connection, endpoint: NixlEndpoint, staging: Staging, checksums: Callable[[list[int]], list[int]]
) -> None:
    loop = asyncio.new_event_loop()  # every read runs on it: the staging area's lock belongs to it
    try:
        while True:
            try:
                kind, *args = pickle.loads(side.recv_bytes())
            except (EOFError, OSError):
                return
            if kind == "close":  # the worker went to gRPC (TensorParallelGroup.start_rank_service)
                side.send_bytes(pickle.dumps(("ok", None)))
                return
            try:
                if kind == "peer":
                    reply: Any = ("ok", endpoint.add_peer(*args))
                elif kind == "forget":
                    reply = ("ok", endpoint.forget_peer(*args))
                else:  # "read"
                    reply = loop.run_until_complete(_read(endpoint, staging, checksums, *args))
            except Exception as e:  # noqa: BLE001 - NIXL's own types too: the reason goes to rank 0
                reply = ("failed", f"{type(e).__name__}: {e}", True)
            side.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    finally:
        endpoint.close()
        loop.close()


async def _read(
    endpoint: NixlEndpoint,
    staging: Staging,
    checksums: Callable[[list[int]], list[int]],
    spans: list[tuple[str, HeadSpan]],
    src: list[int],
    dst: list[int],
    deadline: float,
) -> tuple:
    """One READ rank 0 asked for, by ``deadline`` (``time.monotonic()``: the ranks share a machine's clock,
    and a READ queued behind another's gets only what is left)."""
    read = RankRead(endpoint, staging, spans, src, dst, checksums)
    try:
        return ("ok", await read.run(deadline - time.monotonic()))
    except Exception as e:  # noqa: BLE001 - NIXL's own types too: the reason goes to rank 0
        return ("failed", f"{type(e).__name__}: {e}", await read.settle(SETTLE_TIMEOUT_S))


class RankEndpoints:
    """Every rank's NIXL endpoint of this worker, driven from rank 0: the pools a peer reads, and the READs of
    a peer's blocks into them (``ShardedRead``)."""

    def __init__(self, local: NixlEndpoint, kv: KVCache | ShardedKVCache, followers: list[RankPool]) -> None:
        self.local, self._followers = local, followers
        self.block_nbytes = kv.block_nbytes
        self._total_heads = kv.block_shape[3]
        if isinstance(kv, ShardedKVCache):
            self._group, self.head_ranges = kv.group, kv.head_ranges
            self._rank0_sums = _pool_checksums(kv.local.tensor, 0, self._total_heads)
        else:  # one rank: every head, its checksums the pool's own (no copy)
            self._group, self.head_ranges = None, [(0, self._total_heads)]
            self._rank0_sums = lambda ids: [int.from_bytes(s, "little") for s in kv.block_checksums(ids)]
        # Per rank, the first rank holding the same heads: its owner, whose part of a checksum counts.
        firsts = [first for first, _ in self.head_ranges]
        self._owner_of = [firsts.index(first) for first in firsts]
        self._staging = Staging(local, kv.tensor)
        # One call at a time on a follower's side channel: queued here, not in threads of the loop's pool.
        self._side_locks = [asyncio.Lock() for _ in self.head_ranges]
        # Per peer (by its rank 0's agent): the ranks of it we read from, and per rank of ours the agents it added.
        self._peers: dict[str, list[RankPool]] = {}
        self._added: dict[str, list[list[str]]] = {}

    @classmethod
    def open(
        cls, local: NixlEndpoint, kv: KVCache | ShardedKVCache, role: str, progress_pause_us: int
    ) -> RankEndpoints:
        """``local`` (rank 0's) with, on a tensor-parallel worker, every follower's endpoint started (blocking)."""
        followers: list[RankPool] = []
        if isinstance(kv, ShardedKVCache):
            settings = {"role": role, "progress_pause_us": progress_pause_us}
            followers = kv.group.start_rank_service(__name__, settings)
        return cls(local, kv, followers)

    @property
    def name(self) -> str:
        return self.local.name

    @property
    def sharded(self) -> bool:
        return self._group is not None

    def pools(self) -> list[RankPool]:
        """Every rank's pool, rank 0's first."""
        return [RankPool(self.local.name, self.local.metadata(), self.local.region, 0), *self._followers]

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    async def add_peer(self, peer: list[RankPool]) -> str:
        """A peer's ranks (its rank 0 first) known to each of our ranks that reads from them (and rank 0's
        agent to ours, which notifies it); returns its rank 0's agent name."""
        owners, name = first_holders(peer), peer[0].agent_name
        added: list[list[str]] = []
        self._added[name] = added  # so that forget_peer undoes a partial add
        try:
            for rank, heads in enumerate(self.head_ranges):
                needed = [pool for pool, _ in head_spans(heads, owners)]
                if rank == 0 and peer[0] not in needed:
                    needed.append(peer[0])
                added.append([])
                for pool in needed:
                    if rank == 0:
                        added[-1].append(self.local.add_peer(pool.metadata, pool.region))
                    else:
                        added[-1].append(await self._call(rank, "peer", pool.metadata, pool.region))
        except BaseException:
            await self.forget_peer(name)
            raise
        self._peers[name] = owners
        return name

    async def forget_peer(self, agent_name: str) -> None:
        """Every rank forgets the peer's agents, as far as it can (a rank that cannot is logged)."""
        self._peers.pop(agent_name, None)
        for rank, names in enumerate(self._added.pop(agent_name, [])):
            for name in names:
                try:
                    if rank == 0:
                        self.local.forget_peer(name)
                    else:
                        await self._call(rank, "forget", name)
                except Exception as e:  # noqa: BLE001 - NIXL's own types too: the others are still forgotten
                    log.warning("a rank could not forget a NIXL peer", rank=rank, agent=name, error=str(e))

    def peer_region(self, agent_name: str) -> PoolRegion:
        return self.local.peer_region(agent_name)

    def notify(self, agent_name: str, message: bytes) -> None:
        self.local.notify(agent_name, message)

    def notifications(self) -> list[bytes]:
        """What peers' finished READs sent rank 0's agent (they notify the agent their leases name)."""
        return self.local.notifications()

    def read(self, agent_name: str, src: list[int], dst: list[int], timeout_s: float) -> ShardedRead:
        """The READs of blocks ``src`` of peer ``agent_name`` (its rank 0's agent) into our blocks ``dst``, each
        rank's within ``timeout_s``. Unavailable where the peer was forgotten meanwhile (it restarted)."""
        holders = self._peers.get(agent_name)
        if holders is None:
            raise Unavailable(f"NIXL peer {agent_name} was forgotten before its READ (it restarted)")
        plans = [head_spans(heads, holders) for heads in self.head_ranges]
        spans = [[(pool.agent_name, span) for pool, span in plan] for plan in plans]
        local = RankRead(self.local, self._staging, spans[0], src, dst, self._rank0_sums)
        deadline = time.monotonic() + timeout_s
        followers = [
            partial(self._side_async, rank, ("read", spans[rank], src, dst, deadline)) for rank in self._ranks()
        ]
        # The bytes that cross: every READ moves whole blocks of the holder rank's pool (staged or not).
        heads = sum(pool.region.num_kv_heads for plan in plans for pool, _ in plan)
        nbytes = len(dst) * self.block_nbytes // self._total_heads * heads
        return ShardedRead(local, followers, self._owner_of, self.block_nbytes, nbytes, timeout_s)

    def _ranks(self) -> range:
        return range(1, len(self.head_ranges))

    def _side(self, rank: int, message: tuple) -> tuple:
        """A follower's answer: ``("ok", result)`` or ``("failed", reason, settled)``. Blocking."""
        try:
            return self._group.side_call(rank, message)
        except RankLost as e:  # gone: so is anything it had posted
            return ("failed", str(e), True)

    async def _side_async(self, rank: int, message: tuple) -> tuple:
        async with self._side_locks[rank]:
            return await asyncio.to_thread(self._side, rank, message)

    async def _call(self, rank: int, *message: object) -> Any:
        status, *rest = await self._side_async(rank, message)
        if status != "ok":
            raise Unavailable(f"tensor-parallel rank {rank}'s NIXL agent: {rest[0]}")
        return rest[0]

    def close(self) -> None:
        """Rank 0's endpoint; each follower's closes when its side channel does (the group's close)."""
        self.local.close()


def first_holders(peer: list[RankPool]) -> list[RankPool]:
    """The peer's ranks that hold each head first (where ranks replicate heads, the first of each)."""
    out: list[RankPool] = []
    for pool in peer:
        if not out or pool.first_head != out[-1].first_head:
            out.append(pool)
    return out


class ShardedRead:
    """One hand-off's READs, every rank of ours at once: rank 0's here (``local``), each follower's on its rank
    service (``followers``: coroutines of their answers); each block's checksum combined from the parts of the
    ranks that own their heads (``owner_of[r] == r``), every other rank's part equal to its owner's."""

    def __init__(
        self,
        local: RankRead,
        followers: list[Callable[[], Awaitable[tuple]]],
        owner_of: list[int],
        block_nbytes: int,
        nbytes: int,
        timeout_s: float,
    ) -> None:
        self._local, self._follower_calls, self._owner_of = local, followers, owner_of
        self._block_nbytes, self.nbytes, self._timeout_s = block_nbytes, nbytes, timeout_s
        # Each future of its own, so a cancelled run still finds (and settles) what was posted.
        self._local_run: asyncio.Future | None = None
        self._followers: list[asyncio.Future] = []

    async def run(self) -> list[bytes]:
        """Every block's checksum of what landed. Unavailable (or rank 0's DeadlineExceeded) where a rank's READ
        failed; InvalidArgument where a rank's copy of replicated heads differs from its owner's."""
        self._local_run = asyncio.ensure_future(self._local.run(self._timeout_s))
        self._followers = [asyncio.ensure_future(call()) for call in self._follower_calls]
        try:
            results = await asyncio.gather(asyncio.shield(self._local_run), *map(asyncio.shield, self._followers))
        except KvmeshError:
            raise
        except Exception as e:  # NIXL's or torch's own (a staging area that could not be registered)
            raise Unavailable(f"NIXL READ failed: {type(e).__name__}: {e}") from None
        parts = [results[0]]
        for rank, (status, *rest) in enumerate(results[1:], start=1):
            if status != "ok":
                raise Unavailable(f"tensor-parallel rank {rank}'s NIXL READ failed: {rest[0]}")
            parts.append(rest[0])
        copies = [r for r, owner in enumerate(self._owner_of) if owner != r and parts[r] != parts[owner]]
        if copies:
            raise InvalidArgument(f"rank {copies[0]}'s copy of replicated KV heads read over NIXL fails its checksum")
        owned = [part for r, part in enumerate(parts) if self._owner_of[r] == r]
        return combine_block_checksums(owned, self._block_nbytes)

    async def settle(self, timeout_s: float) -> bool:
        """True once no rank's READ can land any more."""
        if self._local_run is not None:
            await asyncio.gather(self._local_run, return_exceptions=True)  # it has a deadline
        settled = await self._local.settle(timeout_s)
        for future in self._followers:
            try:
                status, *rest = await future  # a follower answers once its READ settled, or gave up on it
            except Exception:  # noqa: BLE001 - the call itself failed: the rank is gone, and what it posted
                continue
            settled = settled and (status == "ok" or rest[1])
        return settled
