"""gRPC face of the prefill worker: protobuf <-> PrefillWorker calls."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvmesh.api.common.v1 import kv_pb2
from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.convert import finish_to_pb, logprob_to_pb, timings_pb
from kvmesh.errors import FailedPrecondition, InvalidField, Unavailable
from kvmesh.kv_wire import chunk_fields, keep_transfer_memory_mapped
from kvmesh.sampling import SamplingParams, admitted
from kvmesh.worker.nixl_layout import layout_mismatch
from services.prefill.core import PrefillWorker


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, address: str) -> None:
        self.address = address  # where decode workers reach this worker's PullKV
        self._releases: set[asyncio.Task] = set()  # lease aborts for answers nobody received
        keep_transfer_memory_mapped()  # process-wide malloc setting: PullKV streams need it (kv_wire)
        self.worker: PrefillWorker
        self.max_model_len: int
        self.vocab_size: int

    def attach(self, worker: PrefillWorker, max_model_len: int, vocab_size: int) -> None:
        """Called once the model is loaded; health stays NOT_SERVING (no RPCs arrive) until then."""
        self.worker = worker
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:  # its hold on the prompt's blocks and its lease are keyed by it
            raise InvalidField("request_id", "request_id is empty: a request must be named")
        mode = request.handoff_mode or kv_pb2.HANDOFF_MODE_PULL
        if mode == kv_pb2.HANDOFF_MODE_KVSTORE:
            raise FailedPrecondition("this prefill worker hands KV off by PULL only")
        prompt = list(request.token_ids)
        params = admitted(SamplingParams.from_pb(request.sampling), prompt, self.vocab_size, self.max_model_len)
        res = await self.worker.prefill(
            request.request_id,
            prompt,
            params,
            request.cache_salt,
            hand_off=mode == kv_pb2.HANDOFF_MODE_PULL,
            lease_ttl_ms=request.lease_ttl_ms,
            adapter=request.adapter or None,
        )
        handoff = kv_pb2.KVHandoff(mode=kv_pb2.HANDOFF_MODE_NONE)
        if res.lease is not None:
            self._release_if_undelivered(context, res.lease.lease_id)
            handoff = kv_pb2.KVHandoff(
                mode=kv_pb2.HANDOFF_MODE_PULL,
                source_address=self.address,
                lease_id=res.lease.lease_id,
                lease_ttl_ms=res.lease.ttl_ms,
                block_hashes=res.block_hashes,
                nixl=res.nixl.to_pb() if res.nixl is not None else None,
            )
        return prefill_pb2.PrefillResponse(
            first_token_id=res.first_token,
            first_token_logprob=logprob_to_pb(res.first_logprob) if res.first_logprob else None,
            finish_reason=finish_to_pb(res.finish_reason),
            handoff=handoff,
            computed_tokens=res.computed_tokens,
            reused_tokens=res.reused_tokens,
            timings=timings_pb(
                queue_ns=res.queue_ns, compute_ns=res.compute_ns, transfer_ns=res.transfer_ns, total_ns=res.total_ns
            ),
        )

    async def PullKV(
        self, request: prefill_pb2.PullKVRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[prefill_pb2.PullKVResponse]:
        async for b in self.worker.pull(request.lease_id, list(request.block_hashes)):
            for fields in chunk_fields(b.block_hash, b.payload, request.max_chunk_bytes, b.checksum):
                yield prefill_pb2.PullKVResponse(chunk=fields)

    def _release_if_undelivered(self, context: grpc.aio.ServicerContext, lease_id: str) -> None:
        """A caller that went away before our answer arrived never learns the lease id, so it
        cannot abort it: end the lease here at once instead of leaving it to its TTL."""
        loop = asyncio.get_running_loop()

        def on_done(ctx: grpc.aio.ServicerContext) -> None:
            if ctx.cancelled():
                task = loop.create_task(self.worker.release(lease_id, ack=False))
                self._releases.add(task)
                task.add_done_callback(self._releases.discard)

        context.add_done_callback(on_done)

    async def NixlHandshake(self, request: prefill_pb2.NixlHandshakeRequest, context: grpc.aio.ServicerContext):
        nixl = self.worker.nixl
        if nixl is None:
            raise Unavailable("this prefill worker moves KV over gRPC only (--kv-transport grpc, or NIXL did not load)")
        mine = kv_pb2.KVLayout(**self.worker.engine.kv_layout())
        mismatch = layout_mismatch(mine, request.layout)
        if mismatch:
            raise FailedPrecondition(f"KV layout mismatch with peer {request.agent_name or '?'}: {mismatch}")
        rank0, *followers = nixl.pools()
        return prefill_pb2.NixlHandshakeResponse(
            agent_name=rank0.agent_name,
            agent_metadata=rank0.metadata,
            layout=mine,
            region=rank0.region.to_pb(),
            ranks=[pool.to_pb() for pool in (rank0, *followers)] if followers else [],
        )

    async def ReleaseLease(self, request: prefill_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext):
        n = await self.worker.release(request.lease_id, ack=request.outcome == prefill_pb2.LEASE_OUTCOME_ACK)
        return prefill_pb2.ReleaseLeaseResponse(released=n is not None, unpinned_blocks=n or 0)
