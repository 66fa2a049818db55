"""The speculator core: draft tokens for running sequences, and how well they do.

Two sources propose a continuation of a request's context:

1. prompt lookup in the request's own context (``prompt_lookup``);
2. the shared suffix index learned from finished sequences (``suffix_index``).

The rule between them (``candidate.better``): the candidate whose match with
the context's tail is longer wins (measured up to 32 tokens, past the
n-gram that found it), then the longer draft, then the request's own context.

A ``Session`` is one decode worker's stream: it holds the per-request state
(so two workers may use the same request id), fed incrementally by
``update`` and dropped by ``finish`` or when the stream ends (``close``).
Proposed/accepted counters are shared across sessions. Not thread-safe: the
server calls it from its event loop, ``LocalProposer`` from the engine thread.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import structlog

from kvmesh.errors import InvalidArgument
from services.speculator.candidate import MAX_MATCH_TOKENS, Candidate, Source, better
from services.speculator.prompt_lookup import RequestContext
from services.speculator.suffix_index import SuffixIndex

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SpeculatorConfig:
    # Prompt lookup: n-gram sizes tried in the request's own context. Single
    # tokens repeat by chance in any text, so 2 is the shortest trusted match.
    prompt_ngram_sizes: tuple[int, ...] = (4, 3, 2)
    # The shared index: other requests' text needs a longer match to be trusted.
    # Each size costs ~120 bytes per held token; the match length is measured
    # past the n-gram anyway, so a few anchors do the work of every size.
    suffix_ngram_sizes: tuple[int, ...] = (16, 8, 4)
    max_draft_tokens: int = 8
    # Tokens held in the shared index (~400 MB of index for 1M at the default sizes).
    suffix_capacity_tokens: int = 1_000_000
    # False: learned sequences are indexed at once (in-process use); True: the
    # caller runs ``maintain_index`` in chunks off the request path (the service).
    defer_indexing: bool = False

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be at least 1")


@dataclass(frozen=True)
class SpeculatorStats:
    proposed_tokens: int
    accepted_tokens: int
    active_requests: int
    indexed_tokens: int
    indexed_sequences: int
    # Learned tokens not indexed yet (see SuffixIndex).
    indexing_backlog_tokens: int
    # Draft requests left unanswered: the update's deadline passed first.
    late_drafts: int
    # Proposals by the source that won.
    proposals: dict[str, int]

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0


class Speculator:
    def __init__(self, config: SpeculatorConfig | None = None) -> None:
        self.config = cfg = config or SpeculatorConfig()
        self.suffix_index = SuffixIndex(cfg.suffix_ngram_sizes, cfg.suffix_capacity_tokens)
        # Validates the prompt sizes now rather than at the first request.
        RequestContext(cfg.prompt_ngram_sizes)
        self._sessions: set[Session] = set()
        self.proposed_tokens = 0
        self.accepted_tokens = 0
        self.late_drafts = 0
        self._proposals: Counter[str] = Counter()

    def open_session(self) -> Session:
        session = Session(self)
        self._sessions.add(session)
        return session

    def stats(self) -> SpeculatorStats:
        return SpeculatorStats(
            proposed_tokens=self.proposed_tokens,
            accepted_tokens=self.accepted_tokens,
            active_requests=sum(s.num_requests for s in self._sessions),
            indexed_tokens=self.suffix_index.indexed_tokens,
            indexed_sequences=self.suffix_index.num_sequences,
            indexing_backlog_tokens=self.suffix_index.backlog_tokens,
            late_drafts=self.late_drafts,
            proposals={s.value: self._proposals[s.value] for s in Source},
        )

    def maintain_index(self, max_tokens: int | None = None) -> bool:
        """Evict/index about ``max_tokens`` positions of the shared index's backlog; True if more is left."""
        return self.suffix_index.maintain(max_tokens)

    def draft(self, context: RequestContext, k: int) -> Candidate | None:
        """The better of the two sources' continuations of ``context`` (at most k tokens)."""
        k = min(k, self.config.max_draft_tokens)
        if k <= 0 or not context.tokens:
            return None
        own = context.lookup(k)
        shared = self.suffix_index.lookup(context.tokens[-MAX_MATCH_TOKENS:], k)
        return better(own, shared)

    def learn(self, tokens: list[int]) -> None:
        """Add a finished sequence to the shared index (indexed now unless ``defer_indexing``)."""
        if self.suffix_index.learn(tokens) and not self.config.defer_indexing:
            self.suffix_index.maintain()

    def _count_proposal(self, candidate: Candidate) -> None:
        self.proposed_tokens += len(candidate.token_ids)
        self._proposals[candidate.source.value] += 1

    def _discard(self, session: Session) -> None:
        self._sessions.discard(session)


class Session:
    """One decode worker's requests. Get one from ``Speculator.open_session``."""

    def __init__(self, speculator: Speculator) -> None:
        self._spec = speculator
        self._requests: dict[str, RequestContext] = {}

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def update(
        self, request_id: str, token_ids: list[int], context_length: int, accepted_draft_tokens: int = 0
    ) -> None:
        """Append a request's new tokens; ``context_length`` is its length afterwards.

        A length that does not continue what this session knows (a first update
        for the request, a decode worker that reconnected and resends, or a lost
        update) restarts the request's state from ``token_ids``: drafts then come
        from the part of the context seen, and stay positioned correctly.
        """
        if not request_id:
            raise InvalidArgument("context update without a request_id")
        if context_length < len(token_ids):
            raise InvalidArgument(
                f"request {request_id!r}: context_length {context_length} is less than the "
                f"{len(token_ids)} tokens sent"
            )
        self._spec.accepted_tokens += accepted_draft_tokens
        cfg = self._spec.config
        ctx = self._requests.get(request_id)
        if ctx is None or ctx.length + len(token_ids) != context_length:
            if ctx is not None:
                log.warning(
                    "context out of step: restarting request state",
                    request=request_id,
                    known=ctx.length,
                    sent=len(token_ids),
                    context_length=context_length,
                )
            ctx = self._requests[request_id] = RequestContext(cfg.prompt_ngram_sizes)
            ctx.length = context_length - len(token_ids)
        ctx.extend(token_ids)

    def propose(self, request_id: str, num_tokens: int, deadline_ns: int | None = None) -> Candidate | None:
        """Draft up to ``num_tokens`` tokens continuing the request's context.

        None when there is nothing to propose, the request is unknown, or
        ``deadline_ns`` (a ``time.perf_counter_ns()`` value) passed before the
        draft was ready: a late draft is useless to the decode step, so it is
        not counted as proposed.
        """
        ctx = self._requests.get(request_id)
        if ctx is None:
            return None
        if deadline_ns is not None and time.perf_counter_ns() > deadline_ns:
            self._spec.late_drafts += 1
            return None
        candidate = self._spec.draft(ctx, num_tokens)
        if candidate is None or not candidate.token_ids:
            return None
        if deadline_ns is not None and time.perf_counter_ns() > deadline_ns:
            self._spec.late_drafts += 1
            return None
        self._spec._count_proposal(candidate)
        return candidate

    def finish(self, request_id: str, learn: bool) -> None:
        """Drop a request's state; with ``learn``, add its tokens to the shared index first."""
        ctx = self._requests.pop(request_id, None)
        if ctx is not None and learn:
            self._spec.learn(ctx.tokens)

    def close(self) -> None:
        """The stream ended: forget its unfinished requests (they taught nothing)."""
        self._requests.clear()
        self._spec._discard(self)
