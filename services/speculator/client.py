"""``SpeculatorProposer``: the decode worker's side of the speculator's Propose stream.

The engine calls ``propose`` synchronously on its own thread once per step;
the stream lives on the decode service's asyncio loop. One long-lived
stream carries every sequence, one UpdateBatch per step: each sequence's
update sends only the tokens appended since the last one (the first sends
the whole context) and how many of the previous drafts were accepted.
``propose`` then waits for the answers for at most the latency budget:
whatever has not arrived by then is dropped (an answer is matched by
request id *and* context length, so a late one can never land on a later
step), and the step runs without it.

Never in decode's way: while the speculator is unreachable ``propose``
returns ``{}`` at once, the stream is reopened in the background with
backoff, and the ``kvmesh_speculator_client_connected`` gauge and a log line
say so. After a reconnect every sequence is sent whole again, since the
speculator's state for the old stream is gone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from kvmesh.api.speculator.v1 import speculator_pb2, speculator_pb2_grpc
from kvmesh.runtime import create_channel
from kvmesh.speculation.tracking import ContextTracker

if TYPE_CHECKING:
    from kvmesh.engine.sequence import Sequence

log = structlog.get_logger(__name__)

_CONNECT_TIMEOUT_S = 1.0
_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 2.0
# A stream that stayed open this long was healthy: retry quickly after it ends.
_STABLE_STREAM_S = 1.0


class _ClientMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.connected = Gauge(
            "kvmesh_speculator_client_connected",
            "1 while the Propose stream to the speculator is open.",
            registry=registry,
        )
        self.connect_failures = Counter(
            "kvmesh_speculator_client_connect_failures",
            "Attempts to open the Propose stream that failed.",
            registry=registry,
        )
        self.offline_steps = Counter(
            "kvmesh_speculator_client_offline_steps",
            "Engine steps that wanted drafts while the speculator was down.",
            registry=registry,
        )
        self.late_updates = Counter(
            "kvmesh_speculator_client_late_updates",
            "Draft requests whose answer missed the step's budget.",
            registry=registry,
        )
        self.draft_tokens = Counter(
            "kvmesh_speculator_client_draft_tokens", "Draft tokens received within the budget.", registry=registry
        )


class _Step:
    """One ``propose`` call's outstanding questions and the answers so far."""

    __slots__ = ("expected", "answers", "done")

    def __init__(self, expected: dict[str, int]) -> None:
        self.expected = expected  # request id -> context length the draft must continue
        self.answers: dict[str, list[int]] = {}
        self.done = threading.Event()


class SpeculatorProposer:
    """A ``DraftProposer`` (kvmesh.speculation.drafter) backed by the speculator service at ``address``.

    ``await start()`` on the loop that will carry the stream (it returns at
    once; connecting happens in the background), ``await close()`` on the
    same loop after the engine has stopped stepping.
    """

    def __init__(self, address: str, *, budget_ms: float = 5.0, registry: CollectorRegistry | None = None) -> None:
        if budget_ms <= 0:
            raise ValueError(f"the draft budget must be positive, got {budget_ms} ms")
        self.address = address
        self.budget_s = budget_ms / 1000
        self._deadline_us = max(1, round(budget_ms * 1000))
        self._metrics = _ClientMetrics(registry if registry is not None else CollectorRegistry())
        self._tracker = ContextTracker()  # engine thread only
        self._lock = threading.Lock()  # guards _step between the engine thread and the loop
        self._step: _Step | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._task: asyncio.Task[None] | None = None
        # Written on the loop only; the engine thread reads them (atomic in CPython).
        self._connected = False
        self._epoch = 0  # one per stream: the speculator-side state the tracker refers to
        self._outbox: asyncio.Queue[speculator_pb2.ProposeRequest] | None = None

    @property
    def connected(self) -> bool:
        return self._connected

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._task = self._loop.create_task(self._keep_stream_open(), name="speculator-propose-stream")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # -- the engine thread -----------------------------------------------------

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        """Drafts for as many of ``wants`` as the speculator answers within the budget."""
        ended = self._tracker.ended_unannounced({seq.request_id for seq, _ in wants})
        if self._loop is None or threading.get_ident() == self._loop_thread:
            # (On the loop's own thread, waiting would block the very loop that brings the answers.)
            return {}
        if not self._connected:
            if wants:
                self._metrics.offline_steps.inc()
            return {}
        epoch = self._epoch
        batch = speculator_pb2.UpdateBatch(finished=[_finished(seq.request_id, learn=False) for seq in ended])
        if not wants:
            if batch.finished:
                self._post(epoch, batch)
            return {}
        expected = {}
        for seq, k in wants:
            d = self._tracker.delta(seq, epoch)
            batch.contexts.append(
                speculator_pb2.ContextUpdate(
                    request_id=d.request_id,
                    token_ids=d.new_token_ids,
                    context_length=d.context_length,
                    num_draft_tokens=k,
                    deadline_us=self._deadline_us,
                    accepted_draft_tokens=d.accepted_draft_tokens,
                    # The whole context: the speculator meets the request (again, after a reconnect) here.
                    traceparent=(seq.traceparent or "") if d.context_length == len(d.new_token_ids) else "",
                )
            )
            expected[d.request_id] = d.context_length
        step = _Step(expected)
        with self._lock:
            self._step = step
        if self._post(epoch, batch):
            step.done.wait(self.budget_s)
        with self._lock:
            self._step = None
        if len(step.answers) < len(expected):
            self._metrics.late_updates.inc(len(expected) - len(step.answers))
        drafts = {rid: d for rid, d in step.answers.items() if d}
        self._metrics.draft_tokens.inc(sum(map(len, drafts.values())))
        return drafts

    def finished(self, seq: Sequence) -> None:
        """Send the sequence's last tokens and let the speculator learn from it."""
        epoch = self._epoch
        d = self._tracker.delta(seq, epoch)
        self._tracker.forget(seq.request_id)
        if not self._connected:
            return
        # An aborted request's text was cut short, perhaps for being bad: not worth learning.
        batch = speculator_pb2.UpdateBatch(finished=[_finished(seq.request_id, learn=seq.finish_reason != "abort")])
        if d.new_token_ids or d.accepted_draft_tokens:
            batch.contexts.append(
                speculator_pb2.ContextUpdate(
                    request_id=d.request_id,
                    token_ids=d.new_token_ids,
                    context_length=d.context_length,
                    accepted_draft_tokens=d.accepted_draft_tokens,
                )
            )
        self._post(epoch, batch)

    def _post(self, epoch: int, batch: speculator_pb2.UpdateBatch) -> bool:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._enqueue, epoch, speculator_pb2.ProposeRequest(batch=batch))
        except RuntimeError:  # the loop is closed: the service is shutting down
            return False
        return True

    # -- the event loop ------------------------------------------------------

    def _enqueue(self, epoch: int, request: speculator_pb2.ProposeRequest) -> None:
        if epoch != self._epoch or self._outbox is None:
            # Meant for a stream that is gone: its answers will never come.
            self._release_step()
            return
        self._outbox.put_nowait(request)

    def _on_answer(self, response: speculator_pb2.ProposeResponse) -> None:
        with self._lock:
            step = self._step
            if step is None:
                return  # late: that step has moved on
            for draft in response.drafts:
                if step.expected.get(draft.request_id) == draft.context_length:
                    step.answers[draft.request_id] = list(draft.token_ids)
            if len(step.answers) == len(step.expected):
                step.done.set()

    def _release_step(self) -> None:
        with self._lock:
            if self._step is not None:
                self._step.done.set()

    async def _keep_stream_open(self) -> None:
        backoff = _MIN_BACKOFF_S
        outage_logged = False
        while True:
            channel = create_channel(self.address, peer="speculator")
            opened_at = None
            try:
                opened_at, error = await self._run_stream(channel)
            except Exception as e:  # never let a surprise end drafting for the life of the worker
                error = repr(e)
                log.exception("speculator stream failed unexpectedly", address=self.address)
            finally:
                self._set_down()
                await channel.close()
            if opened_at is None:
                self._metrics.connect_failures.inc()
                if not outage_logged:
                    log.warning("speculator unreachable: decoding without drafts", address=self.address, error=error)
                    outage_logged = True
            else:
                log.warning(
                    "speculator stream closed: decoding without drafts until it is back",
                    address=self.address,
                    error=error,
                )
                outage_logged = False
                if time.monotonic() - opened_at > _STABLE_STREAM_S:
                    backoff = _MIN_BACKOFF_S
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    async def _run_stream(self, channel: grpc.aio.Channel) -> tuple[float | None, str | None]:
        """Open a stream and carry it until it ends: (when it opened, or None; why it ended)."""
        try:
            await asyncio.wait_for(channel.channel_ready(), _CONNECT_TIMEOUT_S)
        except TimeoutError:
            return None, "connect timeout"
        outbox: asyncio.Queue[speculator_pb2.ProposeRequest] = asyncio.Queue()

        async def requests() -> AsyncIterator[speculator_pb2.ProposeRequest]:
            while True:
                yield await outbox.get()

        call = speculator_pb2_grpc.SpeculatorServiceStub(channel).Propose(requests())
        opened_at = time.monotonic()
        self._epoch += 1
        self._outbox = outbox
        self._connected = True
        self._metrics.connected.set(1)
        log.info("speculator stream open", address=self.address)
        try:
            async for response in call:
                self._on_answer(response)
        except grpc.aio.AioRpcError as e:
            return opened_at, e.code().name
        return opened_at, None

    def _set_down(self) -> None:
        self._connected = False
        self._outbox = None
        self._metrics.connected.set(0)
        self._release_step()


def _finished(request_id: str, learn: bool) -> speculator_pb2.RequestFinished:
    return speculator_pb2.RequestFinished(request_id=request_id, learn=learn)
