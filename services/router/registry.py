"""The worker registry: who may be routed to, under leases, with one KV layout.

A worker registers (getting a lease), then heartbeats with its load to renew
the lease; when the lease lapses it disappears from routing. The first
registered layout becomes the cluster's and a worker with any other layout is
refused, naming the field that differs, since KV blocks can only move between
equal layouts. A router that hashes token prompts itself pins the block size
(``block_size``): a worker cutting other blocks would never match its hashes.
The kvstore stores opaque blocks of any layout and has none to check.

This is the logic on one replica's view. Sharing the view through Redis is
``registry_store``'s job and the router core's to orchestrate, so this module
stays synchronous and is tested with a fake clock.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound

from .worker import KVLayout, Role, WorkerInfo, WorkerLoad


@dataclass(frozen=True)
class WorkerState:
    info: WorkerInfo
    lease_id: str
    load: WorkerLoad
    # When the load was reported (the last heartbeat, or registration).
    heartbeat_at: float
    expires_at: float

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def to_json(self) -> dict:
        return {
            "info": self.info.to_json(),
            "lease_id": self.lease_id,
            "load": self.load.to_json(),
            "heartbeat_at": self.heartbeat_at,
            "expires_at": self.expires_at,
        }

    @classmethod
    def from_json(cls, d: dict) -> WorkerState:
        return cls(
            info=WorkerInfo.from_json(d["info"]),
            lease_id=d["lease_id"],
            load=WorkerLoad.from_json(d["load"]),
            heartbeat_at=d["heartbeat_at"],
            expires_at=d["expires_at"],
        )


@dataclass(frozen=True)
class Lease:
    worker_id: str
    lease_id: str
    ttl_s: float
    heartbeat_interval_s: float
    expires_at: float


class WorkerRegistry:
    def __init__(
        self,
        *,
        lease_ttl_s: float = 10.0,
        heartbeat_interval_s: float | None = None,
        block_size: int | None = None,
        now: Callable[[], float] = time.time,
    ) -> None:
        # Three heartbeats per TTL by default: one lost heartbeat never costs the lease.
        self.heartbeat_interval_s = heartbeat_interval_s or lease_ttl_s / 3
        if not 0 < self.heartbeat_interval_s < lease_ttl_s:
            raise ValueError(
                f"heartbeat interval {self.heartbeat_interval_s}s must be shorter than the lease TTL {lease_ttl_s}s"
            )
        self.lease_ttl_s = lease_ttl_s
        self.block_size = block_size
        self._now = now
        self._workers: dict[str, WorkerState] = {}
        self.cluster_layout: KVLayout | None = None

    def _lease(self, s: WorkerState) -> Lease:
        return Lease(s.worker_id, s.lease_id, self.lease_ttl_s, self.heartbeat_interval_s, s.expires_at)

    def adopt_layout(self, layout: KVLayout) -> None:
        """Take the cluster layout agreed in the shared store (the first ever registered)."""
        self.cluster_layout = layout

    def check_layout(self, info: WorkerInfo) -> None:
        """Refuse a worker whose KV layout cannot join the cluster (as known so far)."""
        if not info.role.runs_requests:
            return
        if info.layout is None:
            raise InvalidArgument(f"worker {info.worker_id}: a {info.role.value} worker must announce its KV layout")
        if self.block_size is not None and info.layout.block_size != self.block_size:
            raise FailedPrecondition(
                f"worker {info.worker_id}: KV layout block_size={info.layout.block_size} "
                f"does not match the router's block size {self.block_size}"
            )
        if self.cluster_layout is None:
            return
        field = self.cluster_layout.first_mismatch(info.layout)
        if field is not None:
            raise FailedPrecondition(
                f"worker {info.worker_id}: KV layout {field}={getattr(info.layout, field)!r} "
                f"does not match the cluster's {field}={getattr(self.cluster_layout, field)!r}"
            )

    def register(self, info: WorkerInfo) -> Lease:
        """Admit (or re-admit, replacing its old lease) a worker whose layout is the cluster's."""
        self.check_layout(info)
        if self.cluster_layout is None and info.role.runs_requests:
            self.cluster_layout = info.layout
        now = self._now()
        load = WorkerLoad(
            free_kv_blocks=info.capacity.total_kv_blocks,
            total_kv_blocks=info.capacity.total_kv_blocks,
        )
        state = WorkerState(info, uuid.uuid4().hex, load, now, now + self.lease_ttl_s)
        self._workers[info.worker_id] = state
        return self._lease(state)

    def _current(self, worker_id: str, lease_id: str | None) -> WorkerState:
        s = self._workers.get(worker_id)
        if s is None or s.expires_at <= self._now():
            raise NotFound(f"worker {worker_id} is not registered (or its lease expired)")
        if lease_id is not None and lease_id != s.lease_id:
            raise NotFound(f"worker {worker_id}: lease {lease_id} was replaced by a newer registration")
        return s

    def check_lease(self, worker_id: str, lease_id: str | None) -> None:
        """Raise NotFound unless the worker holds this live lease."""
        self._current(worker_id, lease_id)

    def heartbeat(self, worker_id: str, lease_id: str | None, load: WorkerLoad) -> Lease:
        s = self._current(worker_id, lease_id)
        now = self._now()
        s = dataclasses.replace(s, load=load, heartbeat_at=now, expires_at=now + self.lease_ttl_s)
        self._workers[worker_id] = s
        return self._lease(s)

    def deregister(self, worker_id: str, lease_id: str | None = None) -> bool:
        s = self._workers.get(worker_id)
        if s is None or (lease_id is not None and lease_id != s.lease_id):
            return False
        del self._workers[worker_id]
        return True

    def expire(self) -> list[str]:
        """Remove every worker whose lease lapsed; returns their ids."""
        now = self._now()
        gone = [w for w, s in self._workers.items() if s.expires_at <= now]
        for w in gone:
            del self._workers[w]
        return gone

    def get(self, worker_id: str) -> WorkerState | None:
        return self._workers.get(worker_id)

    def live(self, role: Role | None = None) -> list[WorkerState]:
        now = self._now()
        return [s for s in self._workers.values() if s.expires_at > now and (role is None or s.info.role is role)]

    def all_states(self) -> list[WorkerState]:
        return list(self._workers.values())

    def merge(self, shared: Iterable[WorkerState]) -> None:
        """Adopt the shared view: workers another replica dropped go, fresher heartbeats win."""
        merged: dict[str, WorkerState] = {}
        for s in shared:
            mine = self._workers.get(s.worker_id)
            fresher_here = mine is not None and mine.lease_id == s.lease_id and mine.heartbeat_at > s.heartbeat_at
            merged[s.worker_id] = mine if fresher_here else s
        self._workers = merged
