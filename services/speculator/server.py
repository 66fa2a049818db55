"""The speculator's gRPC servicer: a thin layer over ``Speculator`` sessions.

Each ``Propose`` stream is one decode worker: a ``Session`` lives exactly as
long as the stream. Every ContextUpdate that asks for drafts is answered, an
empty draft included (the decode step then stops waiting at once), except
when the answer would be later than the update's deadline: then it is not
sent at all, since the step has moved on. A single update gets a
ProposeResponse of its own; an UpdateBatch (one decode step) gets one
ProposeResponse whose ``drafts`` answer its updates.

With a draft model (``DraftModelWorker``), the updates of one message that
the n-gram sources cannot answer well are continued by the model in one
batched call on its own thread; the stream's next message waits for that
call, at most until the message's deadline, and other streams are served
meanwhile.

On shutdown ``drain`` ends the open streams (the decode workers reconnect
elsewhere or run without drafts) instead of letting them hold the server for
the whole grace period, and refuses new ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import TYPE_CHECKING

import grpc

from kvmesh.api.common.v1 import accounting_pb2
from kvmesh.api.speculator.v1 import speculator_pb2, speculator_pb2_grpc
from kvmesh.errors import InvalidArgument
from kvmesh.speculation.speculator import Session, Speculator
from services.speculator.maintenance import IndexMaintainer
from services.speculator.request_spans import RequestSpans

if TYPE_CHECKING:  # it pulls in torch, which a speculator without a draft model never loads
    from services.speculator.draft_worker import DraftModelWorker

_END = object()  # the client finished writing, or the server is draining


class SpeculatorServicer(speculator_pb2_grpc.SpeculatorServiceServicer):
    def __init__(
        self, speculator: Speculator, maintainer: IndexMaintainer, draft_model: DraftModelWorker | None = None
    ) -> None:
        if (draft_model is None) != (speculator.config.draft_model_match_tokens is None):
            raise ValueError("a draft model needs draft_model_match_tokens in the speculator's config, and only one")
        self._spec = speculator
        self._maintainer = maintainer
        self._draft_model = draft_model
        self._inboxes: set[asyncio.Queue] = set()
        self._draining = False

    async def Propose(
        self, request_iterator: AsyncIterator[speculator_pb2.ProposeRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[speculator_pb2.ProposeResponse]:
        if self._draining:
            return
        inbox: asyncio.Queue = asyncio.Queue()
        self._inboxes.add(inbox)
        reader = asyncio.create_task(_read_into(request_iterator, inbox))
        session = self._spec.open_session()
        spans = RequestSpans()
        try:
            while (item := await inbox.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                received_ns, request = item
                response = await self._handle(session, spans, request, received_ns)
                if response is not None:
                    yield response
        finally:
            reader.cancel()
            self._inboxes.discard(inbox)
            session.close()
            spans.close()

    async def _handle(
        self, session: Session, spans: RequestSpans, request: speculator_pb2.ProposeRequest, received_ns: int
    ) -> speculator_pb2.ProposeResponse | None:
        kind = request.WhichOneof("update")
        if kind == "batch":
            batch = request.batch
            for update in batch.contexts:
                _apply(session, spans, update)
            wanting = [update for update in batch.contexts if update.num_draft_tokens]
            drafts = [draft for draft in await self._drafts(session, spans, wanting, received_ns) if draft is not None]
            self._finish(session, spans, batch.finished)
            return speculator_pb2.ProposeResponse(drafts=drafts, timings=_timings(received_ns)) if drafts else None
        if kind == "context":
            update = request.context
            _apply(session, spans, update)
            if not update.num_draft_tokens:
                return None
            (draft,) = await self._drafts(session, spans, [update], received_ns)
            if draft is None:
                return None
            return speculator_pb2.ProposeResponse(
                request_id=draft.request_id,
                context_length=draft.context_length,
                draft_token_ids=draft.token_ids,
                timings=_timings(received_ns),
            )
        if kind == "finished":
            self._finish(session, spans, [request.finished])
            return None
        raise InvalidArgument("ProposeRequest carries no update")

    async def _drafts(
        self,
        session: Session,
        spans: RequestSpans,
        updates: Sequence[speculator_pb2.ContextUpdate],
        received_ns: int,
    ) -> list[speculator_pb2.Draft | None]:
        """The answers to ``updates`` (each asking for drafts), in order: a draft (empty when there
        is nothing to propose), or None when its deadline passed: no answer beats a late one."""
        deadlines = [received_ns + u.deadline_us * 1000 if u.deadline_us else None for u in updates]
        plans = [session.plan(u.request_id, u.num_draft_tokens, d) for u, d in zip(updates, deadlines)]
        asks = [(p, d) for p, d in zip(plans, deadlines) if p is not None and p.model_context is not None]
        model_drafts: dict[str, list[int]] = {}
        if asks:
            # One call for the whole message, awaited until the last of its deadlines.
            latest = None if any(d is None for _, d in asks) else max(d for _, d in asks)
            model_drafts = await self._draft_model.draft([p for p, _ in asks], latest)
        answers: list[speculator_pb2.Draft | None] = []
        for update, deadline_ns, plan in zip(updates, deadlines, plans):
            candidate = (
                None if plan is None else session.decide(plan, model_drafts.get(plan.request_id, []), deadline_ns)
            )
            if deadline_ns is not None and time.perf_counter_ns() > deadline_ns:
                answers.append(None)
                continue
            if candidate is not None:
                spans.proposed(update.request_id, candidate.source.value, len(candidate.token_ids))
            answers.append(
                speculator_pb2.Draft(
                    request_id=update.request_id,
                    context_length=update.context_length,
                    token_ids=candidate.token_ids if candidate is not None else [],
                )
            )
        return answers

    def _finish(
        self, session: Session, spans: RequestSpans, finished: Iterable[speculator_pb2.RequestFinished]
    ) -> None:
        learned = False
        for f in finished:
            session.finish(f.request_id, f.learn)
            spans.finish(f.request_id)
            learned |= f.learn
        if learned:
            self._maintainer.wake()

    async def Stats(
        self, request: speculator_pb2.StatsRequest, context: grpc.aio.ServicerContext
    ) -> speculator_pb2.StatsResponse:
        stats = self._spec.stats()
        return speculator_pb2.StatsResponse(
            proposed_tokens=stats.proposed_tokens,
            accepted_tokens=stats.accepted_tokens,
            active_requests=stats.active_requests,
            indexed_tokens=stats.indexed_tokens,
        )

    async def drain(self) -> None:
        """End every open stream and refuse new ones (shutdown)."""
        self._draining = True
        for inbox in self._inboxes:
            inbox.put_nowait(_END)


def _apply(session: Session, spans: RequestSpans, update: speculator_pb2.ContextUpdate) -> None:
    session.update(update.request_id, list(update.token_ids), update.context_length, update.accepted_draft_tokens)
    spans.update(update.request_id, update.traceparent, update.accepted_draft_tokens)


def _timings(received_ns: int) -> accounting_pb2.Timings:
    elapsed = time.perf_counter_ns() - received_ns
    return accounting_pb2.Timings(compute_ns=elapsed, total_ns=elapsed)


async def _read_into(request_iterator: AsyncIterator[speculator_pb2.ProposeRequest], inbox: asyncio.Queue) -> None:
    """Move the client's messages into ``inbox``, stamped with when they arrived."""
    try:
        async for request in request_iterator:
            inbox.put_nowait((time.perf_counter_ns(), request))
    except asyncio.CancelledError:
        raise
    except Exception as e:  # the stream broke: the handler re-raises it as the RPC's end
        inbox.put_nowait(e)
        return
    inbox.put_nowait(_END)
