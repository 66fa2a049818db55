"""Decode's ``KVSource`` over NIXL: one READ straight into the paged pool, gRPC for control only.

Per prefill peer, once: ``NixlHandshake`` over gRPC brings its agent metadata
and pool region, every rank's where it is tensor-parallel (a peer whose KV
layout differs is refused there, before any byte moves). Per hand-off:
destination blocks are reserved in this worker's pool, a ``ShardedRead``
fetches every missing block, each of our ranks its KV heads from the peer's
ranks that hold them (``kvmesh.worker.rank_nixl``; in a few chunks, each
checksummed on a worker thread as it lands), a one-way NIXL notification naming
the lease tells the prefill worker to release it at once, the checksums are
compared with the prefill worker's, and the blocks are adopted as cached
blocks. A READ that fails or outlives its deadline is a failed transfer like
any other: the lease is aborted over gRPC and the request recomputes. A hand-off without NIXL
descriptors (its prefill worker runs on gRPC) goes through the gRPC stream.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import structlog

from kvmesh.api.common.v1 import kv_pb2
from kvmesh.api.prefill.v1 import prefill_pb2
from kvmesh.blocks import BlockHash
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.errors import FailedPrecondition, InvalidArgument, InvalidField, Unavailable
from kvmesh.runtime.client_errors import from_rpc_error
from kvmesh.worker.kv_transport import read_timeout_s
from kvmesh.worker.nixl_layout import PoolRegion, layout_mismatch
from kvmesh.worker.rank_nixl import RankEndpoints, RankPool, ShardedRead
from services.decode.core import RemotePrefill, Tally, report_wire
from services.decode.prefill_client import GrpcKVSource

log = structlog.get_logger(__name__)

# After a READ was abandoned (deadline, cancellation), how long to wait for UCX to give up
# on it before its destination blocks may be reused; past this they are never reused.
SETTLE_TIMEOUT_S = 60.0
HANDSHAKE_TIMEOUT_S = 5.0


class NixlKVSource:
    def __init__(
        self, endpoints: RankEndpoints, layout: kv_pb2.KVLayout, grpc_source: GrpcKVSource, read_floor_s: float
    ) -> None:
        self._endpoints = endpoints
        self._layout = layout
        self._grpc = grpc_source
        self._read_floor_s = read_floor_s
        self._peer_at: dict[str, str] = {}  # prefill address -> its agent's name
        self._handshakes: dict[str, asyncio.Task] = {}  # agent name -> its handshake, once
        self._notified: set[str] = set()  # leases whose READ's notification released them
        self._settling: set[asyncio.Task] = set()

    async def fetch(self, engine: AsyncEngine, remote: RemotePrefill, missing: list[BlockHash], tally: Tally) -> None:
        if remote.nixl is None:  # its prefill worker is on gRPC
            await self._grpc.fetch(engine, remote, missing, tally)
            return
        agent = await self._peer(remote.address, remote.nixl.agent_name)
        position = {h: i for i, h in enumerate(remote.block_hashes)}
        if len(remote.nixl.block_ids) != len(position) or len(remote.nixl.checksums) != len(position):
            raise InvalidArgument("the hand-off's NIXL descriptors do not match its block hashes")
        # In the holder's pool order, into our reserved blocks in ascending order: runs of blocks
        # consecutive on both sides then go as one descriptor per plane (kv_nixl.block_runs).
        try:
            self._endpoints.peer_region(agent).check_blocks(remote.nixl.block_ids, "the prefill worker's")
        except InvalidArgument as e:  # the request's own descriptors: its caller's error, not a transfer's
            raise InvalidField("remote.handoff.nixl.block_ids", e.message) from None
        missing = sorted(missing, key=lambda h: remote.nixl.block_ids[position[h]])
        src = [remote.nixl.block_ids[position[h]] for h in missing]
        sums = [remote.nixl.checksums[position[h]] for h in missing]
        t_reserve = time.perf_counter()
        dst = sorted(await engine.call(lambda e: e.reserve_blocks(len(missing))))
        timeout_s = read_timeout_s(self._read_floor_s, engine.kv.block_nbytes * len(dst))
        read: ShardedRead | None = None
        adopted = False
        try:
            read = self._endpoints.read(agent, src, dst, timeout_s)
            t0 = time.perf_counter()
            log.debug("NIXL READ posted", lease_id=remote.lease_id, blocks=len(dst), bytes=read.nbytes)
            got = await read.run()
            t1 = time.perf_counter()
            report_wire("nixl", len(dst), read.nbytes, round(1e9 * (t1 - t0)))
            # Every byte is here: the holder may release the lease at once (one-way, no round trip).
            self._endpoints.notify(agent, remote.lease_id.encode())
            self._notified.add(remote.lease_id)
            tally(len(dst), read.nbytes)
            bad = [h for h, a, b in zip(missing, got, sums) if a != b]
            if bad:
                raise InvalidArgument(f"{len(bad)} KV blocks read over NIXL fail their checksum (first {bad[0].hex()})")
            await engine.call(lambda e: e.adopt_reserved(list(zip(missing, dst))))
            adopted = True
            log.debug(
                "NIXL READ adopted",
                lease_id=remote.lease_id,
                reserve_ms=round(1e3 * (t0 - t_reserve), 2),
                read_and_verify_ms=round(1e3 * (t1 - t0), 2),
                adopt_ms=round(1e3 * (time.perf_counter() - t1), 2),
            )
        finally:
            if not adopted:
                self._free_when_settled(engine, read, dst)

    async def release(self, address: str, lease_id: str, ack: bool) -> None:
        if lease_id in self._notified:
            self._notified.discard(lease_id)
            if ack:
                return  # the READ's notification released it
        await self._grpc.release(address, lease_id, ack)

    async def close(self) -> None:
        for task in [*self._handshakes.values(), *self._settling]:
            task.cancel()
        await asyncio.gather(*self._handshakes.values(), *self._settling, return_exceptions=True)
        self._endpoints.close()

    async def _peer(self, address: str, agent_name: str) -> str:
        """The peer's agent, known to ours: handshaken once per agent (a restarted worker at the
        same address is a new agent)."""
        if self._endpoints.has_peer(agent_name):
            return agent_name
        task = self._handshakes.get(agent_name)
        if task is None or (task.done() and task.exception() is not None):
            task = asyncio.ensure_future(self._handshake(address, agent_name))
            self._handshakes[agent_name] = task
        return await asyncio.shield(task)

    async def _handshake(self, address: str, agent_name: str) -> str:
        request = prefill_pb2.NixlHandshakeRequest(layout=self._layout, agent_name=self._endpoints.name)
        try:
            resp = await self._grpc.stub(address).NixlHandshake(request, timeout=HANDSHAKE_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"prefill worker {address}") from None
        mismatch = layout_mismatch(self._layout, resp.layout)
        if mismatch:
            raise FailedPrecondition(f"prefill worker {address} has another KV layout ({mismatch}): refused")
        if resp.agent_name != agent_name:
            raise Unavailable(f"prefill worker {address} restarted since the hand-off (agent {resp.agent_name})")
        ranks = [RankPool.from_pb(r) for r in resp.ranks]
        if not ranks:  # one rank: every head (a worker from before tensor-parallel NIXL does not say so)
            region = replace(PoolRegion.from_pb(resp.region), num_kv_heads=resp.layout.num_kv_heads)
            ranks = [RankPool(resp.agent_name, resp.agent_metadata, region, 0)]
        name = await self._endpoints.add_peer(ranks)
        old = self._peer_at.get(address)
        if old is not None and old != name:
            await self._endpoints.forget_peer(old)
            self._handshakes.pop(old, None)
        self._peer_at[address] = name
        log.info("NIXL peer added", address=address, agent=name)
        return name

    def _free_when_settled(self, engine: AsyncEngine, read: ShardedRead | None, blocks: list[int]) -> None:
        """Hand reserved blocks back once no READ can write into them any more (``read``: None where none
        was posted)."""

        async def settle_then_free() -> None:
            if read is not None and not await read.settle(SETTLE_TIMEOUT_S):
                log.error("an abandoned NIXL READ never ended; its blocks stay reserved", blocks=len(blocks))
                return
            await engine.call(lambda e: e.release_reserved(blocks))

        task = asyncio.ensure_future(settle_then_free())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
