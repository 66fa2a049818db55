"""A worker's link to the router: registration, heartbeats and KV events.

Prefill, decode and the kvstore each run one ``RouterLink``. It registers the
worker, heartbeats with its load, and publishes the blocks it stores and
removes as numbered batches of KV events. ``publish`` is called from any
thread (the engine's step thread, the kvstore's I/O threads) and only appends
to a queue; one task on the event loop does all the talking.

How the router's index stays right (docs/contracts.md, "KV events"):

- every batch carries the next sequence number; a batch is retried with the
  same number until the router acknowledges it, so a lost answer is harmless;
- the router asks for a resync when it saw a gap or lost its state; the link
  then streams a full snapshot (``snapshot_fn``) tagged with the last sequence
  number it covers and carries on from there. Events still queued when the
  snapshot is taken are sent after it anyway: replaying STORED/REMOVED in
  order over a snapshot that already reflects them ends in the same state,
  because the worker changes its state *before* it publishes the event;
- after every registration (first start, expired lease) the router has no
  entries for the worker, so a snapshot goes first; a heartbeat answered
  ``resync_required`` (the router's index lost the worker's entries) sends one
  too.

The router being down never reaches the caller: calls are retried with
backoff, heartbeats keep trying at their interval, and when the router says
the lease is gone (``reregister_required`` or NOT_FOUND) the link registers
again and resyncs. A router that comes back with the lease intact just
continues where it left off, with no resync needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping

import grpc
import structlog

from kvmesh.api.common.v1 import kv_pb2, worker_pb2
from kvmesh.api.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.blocks import HASH_BYTES, BlockHash
from kvmesh.runtime import create_channel
from kvmesh.worker.backoff import Backoff
from kvmesh.worker.event_queue import EventQueue, PendingEvent

log = structlog.get_logger("kvmesh.worker.router_link")

Snapshot = Mapping[int, Iterable[BlockHash]]
"""Every block the worker holds, per ``kv_pb2.KVTier``."""

SnapshotFn = Callable[[], Snapshot] | Callable[[], Awaitable[Snapshot]]
"""A plain function (run in a worker thread, so it may take locks) or a coroutine
function (awaited on the event loop, e.g. to ask the engine thread)."""

_EVENT_TYPES = {
    "stored": router_pb2.KV_EVENT_TYPE_STORED,
    "removed": router_pb2.KV_EVENT_TYPE_REMOVED,
    "all_cleared": router_pb2.KV_EVENT_TYPE_ALL_CLEARED,
}

# Until the router says otherwise (RegisterWorkerResponse.heartbeat_interval_ms).
_DEFAULT_HEARTBEAT_INTERVAL_S = 1.0


class _LeaseLost(Exception):
    """The router no longer knows this worker's lease: register again."""


class RouterLink:
    def __init__(
        self,
        router_address: str,
        worker_id: str,
        role: int,
        address: str,
        layout: kv_pb2.KVLayout | None,
        capacity: router_pb2.WorkerCapacity | None,
        model: str,
        load_fn: Callable[[], worker_pb2.WorkerLoad],
        snapshot_fn: SnapshotFn,
        *,
        rpc_timeout_s: float = 5.0,
        resync_timeout_s: float = 60.0,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        max_batch_hashes: int = 8192,
        max_pending_hashes: int = 1 << 20,
        resync_chunk_hashes: int = 4096,
    ) -> None:
        """``role`` is a ``worker_pb2.WorkerRole``; ``layout`` and ``capacity`` may be
        None where they mean nothing (the kvstore). ``load_fn`` is called on the
        event loop for every heartbeat and must be quick."""
        self.worker_id = worker_id
        self._router_address = router_address
        self._registration = router_pb2.RegisterWorkerRequest(
            worker_id=worker_id, role=role, address=address, layout=layout, capacity=capacity, model=model
        )
        self._load_fn = load_fn
        self._snapshot_fn = snapshot_fn
        self._rpc_timeout_s = rpc_timeout_s
        self._resync_timeout_s = resync_timeout_s
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._max_batch_hashes = max_batch_hashes
        self._resync_chunk_hashes = resync_chunk_hashes
        self._queue = EventQueue(max_pending_hashes)
        self._counters: Counter[str] = Counter()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._report: asyncio.Event | None = None  # heartbeat now, not at the next interval
        # Heartbeats whose load was taken, and the last of them the router acknowledged (``report``).
        self._heartbeats_built = 0
        self._heartbeat_acked = 0
        self._acked: asyncio.Condition | None = None
        self._channel: grpc.aio.Channel | None = None
        self._stub: router_pb2_grpc.RouterServiceStub | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

        # Session state, touched only by the link's task.
        self._lease_id: str | None = None
        self._heartbeat_interval_s = _DEFAULT_HEARTBEAT_INTERVAL_S
        self._next_seq = 1
        self._batch: list[PendingEvent] | None = None  # taken off the queue, not yet acknowledged
        self._needs_resync = True
        self._failing: set[str] = set()  # calls failing now, so an outage logs once, not per retry

    # -- the worker's side ---------------------------------------------------

    async def start(self) -> None:
        """Start talking to the router in the background; returns at once (the
        worker serves whether or not the router is reachable)."""
        if self._task is not None:
            raise RuntimeError("RouterLink already started")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._report = asyncio.Event()
        self._acked = asyncio.Condition()
        self._channel = create_channel(self._router_address, peer="router")
        self._stub = router_pb2_grpc.RouterServiceStub(self._channel)
        self._task = asyncio.create_task(self._run(), name=f"router-link-{self.worker_id}")

    def publish(self, kind: str | int, hashes: Iterable[BlockHash], tier: int) -> None:
        """Queue a KV event; never blocks on the router, safe from any thread.

        ``kind`` is "stored", "removed" or "all_cleared" (any case) or a
        ``router_pb2.KVEventType``; ``tier`` a ``kv_pb2.KVTier``. Call it after
        the state change it reports. Raises ValueError on a malformed event
        (a bug in the caller), before queueing anything.
        """
        type_ = _EVENT_TYPES.get(kind.lower()) if isinstance(kind, str) else kind
        if type_ not in _EVENT_TYPES.values():
            raise ValueError(f"unknown KV event kind {kind!r}")
        if tier not in (kv_pb2.KV_TIER_GPU, kv_pb2.KV_TIER_KVSTORE):
            raise ValueError(f"unknown KV tier {tier!r}")
        hashes = list(hashes)
        for h in hashes:
            if not isinstance(h, bytes) or len(h) != HASH_BYTES:
                raise ValueError(f"a block hash is {HASH_BYTES} bytes, got {h!r:.80}")
        if self._closed or (not hashes and type_ != router_pb2.KV_EVENT_TYPE_ALL_CLEARED):
            return
        if self._queue.put(type_, tier, hashes):
            self._wake_publisher()

    async def stop(self) -> None:
        """Stop the link and deregister, so the router stops counting this worker
        now rather than at lease expiry. Events still queued are dropped: the
        router forgets the worker's blocks anyway."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._stub is not None and self._lease_id is not None:
            try:
                await self._stub.DeregisterWorker(
                    router_pb2.DeregisterWorkerRequest(worker_id=self.worker_id, lease_id=self._lease_id),
                    timeout=min(self._rpc_timeout_s, 2.0),
                )
                self._counters["deregistrations"] += 1
            except grpc.aio.AioRpcError as e:
                log.warning("router_deregister_failed", worker_id=self.worker_id, code=e.code().name)
            self._lease_id = None
        if self._channel is not None:
            await self._channel.close()

    @property
    def registered(self) -> bool:
        """Whether the worker holds a lease (as far as the link knows)."""
        return self._lease_id is not None

    @property
    def counters(self) -> dict[str, int]:
        """What the link did so far: registrations, heartbeats, batches and events
        published, resyncs, failures, dropped events; plus pending events now."""
        out = dict(self._counters)
        out["events_dropped"] = self._queue.dropped_hashes
        out["events_pending"] = self._queue.pending_hashes
        return out

    def _wake_publisher(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is None or wake is None:
            return  # not started: the publisher drains the queue once it is
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:
            pass  # the loop is closed: the worker is shutting down

    # -- the link's task ----------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff(*self._backoff)
        while True:
            try:
                await self._register()
                backoff.reset()
                await self._session()
            except _LeaseLost as e:
                self._counters["leases_lost"] += 1
                log.info("router_lease_lost", worker_id=self.worker_id, reason=str(e))
            except grpc.aio.AioRpcError as e:
                self._call_failed("register", e)
            except Exception:
                # Never let a bug here take the worker down; it shows in the log and the counters.
                self._counters["link_errors"] += 1
                log.exception("router_link_error", worker_id=self.worker_id)
            self._lease_id = None
            await asyncio.sleep(backoff.next())

    async def _register(self) -> None:
        assert self._stub is not None
        resp = await self._stub.RegisterWorker(self._registration, timeout=self._rpc_timeout_s)
        self._lease_id = resp.lease_id
        self._next_seq = resp.expected_sequence or 1
        if resp.heartbeat_interval_ms:
            self._heartbeat_interval_s = resp.heartbeat_interval_ms / 1000
        self._needs_resync = True  # a new registration starts with no entries in the index
        self._counters["registrations"] += 1
        self._call_ok("register")
        log.info(
            "router_registered",
            worker_id=self.worker_id,
            lease_ttl_ms=resp.lease_ttl_ms,
            expected_sequence=self._next_seq,
        )

    async def _session(self) -> None:
        """Heartbeats and the publisher side by side until one of them gives up."""
        tasks = [asyncio.create_task(self._heartbeat_loop()), asyncio.create_task(self._publish_loop())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def report(self, timeout_s: float | None = None) -> bool:
        """Heartbeat at once and wait until the router has acknowledged a heartbeat whose load was taken
        after this call: True; False if ``timeout_s`` (default: the RPC timeout) passed first (the router
        down: the worker serves on).
        A change routing must see before the caller answers its own client (an adapter loaded: the next
        request naming it must find this worker)."""
        if self._report is None or self._acked is None:
            return False
        want = self._heartbeats_built + 1  # a heartbeat built before now may not carry the change
        self._report.set()
        async with self._acked:
            try:
                acked = self._acked.wait_for(lambda: self._heartbeat_acked >= want)
                await asyncio.wait_for(acked, timeout_s if timeout_s is not None else self._rpc_timeout_s)
            except TimeoutError:
                return False
        return True

    async def _heartbeat_loop(self) -> None:
        assert self._stub is not None and self._wake is not None and self._report is not None
        assert self._acked is not None
        # The first report follows registration at once: the router then knows what this worker serves.
        self._report.set()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._report.wait(), self._heartbeat_interval_s)
            self._report.clear()
            self._heartbeats_built += 1
            built = self._heartbeats_built
            request = router_pb2.HeartbeatRequest(worker_id=self.worker_id, lease_id=self._lease_id, load=self._load())
            try:
                resp = await self._stub.Heartbeat(request, timeout=self._rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    raise _LeaseLost(e.details() or "lease unknown") from e
                self._call_failed("heartbeat", e)
                continue  # the next heartbeat is the retry; the router decides whether the lease survived
            self._call_ok("heartbeat")
            async with self._acked:
                self._heartbeat_acked = built
                self._acked.notify_all()
            if resp.reregister_required:
                raise _LeaseLost("heartbeat: reregister required")
            self._counters["heartbeats"] += 1
            if resp.resync_required and not self._needs_resync:
                self._counters["resyncs_requested"] += 1
                self._needs_resync = True
                self._wake.set()

    def _load(self) -> worker_pb2.WorkerLoad:
        try:
            return self._load_fn()
        except Exception:
            self._counters["load_errors"] += 1
            log.exception("worker_load_failed", worker_id=self.worker_id)
            return worker_pb2.WorkerLoad()

    async def _publish_loop(self) -> None:
        assert self._wake is not None
        backoff = Backoff(*self._backoff)
        while True:
            if self._queue.take_overflow():
                log.warning("kv_events_dropped", worker_id=self.worker_id, reason="queue full; resyncing")
                self._needs_resync = True
            if self._batch is None and not self._needs_resync:
                self._wake.clear()
                self._batch = self._queue.take_batch(self._max_batch_hashes) or None
                if self._batch is None:
                    await self._wake.wait()
                    continue
            call = "resync" if self._needs_resync else "publish"
            try:
                if self._needs_resync:
                    await self._resync()
                else:
                    await self._send_batch()
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    raise _LeaseLost(e.details() or "lease unknown") from e
                self._call_failed(call, e)
                if call == "publish" and e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    # Retrying the same batch would fail forever; a snapshot replaces it.
                    self._batch = None
                    self._needs_resync = True
                await asyncio.sleep(backoff.next())
                continue
            self._call_ok(call)
            backoff.reset()

    async def _send_batch(self) -> None:
        assert self._stub is not None and self._batch is not None
        seq = self._next_seq
        resp = await self._stub.PublishKVEvents(
            router_pb2.PublishKVEventsRequest(
                worker_id=self.worker_id,
                lease_id=self._lease_id,
                sequence=seq,
                events=[e.to_proto() for e in self._batch],
            ),
            timeout=self._rpc_timeout_s,
        )
        if resp.accepted:
            self._counters["batches_published"] += 1
            self._counters["events_published"] += sum(len(e.hashes) for e in self._batch)
            self._batch = None
            self._next_seq = seq + 1
        else:
            # A gap, or the router lost its state: a snapshot, then this batch again.
            self._counters["resyncs_requested"] += 1
            log.info("router_resync_required", worker_id=self.worker_id, sequence=seq)
            self._needs_resync = True

    async def _resync(self) -> None:
        assert self._stub is not None
        snapshot = await self._snapshot()
        seq = self._next_seq - 1  # the router expects the batch in hand (if any) next
        resp = await self._stub.ResyncWorker(self._resync_requests(snapshot, seq), timeout=self._resync_timeout_s)
        self._needs_resync = False
        self._counters["resyncs"] += 1
        log.info("router_resynced", worker_id=self.worker_id, indexed_blocks=resp.indexed_blocks, sequence=seq)

    async def _snapshot(self) -> dict[int, list[BlockHash]]:
        if inspect.iscoroutinefunction(self._snapshot_fn):
            snapshot = await self._snapshot_fn()
        else:
            snapshot = await asyncio.to_thread(self._snapshot_fn)
        return {tier: list(hashes) for tier, hashes in snapshot.items()}

    async def _resync_requests(
        self, snapshot: dict[int, list[BlockHash]], seq: int
    ) -> AsyncIterator[router_pb2.ResyncWorkerRequest]:
        # At least one message, so even an empty snapshot names the worker and its sequence.
        parts = [
            (tier, hashes[i : i + self._resync_chunk_hashes])
            for tier, hashes in snapshot.items()
            for i in range(0, max(len(hashes), 1), self._resync_chunk_hashes)
        ]
        for tier, hashes in parts or [(kv_pb2.KV_TIER_UNSPECIFIED, [])]:
            yield router_pb2.ResyncWorkerRequest(
                worker_id=self.worker_id, lease_id=self._lease_id, sequence=seq, tier=tier, block_hashes=hashes
            )

    # -- failures, for the logs ------------------------------------------------

    def _call_failed(self, call: str, e: grpc.aio.AioRpcError) -> None:
        self._counters[f"{call}_failures"] += 1
        if call in self._failing:
            log.debug("router_call_failed", call=call, worker_id=self.worker_id, code=e.code().name)
            return
        self._failing.add(call)
        transient = e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        (log.warning if transient else log.error)(
            "router_call_failing", call=call, worker_id=self.worker_id, code=e.code().name, error=e.details()
        )

    def _call_ok(self, call: str) -> None:
        if call in self._failing:
            self._failing.discard(call)
            log.info("router_call_recovered", call=call, worker_id=self.worker_id)
