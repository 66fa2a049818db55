"""A worker's kvstore traffic on NIXL: the kvstore moves the bytes in and out of this pool itself.

Once per kvstore (and again after it restarts): ``NixlHandshake`` hands it this
worker's agent metadata and pool region; a kvstore whose arena has another KV
layout refuses there, and a kvstore without NIXL says so: either way this
worker's kvstore traffic stays on the gRPC streams (``KVStoreClient``). Then:

- get: reserve destination blocks, ``GetNixl`` names them; the kvstore WRITEs
  the leading blocks it holds into them before it answers, with their
  checksums; each is verified here before the blocks are adopted as cached.
- put: the blocks stay pinned while ``PutNixl`` runs; the kvstore READs them,
  verifies them against the checksums sent, and stores them.

Every call has a deadline. A get whose answer never came (deadline, cancelled)
keeps its blocks reserved a while longer, as the kvstore may still be writing
into them until its own (shorter) deadline; a kvstore that died cannot.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog

from kvmesh.api.common.v1 import kv_pb2
from kvmesh.api.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from kvmesh.blocks import BlockHash
from kvmesh.checksum import CHECKSUM_BYTES
from kvmesh.engine.async_engine import AsyncEngine
from kvmesh.errors import InvalidArgument
from kvmesh.runtime.client_errors import from_rpc_error
from kvmesh.worker.kv_nixl import NixlEndpoint, block_checksums
from kvmesh.worker.nixl_layout import layout_mismatch

log = structlog.get_logger(__name__)

# After a refusal (another layout, no NIXL there), how long before asking again: a kvstore
# restarted with other settings is found without restarting this worker.
RETRY_HANDSHAKE_S = 30.0
# Codes that mean "this kvstore will not move bytes over NIXL with us" (not "it is down").
_REFUSALS = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE)


class KVStoreNixl:
    def __init__(
        self,
        endpoint: NixlEndpoint,
        layout: kv_pb2.KVLayout,
        stub: kvstore_pb2_grpc.KVStoreServiceStub,
        address: str,
        timeout_s: float,
    ) -> None:
        self._endpoint = endpoint
        self._layout = layout
        self._stub = stub
        self._address = address
        self._timeout_s = timeout_s
        self._agent: str | None = None  # the kvstore's agent, once handshaken
        self._refused_until = 0.0
        self._handshake: asyncio.Task | None = None
        self._pending: set[asyncio.Task] = set()  # delayed releases of reserved blocks

    async def ready(self) -> bool:
        """Whether this kvstore takes NIXL transfers from us (handshaking first when needed)."""
        if self._agent is not None:
            return True
        if time.monotonic() < self._refused_until:
            return False
        if self._handshake is None or self._handshake.done():
            self._handshake = asyncio.ensure_future(self._shake())
        return await asyncio.shield(self._handshake)

    def forget(self) -> None:
        """The kvstore no longer knows us (it restarted): handshake again on the next call."""
        self._agent = None

    async def _shake(self) -> bool:
        request = kvstore_pb2.NixlHandshakeRequest(
            layout=self._layout,
            agent_name=self._endpoint.name,
            agent_metadata=self._endpoint.metadata(),
            region=self._endpoint.region.to_pb(),
        )
        try:
            resp = await self._stub.NixlHandshake(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() in _REFUSALS:
                self._refused_until = time.monotonic() + RETRY_HANDSHAKE_S
                log.warning(
                    "kvstore refused NIXL; its blocks move over gRPC",
                    address=self._address,
                    code=e.code().name,
                    error=e.details(),
                )
            return False
        mismatch = layout_mismatch(self._layout, resp.layout)
        if mismatch:  # the kvstore checks this first; a guard against a peer that does not
            self._refused_until = time.monotonic() + RETRY_HANDSHAKE_S
            log.warning("kvstore's NIXL arena has another KV layout; its blocks move over gRPC", mismatch=mismatch)
            return False
        self._agent = resp.agent_name
        log.info("kvstore on NIXL", address=self._address, agent=resp.agent_name)
        return True

    async def fetch(self, engine: AsyncEngine, hashes: list[BlockHash]) -> int:
        """Bring the leading ``hashes`` the kvstore holds into the engine's cache; how many came.
        Raises KvmeshError when the transfer failed (nothing was imported then)."""
        dst = sorted(await engine.call(lambda e: e.reserve_blocks(len(hashes))))
        timeout = self._timeout_s * 10  # a bulk transfer, as the gRPC stream's deadline
        found = 0
        answered = False
        try:
            try:
                resp = await self._stub.GetNixl(
                    kvstore_pb2.GetNixlRequest(agent_name=self._endpoint.name, block_hashes=hashes, block_ids=dst),
                    timeout=timeout,
                )
            except grpc.aio.AioRpcError as e:
                # A kvstore that answered (any code but these) or died wrote nothing more.
                answered = e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.forget()
                raise from_rpc_error(e, f"kvstore {self._address}", timeout) from None
            answered = True
            found = resp.found_blocks
            if found > len(dst) or len(resp.checksums) != found * CHECKSUM_BYTES:
                raise InvalidArgument("the kvstore's GetNixl answer does not match its request")
            n = CHECKSUM_BYTES
            want = [resp.checksums[i * n : (i + 1) * n] for i in range(found)]
            got = await block_checksums(engine.kv, dst[:found])
            bad = [h for h, a, b in zip(hashes, got, want) if a != b]
            if bad:
                raise InvalidArgument(
                    f"{len(bad)} blocks written by the kvstore fail their checksum (first {bad[0].hex()})"
                )
            pairs = list(zip(hashes[:found], dst[:found]))
            await engine.call(lambda e: e.adopt_reserved(pairs))
            await engine.call(lambda e: e.release_reserved(dst[found:]))
            dst = []
            return found
        finally:
            if dst:
                self._release_later(engine, dst, 0.0 if answered else timeout)

    async def put(self, engine: AsyncEngine, pinned: list[tuple[BlockHash, int]]) -> None:
        """Have the kvstore READ and store pinned blocks; unpins them in every case."""
        ids = [b for _, b in pinned]
        try:
            sums = await block_checksums(engine.kv, ids)
            request = kvstore_pb2.PutNixlRequest(
                agent_name=self._endpoint.name,
                block_hashes=[h for h, _ in pinned],
                block_ids=ids,
                checksums=b"".join(sums),
            )
            log.debug("PutNixl sent", blocks=len(ids))
            try:
                await self._stub.PutNixl(request, timeout=self._timeout_s * 10)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    self.forget()
                raise from_rpc_error(e, f"kvstore {self._address}", self._timeout_s * 10) from None
        finally:
            # Safe even if the kvstore still reads: a block rewritten meanwhile fails its checksum there.
            await asyncio.shield(engine.call(lambda e: e.release_reserved(ids)))

    def _release_later(self, engine: AsyncEngine, blocks: list[int], after_s: float) -> None:
        async def release() -> None:
            await asyncio.sleep(after_s)
            try:
                await engine.call(lambda e: e.release_reserved(blocks))
            except Exception as e:  # noqa: BLE001 - the engine stopped: it holds nothing any more
                log.warning("releasing reserved blocks failed", error=str(e))

        task = asyncio.ensure_future(release())
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def close(self) -> None:
        for task in self._pending:
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
