"""KV events waiting to go to the router: filled by any thread, drained in batches.

The engine thread (or the kvstore's I/O threads) append events; the link's
publisher takes them off in order, a batch at a time. Consecutive events of
the same type and tier merge into one, so a burst of single-block STORED
events travels as one event with many hashes.

The queue is bounded: when the router is away for long, the oldest events are
not worth keeping. On overflow everything pending is dropped and the queue
asks for a resync instead — a full snapshot taken afterwards covers whatever
the dropped events said.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.api.router.v1 import router_pb2


@dataclass(slots=True)
class PendingEvent:
    type: int  # router_pb2.KVEventType
    tier: int  # kv_pb2.KVTier
    hashes: list[bytes]

    def to_proto(self) -> router_pb2.KVEvent:
        return router_pb2.KVEvent(type=self.type, tier=self.tier, block_hashes=self.hashes)


class EventQueue:
    def __init__(self, max_pending_hashes: int) -> None:
        if max_pending_hashes <= 0:
            raise ValueError(f"max_pending_hashes must be positive, got {max_pending_hashes}")
        self._max_pending = max_pending_hashes
        self._lock = threading.Lock()
        self._events: deque[PendingEvent] = deque()
        self._pending_hashes = 0
        self._overflowed = False
        self.dropped_hashes = 0

    @property
    def pending_hashes(self) -> int:
        return self._pending_hashes

    def put(self, type_: int, tier: int, hashes: Sequence[bytes]) -> bool:
        """Append an event; True when the queue was idle before (the consumer needs waking)."""
        with self._lock:
            was_idle = not self._events and not self._overflowed
            if self._pending_hashes + len(hashes) > self._max_pending:
                self.dropped_hashes += self._pending_hashes + len(hashes)
                self._events.clear()
                self._pending_hashes = 0
                self._overflowed = True
                return was_idle
            last = self._events[-1] if self._events else None
            if last is not None and (last.type, last.tier) == (type_, tier) and hashes:
                last.hashes.extend(hashes)
            else:
                self._events.append(PendingEvent(type_, tier, list(hashes)))
            self._pending_hashes += len(hashes)
            return was_idle

    def take_overflow(self) -> bool:
        """True (once) when events were dropped since the last call: resync before sending more."""
        with self._lock:
            overflowed, self._overflowed = self._overflowed, False
            return overflowed

    def take_batch(self, max_hashes: int) -> list[PendingEvent]:
        """The oldest events, in order, with at most ``max_hashes`` hashes in all
        (a bigger event is split); empty when nothing is pending."""
        batch: list[PendingEvent] = []
        room = max_hashes
        with self._lock:
            while self._events and (room > 0 or not self._events[0].hashes):
                event = self._events[0]
                if len(event.hashes) <= room:
                    self._events.popleft()
                    batch.append(event)
                    taken = len(event.hashes)
                else:
                    batch.append(PendingEvent(event.type, event.tier, event.hashes[:room]))
                    del event.hashes[:room]
                    taken = room
                room -= taken
                self._pending_hashes -= taken
        return batch
