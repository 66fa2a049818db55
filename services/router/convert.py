"""Protobuf <-> router core types, in one place.

Malformed input (an unspecified enum, a block hash of the wrong size, a resync
stream that changes worker halfway) is refused here with ``InvalidArgument``,
before the core sees it. The core's own rules (leases, layouts, sequences)
stay in the core.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TypeVar

from kvmesh.api.common.v1 import accounting_pb2, kv_pb2, worker_pb2
from kvmesh.api.router.v1 import router_pb2
from kvmesh.blocks import HASH_BYTES, BlockHash
from kvmesh.errors import InvalidArgument

from .events import EventKind, KVEvent, PublishResult
from .index import Tier
from .membership import Registration, WorkerStatus
from .policy import RoutePlan
from .worker import AdapterState, KVLayout, Role, WorkerCapacity, WorkerInfo, WorkerLoad

T = TypeVar("T")

_ROLE_FROM_PB = {
    worker_pb2.WORKER_ROLE_PREFILL: Role.PREFILL,
    worker_pb2.WORKER_ROLE_DECODE: Role.DECODE,
    worker_pb2.WORKER_ROLE_KVSTORE: Role.KVSTORE,
}
_ROLE_TO_PB = {v: k for k, v in _ROLE_FROM_PB.items()}

_TIER_FROM_PB = {kv_pb2.KV_TIER_GPU: Tier.GPU, kv_pb2.KV_TIER_KVSTORE: Tier.KVSTORE}

_EVENT_KIND_FROM_PB = {
    router_pb2.KV_EVENT_TYPE_STORED: EventKind.STORED,
    router_pb2.KV_EVENT_TYPE_REMOVED: EventKind.REMOVED,
    router_pb2.KV_EVENT_TYPE_ALL_CLEARED: EventKind.ALL_CLEARED,
}


def role_from_pb(role: int) -> Role:
    try:
        return _ROLE_FROM_PB[role]
    except KeyError:
        raise InvalidArgument(f"unknown worker role {role} (prefill, decode or kvstore)") from None


def role_filter_from_pb(role: int) -> Role | None:
    """ListWorkers' filter: unspecified means every role."""
    return None if role == worker_pb2.WORKER_ROLE_UNSPECIFIED else role_from_pb(role)


def role_to_pb(role: Role) -> int:
    return _ROLE_TO_PB[role]


def tier_from_pb(tier: int) -> Tier:
    try:
        return _TIER_FROM_PB[tier]
    except KeyError:
        raise InvalidArgument(f"unknown KV tier {tier} (gpu or kvstore)") from None


def hashes_from_pb(hashes: Sequence[bytes]) -> list[BlockHash]:
    for h in hashes:
        if len(h) != HASH_BYTES:
            raise InvalidArgument(f"a block hash is {HASH_BYTES} bytes, got {len(h)}")
    return list(hashes)


def _same_fields(cls: type[T], message: object) -> T:
    """A flat dataclass from a message whose fields it names alike (KVLayout)."""
    return cls(**{f.name: getattr(message, f.name) for f in fields(cls)})


def layout_from_pb(layout: kv_pb2.KVLayout) -> KVLayout:
    return _same_fields(KVLayout, layout)


def layout_to_pb(layout: KVLayout) -> kv_pb2.KVLayout:
    return kv_pb2.KVLayout(**asdict(layout))


def worker_info_from_pb(req: router_pb2.RegisterWorkerRequest) -> WorkerInfo:
    if not req.worker_id:
        raise InvalidArgument("worker_id is required")
    if not req.address:
        raise InvalidArgument(f"worker {req.worker_id}: address is required")
    role = role_from_pb(req.role)
    layout = None
    if role.runs_requests and req.HasField("layout"):
        # Hashing a prompt needs both; an engine always sends them.
        if req.layout.block_size <= 0 or not req.layout.model_fingerprint:
            raise InvalidArgument(f"worker {req.worker_id}: KV layout needs a block_size and a model_fingerprint")
        layout = layout_from_pb(req.layout)
    c = req.capacity
    return WorkerInfo(
        worker_id=req.worker_id,
        role=role,
        address=req.address,
        layout=layout,
        capacity=WorkerCapacity(c.total_kv_blocks, c.max_num_seqs, c.max_model_len),
        model=req.model,
    )


def load_from_pb(load: worker_pb2.WorkerLoad) -> WorkerLoad:
    counts = {f.name: getattr(load, f.name) for f in fields(WorkerLoad) if f.name != "adapters"}
    return WorkerLoad(**counts, adapters=tuple(AdapterState(a.name, a.fingerprint, a.resident) for a in load.adapters))


def load_to_pb(load: WorkerLoad) -> worker_pb2.WorkerLoad:
    return worker_pb2.WorkerLoad(
        **{**asdict(load), "adapters": [worker_pb2.AdapterState(**asdict(a)) for a in load.adapters]}
    )


def registration_to_pb(reg: Registration) -> router_pb2.RegisterWorkerResponse:
    return router_pb2.RegisterWorkerResponse(
        lease_id=reg.lease.lease_id,
        lease_ttl_ms=round(reg.lease.ttl_s * 1000),
        heartbeat_interval_ms=round(reg.lease.heartbeat_interval_s * 1000),
        expected_sequence=reg.expected_seq,
    )


def events_from_pb(events: Sequence[router_pb2.KVEvent]) -> list[KVEvent]:
    out = []
    for e in events:
        kind = _EVENT_KIND_FROM_PB.get(e.type)
        if kind is None:
            raise InvalidArgument(f"unknown KV event type {e.type}")
        if kind is EventKind.ALL_CLEARED and e.block_hashes:
            raise InvalidArgument("an ALL_CLEARED event carries no block hashes")
        out.append(KVEvent(kind, tier_from_pb(e.tier), hashes_from_pb(e.block_hashes)))
    return out


def publish_result_to_pb(result: PublishResult) -> router_pb2.PublishKVEventsResponse:
    return router_pb2.PublishKVEventsResponse(
        accepted=result.accepted,
        resync_required=result.resync_required,
        # 0: the router lost track (Redis lost its state); the snapshot sets it.
        expected_sequence=result.expected_seq or 0,
    )


@dataclass
class Snapshot:
    """A ResyncWorker stream, gathered: who sends it, as of which sequence, and its blocks."""

    worker_id: str
    lease_id: str
    sequence: int
    blocks: dict[Tier, list[BlockHash]] = field(default_factory=dict)


async def snapshot_from_pb(parts: AsyncIterator[router_pb2.ResyncWorkerRequest]) -> Snapshot:
    snap: Snapshot | None = None
    async for part in parts:
        if snap is None:
            snap = Snapshot(part.worker_id, part.lease_id, part.sequence)
        elif (part.worker_id, part.lease_id, part.sequence) != (
            snap.worker_id,
            snap.lease_id,
            snap.sequence,
        ):
            raise InvalidArgument("every message of a resync stream carries the same worker_id, lease_id and sequence")
        if not part.block_hashes:
            continue  # an empty part may leave the tier unspecified (an empty snapshot)
        tier = tier_from_pb(part.tier)
        snap.blocks.setdefault(tier, []).extend(hashes_from_pb(part.block_hashes))
    if snap is None:
        raise InvalidArgument("empty resync stream: send at least one message naming the worker")
    return snap


def timings_pb(*, total_ns: int, compute_ns: int, transfer_ns: int = 0) -> accounting_pb2.Timings:
    return accounting_pb2.Timings(compute_ns=compute_ns, transfer_ns=transfer_ns, total_ns=total_ns)


def plan_to_pb(plan: RoutePlan, address_of: Callable[[str], str]) -> router_pb2.RouteResponse:
    def endpoint(worker_id: str) -> worker_pb2.WorkerEndpoint:
        return worker_pb2.WorkerEndpoint(worker_id=worker_id, address=address_of(worker_id))

    resp = router_pb2.RouteResponse(
        decode_worker=endpoint(plan.decode_worker),
        prefill_locally=plan.prefill_locally,
        total_blocks=plan.total_blocks,
        prefill_matched_blocks=plan.prefill_matched_blocks,
        decode_matched_blocks=plan.decode_matched_blocks,
        kvstore_matched_blocks=plan.kvstore_matched_blocks,
        index_available=plan.index_available,
        predicted_cached_tokens=plan.predicted_cached_tokens,
    )
    if plan.prefill_worker is not None:
        resp.prefill_worker.CopyFrom(endpoint(plan.prefill_worker))
    return resp


def worker_status_to_pb(status: WorkerStatus) -> router_pb2.WorkerStatus:
    s = status.state
    info = s.info
    return router_pb2.WorkerStatus(
        endpoint=worker_pb2.WorkerEndpoint(worker_id=info.worker_id, address=info.address),
        role=role_to_pb(info.role),
        capacity=router_pb2.WorkerCapacity(
            total_kv_blocks=info.capacity.total_kv_blocks,
            max_num_seqs=info.capacity.max_num_seqs,
            max_model_len=info.capacity.max_model_len,
        ),
        load=load_to_pb(s.load),
        last_heartbeat_unix_ms=round(s.heartbeat_at * 1000),
        lease_expires_unix_ms=round(s.expires_at * 1000),
        indexed_blocks=status.indexed_blocks or 0,
        model=info.model,
    )
