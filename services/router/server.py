"""The router's gRPC servicer: protobuf in, ``core.Router`` calls, protobuf out.

The core raises domain errors (NotFound for an unknown lease,
FailedPrecondition for a layout mismatch, Unavailable when nobody can run a
request) and the runtime's interceptor maps them. One exception: a Heartbeat
for a lease the router no longer knows is an expected answer, not a failure,
so it is ``reregister_required`` as the contract says.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import grpc

from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.runtime import current_request_id

from . import convert
from .core import Router
from .policy import RoutePlan

RouteObserver = Callable[[RoutePlan | None], None]
"""Told every decision (None: no worker could take the request), e.g. to count it."""


def _require_lease(worker_id: str, lease_id: str) -> None:
    if not worker_id or not lease_id:
        raise InvalidArgument("worker_id and lease_id are required")


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, router: Router, on_route: RouteObserver | None = None) -> None:
        self.router = router
        self._on_route = on_route or (lambda plan: None)

    def _address_of(self, worker_id: str) -> str:
        state = self.router.registry.get(worker_id)
        # The plan was made from the registry in this same event-loop turn.
        assert state is not None, worker_id
        return state.info.address

    async def Route(
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        start = time.perf_counter_ns()
        common = dict(
            cache_salt=request.cache_salt,
            max_new_tokens=request.max_new_tokens,
            exclude=set(request.exclude_worker_ids),
            request_id=request.request_id or current_request_id() or "",
            adapter=request.adapter,
        )
        prompt = request.WhichOneof("prompt")
        try:
            if prompt == "tokens":
                plan = await self.router.route(request.tokens.token_ids, **common)
            elif prompt == "hashed":
                h = request.hashed
                if h.block_size <= 0:
                    raise InvalidArgument("hashed.block_size must be positive")
                chain = convert.hashes_from_pb(h.block_hashes)
                del common["cache_salt"]  # a hashed chain already includes it
                plan = await self.router.route_chain(
                    chain,
                    num_tokens=h.num_tokens or len(chain) * h.block_size,
                    block_size=h.block_size,
                    **common,
                )
            else:
                raise InvalidArgument("RouteRequest needs a prompt: tokens or hashed")
        except Unavailable:
            self._on_route(None)
            raise
        # Hashing, the index round trip and the decision.
        decided = time.perf_counter_ns()
        self._on_route(plan)
        resp = convert.plan_to_pb(plan, self._address_of)
        done = time.perf_counter_ns()
        resp.timings.CopyFrom(convert.timings_pb(total_ns=done - start, compute_ns=decided - start))
        return resp

    async def RegisterWorker(
        self, request: router_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RegisterWorkerResponse:
        reg = await self.router.register(convert.worker_info_from_pb(request))
        return convert.registration_to_pb(reg)

    async def Heartbeat(
        self, request: router_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.HeartbeatResponse:
        _require_lease(request.worker_id, request.lease_id)
        ttl_ms = round(self.router.registry.lease_ttl_s * 1000)
        try:
            await self.router.heartbeat(request.worker_id, request.lease_id, convert.load_from_pb(request.load))
        except NotFound:
            return router_pb2.HeartbeatResponse(reregister_required=True, lease_ttl_ms=ttl_ms)
        # While Redis is down a snapshot could not be taken; ask once it is back.
        resync = self.router.redis_available and request.worker_id in self.router.workers_needing_resync()
        return router_pb2.HeartbeatResponse(lease_ttl_ms=ttl_ms, resync_required=resync)

    async def DeregisterWorker(
        self, request: router_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DeregisterWorkerResponse:
        _require_lease(request.worker_id, request.lease_id)
        removed = await self.router.deregister(request.worker_id, request.lease_id)
        return router_pb2.DeregisterWorkerResponse(removed=removed)

    async def PublishKVEvents(
        self, request: router_pb2.PublishKVEventsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.PublishKVEventsResponse:
        _require_lease(request.worker_id, request.lease_id)
        result = await self.router.publish_kv_events(
            request.worker_id,
            request.lease_id,
            request.sequence,
            convert.events_from_pb(request.events),
        )
        return convert.publish_result_to_pb(result)

    async def ResyncWorker(
        self,
        request_iterator: AsyncIterator[router_pb2.ResyncWorkerRequest],
        context: grpc.aio.ServicerContext,
    ) -> router_pb2.ResyncWorkerResponse:
        start = time.perf_counter_ns()
        snap = await convert.snapshot_from_pb(request_iterator)
        _require_lease(snap.worker_id, snap.lease_id)
        received = time.perf_counter_ns()
        result = await self.router.resync(snap.worker_id, snap.lease_id, snap.sequence, snap.blocks)
        done = time.perf_counter_ns()
        return router_pb2.ResyncWorkerResponse(
            indexed_blocks=result.indexed_blocks,
            expected_sequence=result.expected_seq,
            timings=convert.timings_pb(total_ns=done - start, compute_ns=done - received, transfer_ns=received - start),
        )

    async def ListWorkers(
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        statuses = await self.router.list_workers(convert.role_filter_from_pb(request.role))
        resp = router_pb2.ListWorkersResponse(
            workers=[convert.worker_status_to_pb(s) for s in statuses],
            index_available=self.router.redis_available,
        )
        layout = self.router.registry.cluster_layout
        if layout is not None:
            resp.cluster_layout.CopyFrom(convert.layout_to_pb(layout))
        return resp
