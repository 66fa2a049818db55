"""Router, prefill and decode as tiny gRPC servicers on one in-process server, for the gateway's server tests.

They speak the real contracts over real gRPC, so the tests see what the
gateway's servicer and ``GrpcBackends`` do with deadlines, status codes,
request ids and cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from kvmesh.api.common.v1 import accounting_pb2, kv_pb2, sampling_pb2, worker_pb2
from kvmesh.api.decode.v1 import decode_pb2, decode_pb2_grpc
from kvmesh.api.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.errors import Unavailable
from kvmesh.runtime import GrpcService, ServiceContext, ServiceDef, current_request_id

TOKENS = [7, 11, 12, 13]


class Mesh(
    router_pb2_grpc.RouterServiceServicer,
    prefill_pb2_grpc.PrefillServiceServicer,
    decode_pb2_grpc.DecodeServiceServicer,
):
    def __init__(self) -> None:
        self.address = ""  # set once serving
        self.dead_decode_address = ""  # routed to first when set, until the gateway excludes it
        self.route_delay_s = 0.0
        self.route_error: Exception | None = None  # what Route answers instead of a plan
        self.fail_decode_after: int | None = None
        self.hold_decode_after: int | None = None
        self.decode_started = asyncio.Event()
        self.decode_held = asyncio.Event()
        self.decode_cancelled = asyncio.Event()
        self.request_ids: list[str | None] = []
        self.released: list[str] = []

    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        self.request_ids.append(current_request_id())
        await asyncio.sleep(self.route_delay_s)
        if self.route_error is not None:
            raise self.route_error
        decode = worker_pb2.WorkerEndpoint(worker_id="decode-0", address=self.address)
        if self.dead_decode_address and "decode-dead" not in request.exclude_worker_ids:
            decode = worker_pb2.WorkerEndpoint(worker_id="decode-dead", address=self.dead_decode_address)
        return router_pb2.RouteResponse(
            prefill_worker=worker_pb2.WorkerEndpoint(worker_id="prefill-0", address=self.address),
            decode_worker=decode,
        )

    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        self.request_ids.append(current_request_id())
        return prefill_pb2.PrefillResponse(
            first_token_id=TOKENS[0],
            handoff=kv_pb2.KVHandoff(mode=kv_pb2.HANDOFF_MODE_PULL, source_address=self.address, lease_id="lease-1"),
            reused_tokens=0,
        )

    async def ReleaseLease(
        self, request: prefill_pb2.ReleaseLeaseRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.ReleaseLeaseResponse:
        self.released.append(request.lease_id)
        return prefill_pb2.ReleaseLeaseResponse(released=True)

    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        self.request_ids.append(current_request_id())
        self.decode_started.set()
        try:
            for i, token in enumerate(TOKENS):
                if i == self.fail_decode_after:
                    raise Unavailable("the worker is going away")
                if i == self.hold_decode_after:
                    self.decode_held.set()
                    await asyncio.Event().wait()
                last = i == len(TOKENS) - 1
                final = decode_pb2.DecodeFinal(
                    finish_reason=sampling_pb2.FINISH_REASON_LENGTH,
                    usage=accounting_pb2.Usage(completion_tokens=len(TOKENS)),
                )
                yield decode_pb2.DecodeResponse(
                    offset=i, token_ids=[token], text=f"<{token}>", final=final if last else None
                )
        except asyncio.CancelledError:
            self.decode_cancelled.set()
            raise


def build_mesh(mesh: Mesh):
    def build(ctx: ServiceContext) -> ServiceDef:
        return ServiceDef(
            services=[
                GrpcService.of(router_pb2, router_pb2_grpc, "RouterService", mesh),
                GrpcService.of(prefill_pb2, prefill_pb2_grpc, "PrefillService", mesh),
                GrpcService.of(decode_pb2, decode_pb2_grpc, "DecodeService", mesh),
            ]
        )

    return build
