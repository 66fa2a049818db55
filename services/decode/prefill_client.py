"""Pulling a lease's KV blocks from a prefill worker over gRPC (decode's ``KVSource``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.blocks import BlockHash
from kvmesh.kv_wire import BlockAssembler, ReceivedBlock, keep_transfer_memory_mapped
from kvmesh.runtime import create_channel
from kvmesh.runtime.client_errors import from_rpc_error
from services.decode.core import StreamedKVSource


class GrpcKVSource(StreamedKVSource):
    def __init__(self, release_timeout_s: float = 5.0, pull_timeout_s: float = 60.0) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._release_timeout_s = release_timeout_s
        # A prefill worker that hangs mid-transfer fails the pull at this deadline (decode then
        # computes what did not arrive) rather than holding the request forever.
        self._pull_timeout_s = pull_timeout_s
        keep_transfer_memory_mapped()  # process-wide malloc setting: PullKV streams need it (kv_wire)

    def stub(self, address: str) -> prefill_pb2_grpc.PrefillServiceStub:
        if address not in self._channels:
            self._channels[address] = create_channel(address, peer="prefill")
        return prefill_pb2_grpc.PrefillServiceStub(self._channels[address])

    async def pull(self, address: str, lease_id: str, hashes: list[BlockHash]) -> AsyncIterator[ReceivedBlock]:
        """The blocks as they arrive whole; their checksums are the caller's to verify."""
        call = self.stub(address).PullKV(
            prefill_pb2.PullKVRequest(lease_id=lease_id, block_hashes=hashes), timeout=self._pull_timeout_s
        )
        assembler = BlockAssembler()
        try:
            async for msg in call:
                block = assembler.add_unverified(msg.chunk)
                if block is not None:
                    yield block
            assembler.close()
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"prefill worker {address}", self._pull_timeout_s) from None
        finally:
            call.cancel()

    async def release(self, address: str, lease_id: str, ack: bool) -> None:
        outcome = prefill_pb2.LEASE_OUTCOME_ACK if ack else prefill_pb2.LEASE_OUTCOME_ABORT
        try:
            await self.stub(address).ReleaseLease(
                prefill_pb2.ReleaseLeaseRequest(lease_id=lease_id, outcome=outcome), timeout=self._release_timeout_s
            )
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, f"prefill worker {address}") from None

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
