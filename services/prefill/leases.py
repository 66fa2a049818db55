"""KV hand-off leases: which finished prefill holds which blocks, and until when.

A lease pins a prompt's blocks on this worker until the decode worker
acknowledges it has them (or aborts). One it never hears about expires after
its TTL and is released by the reaper, so a dead peer strands nothing.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.blocks import BlockHash
from kvmesh.errors import NotFound


@dataclass
class Lease:
    lease_id: str
    request_id: str
    block_hashes: list[BlockHash]
    ttl_ms: int
    expires_at: float


class LeaseTable:
    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def create(self, request_id: str, block_hashes: list[BlockHash], ttl_ms: int) -> Lease:
        lease = Lease(uuid.uuid4().hex, request_id, block_hashes, ttl_ms, self._now() + ttl_ms / 1000)
        self._leases[lease.lease_id] = lease
        return lease

    def get(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires_at <= self._now():
            raise NotFound(f"lease {lease_id!r} is unknown, released or expired")
        return lease

    def pop(self, lease_id: str) -> Lease | None:
        return self._leases.pop(lease_id, None)

    def all(self) -> list[Lease]:
        return list(self._leases.values())

    def pop_expired(self) -> list[Lease]:
        now = self._now()
        gone = [lease for lease in self._leases.values() if lease.expires_at <= now]
        for lease in gone:
            del self._leases[lease.lease_id]
        return gone
