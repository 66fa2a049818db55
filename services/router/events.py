"""Applying a worker's KV events to the index, strictly in sequence.

A worker numbers its event batches 1, 2, 3, ... (per registration). The index
is only right if every batch is applied once and in order, so:

- ``seq == last + 1``: apply, remember ``seq``;
- ``seq <= last``: a retry of a batch already applied; acknowledge, do nothing;
- ``seq > last + 1`` (batches were lost) or ``last`` unknown (Redis lost its
  state): refuse and ask for a resync; the worker then sends a full snapshot
  tagged with the sequence number it covers, which replaces its entries.

The last sequence number lives in the index's store (Redis), beside the
entries it describes, so every router replica agrees on it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .index import BlockId, PrefixIndex, Tier


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"
    # Every block of the event's tier is gone (a cache reset); no hashes.
    ALL_CLEARED = "all_cleared"


@dataclass(frozen=True)
class KVEvent:
    kind: EventKind
    tier: Tier
    hashes: Sequence[BlockId] = ()


@dataclass(frozen=True)
class PublishResult:
    # The batch is (now or already) applied.
    accepted: bool
    resync_required: bool
    # The sequence number the router expects next; None when it lost track.
    expected_seq: int | None

    @property
    def message(self) -> str:
        if not self.resync_required:
            return "ok"
        if self.expected_seq is None:
            return "resync required (sequence unknown)"
        return f"resync required (expected seq {self.expected_seq})"


class KVEventApplier:
    def __init__(self, index: PrefixIndex) -> None:
        self._index = index

    async def reset(self, worker_id: str) -> int:
        """Start a fresh registration: no entries, sequence 0. Returns the first expected seq."""
        await self._index.drop_worker(worker_id)
        await self._index.set_last_seq(worker_id, 0)
        return 1

    async def publish(self, worker_id: str, seq: int, events: Sequence[KVEvent]) -> PublishResult:
        last = await self._index.last_seq(worker_id)
        if last is None:
            return PublishResult(accepted=False, resync_required=True, expected_seq=None)
        if seq <= last:
            return PublishResult(accepted=True, resync_required=False, expected_seq=last + 1)
        if seq != last + 1:
            return PublishResult(accepted=False, resync_required=True, expected_seq=last + 1)
        for ev in events:
            await self._apply(worker_id, ev)
        await self._index.set_last_seq(worker_id, seq)
        return PublishResult(accepted=True, resync_required=False, expected_seq=seq + 1)

    async def _apply(self, worker_id: str, ev: KVEvent) -> None:
        if ev.kind is EventKind.STORED:
            await self._index.add(worker_id, ev.tier, ev.hashes)
        elif ev.kind is EventKind.REMOVED:
            await self._index.remove(worker_id, ev.tier, ev.hashes)
        else:
            await self._index.clear(worker_id, ev.tier)

    async def resync(self, worker_id: str, seq: int, snapshot: Mapping[Tier, Sequence[BlockId]]) -> int:
        """Swap the worker's entries for ``snapshot`` (as of ``seq``); returns blocks indexed."""
        for tier in Tier:
            await self._index.clear(worker_id, tier)
            await self._index.add(worker_id, tier, snapshot.get(tier, ()))
        await self._index.set_last_seq(worker_id, seq)
        return sum(len(snapshot.get(t, ())) for t in Tier)
