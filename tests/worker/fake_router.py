"""An in-memory ``RouterService`` keeping the contract's registration and KV-event rules.

Enough of a router to test the worker side against: leases, per-worker
sequence numbers (a retry is acknowledged, a gap or a lost sequence asks for a
resync), snapshots that replace a worker's entries, and knobs to play the
failures a real router has (forgetting a worker's sequence, expiring a lease).
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.errors import InvalidArgument, NotFound
from kvmesh.runtime import GrpcService, ServiceContext, ServiceDef

HEARTBEAT_INTERVAL_MS = 20


@dataclass
class RouterState:
    """What the fake keeps; it outlives one server so a test can restart the router over it."""

    leases: dict[str, str] = field(default_factory=dict)
    registrations: list[router_pb2.RegisterWorkerRequest] = field(default_factory=list)
    heartbeats: list[router_pb2.HeartbeatRequest] = field(default_factory=list)
    # worker -> last applied sequence; absent = unknown (resync required)
    last_seq: dict[str, int] = field(default_factory=dict)
    # worker -> tier -> hashes
    index: dict[str, dict[int, set[bytes]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(set)))
    applied_sequences: list[int] = field(default_factory=list)
    resyncs: list[tuple[str, int, int]] = field(default_factory=list)  # (worker, sequence, blocks)
    deregistered: list[str] = field(default_factory=list)
    # workers whose heartbeats say resync_required until their next snapshot
    resync_wanted: set[str] = field(default_factory=set)

    def blocks(self, worker_id: str, tier: int) -> set[bytes]:
        return set(self.index[worker_id][tier])

    def forget_sequence(self, worker_id: str) -> None:
        """As after a Redis restart: the next batch is answered "resync required"."""
        self.last_seq.pop(worker_id, None)
        self.index.pop(worker_id, None)

    def lose_entries(self, worker_id: str) -> None:
        """As after the index came back empty with the lease intact: heartbeats ask for a snapshot."""
        self.index.pop(worker_id, None)
        self.resync_wanted.add(worker_id)

    def expire(self, worker_id: str) -> None:
        """The lease lapsed: the worker and its entries are gone."""
        self.leases.pop(worker_id, None)
        self.last_seq.pop(worker_id, None)
        self.index.pop(worker_id, None)


class FakeRouter(router_pb2_grpc.RouterServiceServicer):
    def __init__(self, state: RouterState) -> None:
        self.state = state

    def _check_lease(self, worker_id: str, lease_id: str) -> None:
        if self.state.leases.get(worker_id) != lease_id:
            raise NotFound(f"worker {worker_id} is not registered")

    async def RegisterWorker(
        self, request: router_pb2.RegisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RegisterWorkerResponse:
        s = self.state
        s.registrations.append(request)
        s.leases[request.worker_id] = lease = uuid.uuid4().hex
        s.index.pop(request.worker_id, None)
        s.last_seq[request.worker_id] = 0
        return router_pb2.RegisterWorkerResponse(
            lease_id=lease,
            lease_ttl_ms=10 * HEARTBEAT_INTERVAL_MS,
            heartbeat_interval_ms=HEARTBEAT_INTERVAL_MS,
            expected_sequence=1,
        )

    async def Heartbeat(
        self, request: router_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.HeartbeatResponse:
        self.state.heartbeats.append(request)
        known = self.state.leases.get(request.worker_id) == request.lease_id
        return router_pb2.HeartbeatResponse(
            reregister_required=not known,
            lease_ttl_ms=10 * HEARTBEAT_INTERVAL_MS,
            resync_required=known and request.worker_id in self.state.resync_wanted,
        )

    async def DeregisterWorker(
        self, request: router_pb2.DeregisterWorkerRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.DeregisterWorkerResponse:
        removed = self.state.leases.get(request.worker_id) == request.lease_id
        if removed:
            self.state.expire(request.worker_id)
            self.state.deregistered.append(request.worker_id)
        return router_pb2.DeregisterWorkerResponse(removed=removed)

    async def PublishKVEvents(
        self, request: router_pb2.PublishKVEventsRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.PublishKVEventsResponse:
        s, w = self.state, request.worker_id
        self._check_lease(w, request.lease_id)
        last = s.last_seq.get(w)
        if last is None:
            return router_pb2.PublishKVEventsResponse(resync_required=True)
        if request.sequence <= last:
            return router_pb2.PublishKVEventsResponse(accepted=True, expected_sequence=last + 1)
        if request.sequence != last + 1:
            return router_pb2.PublishKVEventsResponse(resync_required=True, expected_sequence=last + 1)
        for event in request.events:
            tier = s.index[w][event.tier]
            if event.type == router_pb2.KV_EVENT_TYPE_STORED:
                tier.update(event.block_hashes)
            elif event.type == router_pb2.KV_EVENT_TYPE_REMOVED:
                tier.difference_update(event.block_hashes)
            elif event.type == router_pb2.KV_EVENT_TYPE_ALL_CLEARED:
                tier.clear()
            else:
                raise InvalidArgument(f"event type {event.type}")
        s.last_seq[w] = request.sequence
        s.applied_sequences.append(request.sequence)
        return router_pb2.PublishKVEventsResponse(accepted=True, expected_sequence=request.sequence + 1)

    async def ResyncWorker(
        self, request_iterator: AsyncIterator[router_pb2.ResyncWorkerRequest], context: grpc.aio.ServicerContext
    ) -> router_pb2.ResyncWorkerResponse:
        snapshot: dict[int, set[bytes]] = defaultdict(set)
        first: router_pb2.ResyncWorkerRequest | None = None
        async for part in request_iterator:
            first = first or part
            if (part.worker_id, part.lease_id, part.sequence) != (first.worker_id, first.lease_id, first.sequence):
                raise InvalidArgument("a resync stream names one worker, lease and sequence")
            snapshot[part.tier].update(part.block_hashes)
        if first is None:
            raise InvalidArgument("empty resync stream")
        self._check_lease(first.worker_id, first.lease_id)
        self.state.index[first.worker_id] = defaultdict(set, snapshot)
        self.state.last_seq[first.worker_id] = first.sequence
        self.state.resync_wanted.discard(first.worker_id)
        blocks = sum(len(h) for h in snapshot.values())
        self.state.resyncs.append((first.worker_id, first.sequence, blocks))
        return router_pb2.ResyncWorkerResponse(indexed_blocks=blocks, expected_sequence=first.sequence + 1)


def build_fake_router(state: RouterState) -> Callable[[ServiceContext], ServiceDef]:
    def build(ctx: ServiceContext) -> ServiceDef:
        return ServiceDef(
            services=[
                GrpcService.of(
                    router_pb2,
                    router_pb2_grpc,
                    "RouterService",
                    FakeRouter(state),
                )
            ]
        )

    return build
