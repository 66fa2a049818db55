"""The speculator core: draft tokens for running sequences, and how well they do.

Two sources propose a continuation of a request's context:

1. prompt lookup in the request's own context (``prompt_lookup``);
2. the shared suffix index learned from finished sequences (``suffix_index``).

The rule between them (``candidate.better``): the candidate whose match with
the context's tail is longer wins (measured up to 32 tokens, past the
n-gram that found it), then the longer draft, then the request's own context.

A third source is optional: a draft model's greedy continuation (the
service's ``--draft-model``). The core does not run it: ``Session.plan``
says which requests it should continue, the caller runs the model on all
of a round's in one batch, and ``Session.decide`` picks. Under the same rule the model's
draft counts as a match of ``draft_model_match_tokens``: an n-gram candidate
matching at least that much of the context's tail (with a draft as long) is a
repeated passage and wins; a shorter match, likelier to be chance, loses to
the model's draft. The model is asked only when its draft could win.

A ``Session`` is one decode worker's stream: it holds the per-request state
(so two workers may use the same request id), fed incrementally by
``update`` and dropped by ``finish`` or when the stream ends (``close``).
Proposed/accepted counters are shared across sessions. Not thread-safe: the
server calls it from its event loop, ``LocalProposer`` from the engine thread
(the service's draft model runs on a thread of its own, on copies of contexts).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass

import structlog

from kvmesh.errors import InvalidArgument
from kvmesh.speculation.candidate import MAX_MATCH_TOKENS, Candidate, Source, better
from kvmesh.speculation.prompt_lookup import RequestContext
from kvmesh.speculation.suffix_index import SuffixIndex

log = structlog.get_logger(__name__)


# The n-gram match length a draft model's draft counts as, unless configured
# (SpeculatorConfig.draft_model_match_tokens): where its acceptance fell between
# the n-gram drafts' by match length (docs/measurements.md).
DRAFT_MODEL_MATCH_TOKENS = 9


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
    # None: no draft model. Otherwise a draft model's draft counts as a match of
    # this many tokens against the n-gram candidates (see the module docstring).
    draft_model_match_tokens: int | None = None
    # N-gram drafts matching fewer tokens of the context's tail are not proposed: for decode
    # workers that run an EAGLE head beside the target, which drafts wherever this answers nothing.
    min_match_tokens: int = 0
    # The n-gram sources that propose (both by default; one alone to measure it on its own).
    ngram_sources: frozenset[Source] = frozenset({Source.PROMPT, Source.SUFFIX})
    # Opt-in (None: no data kept): append every learned sequence's tokens to this JSONL file,
    # ``{"token_ids": [...]}`` a line, so ``kvmesh train-speculator --data traffic=PATH`` can
    # train a head on this deployment's own traffic.
    retain_traffic: str | None = None

    def __post_init__(self) -> None:
        if self.max_draft_tokens < 1:
            raise ValueError("max_draft_tokens must be at least 1")
        if self.draft_model_match_tokens is not None and not 0 <= self.draft_model_match_tokens <= MAX_MATCH_TOKENS:
            raise ValueError(f"draft_model_match_tokens must be between 0 and {MAX_MATCH_TOKENS}")


@dataclass(frozen=True, slots=True)
class DraftPlan:
    """One request's draft, half decided: what the n-gram sources found, and what
    (if anything) the draft model should continue before ``Session.decide``."""

    request_id: str
    num_tokens: int  # the draft length wanted, capped at max_draft_tokens
    ngram: Candidate | None
    # A copy of the request's known tokens, for the draft model to continue (its
    # own thread may read it while the context grows); None: the n-gram candidate
    # cannot lose to the model, or there is no model.
    model_context: list[int] | None


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
    # Draft tokens proposed / accepted, by the source that proposed them.
    proposed_by_source: dict[str, int]
    accepted_by_source: dict[str, int]

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
        self._proposed_by_source: Counter[str] = Counter()
        self._accepted_by_source: Counter[str] = Counter()

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
            proposed_by_source={s.value: self._proposed_by_source[s.value] for s in Source},
            accepted_by_source={s.value: self._accepted_by_source[s.value] for s in Source},
        )

    def maintain_index(self, max_tokens: int | None = None) -> bool:
        """Evict/index about ``max_tokens`` positions of the shared index's backlog; True if more is left."""
        return self.suffix_index.maintain(max_tokens)

    def draft(self, context: RequestContext, k: int) -> Candidate | None:
        """The better of the two n-gram sources' continuations of ``context`` (at most k tokens)."""
        k = min(k, self.config.max_draft_tokens)
        if k <= 0 or not context.tokens:
            return None
        own = context.lookup(k) if Source.PROMPT in self.config.ngram_sources else None
        shared = (
            self.suffix_index.lookup(context.tokens[-MAX_MATCH_TOKENS:], k)
            if Source.SUFFIX in self.config.ngram_sources
            else None
        )
        candidate = better(own, shared)
        return candidate if candidate is not None and candidate.match_length >= self.config.min_match_tokens else None

    def model_candidate(self, token_ids: list[int], source: Source = Source.DRAFT_MODEL) -> Candidate | None:
        """A model's draft (a draft model's, or an EAGLE head's) as a candidate (None when
        there is no model or no draft)."""
        match_tokens = self.config.draft_model_match_tokens
        if match_tokens is None or not token_ids:
            return None
        return Candidate(token_ids, source, match_tokens)

    def learn(self, tokens: list[int]) -> None:
        """Add a finished sequence to the shared index (indexed now unless ``defer_indexing``)."""
        if self.config.retain_traffic is not None and tokens:
            with open(self.config.retain_traffic, "a") as f:
                f.write(json.dumps({"token_ids": list(tokens)}) + "\n")
        if self.suffix_index.learn(tokens) and not self.config.defer_indexing:
            self.suffix_index.maintain()

    def _count_proposal(self, candidate: Candidate) -> None:
        self.proposed_tokens += len(candidate.token_ids)
        self._proposals[candidate.source.value] += 1
        self._proposed_by_source[candidate.source.value] += len(candidate.token_ids)

    def _discard(self, session: Session) -> None:
        self._sessions.discard(session)


class Session:
    """One decode worker's requests. Get one from ``Speculator.open_session``."""

    def __init__(self, speculator: Speculator) -> None:
        self._spec = speculator
        self._requests: dict[str, RequestContext] = {}
        # The source of each request's last proposal: its accepted tokens are credited to it.
        self._last_source: dict[str, Source] = {}

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
                f"request {request_id!r}: context_length {context_length} is less than the {len(token_ids)} tokens sent"
            )
        self._spec.accepted_tokens += accepted_draft_tokens
        source = self._last_source.pop(request_id, None)
        if source is not None and accepted_draft_tokens:
            self._spec._accepted_by_source[source.value] += accepted_draft_tokens
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
        """Draft up to ``num_tokens`` tokens continuing the request's context, from the
        n-gram sources only (``plan`` + ``decide`` bring in a draft model).

        None when there is nothing to propose, the request is unknown, or
        ``deadline_ns`` (a ``time.perf_counter_ns()`` value) passed before the
        draft was ready: a late draft is useless to the decode step, so it is
        not counted as proposed.
        """
        plan = self.plan(request_id, num_tokens, deadline_ns)
        return None if plan is None else self.decide(plan, [], deadline_ns)

    def plan(self, request_id: str, num_tokens: int, deadline_ns: int | None = None) -> DraftPlan | None:
        """The n-gram candidate for the request, and whether the draft model should be asked:
        only when the speculator has one and its full-length draft would beat that candidate.
        None when the request is unknown or ``deadline_ns`` already passed (counted as late)."""
        ctx = self._requests.get(request_id)
        if ctx is None:
            return None
        if deadline_ns is not None and time.perf_counter_ns() > deadline_ns:
            self._spec.late_drafts += 1
            return None
        spec = self._spec
        k = min(num_tokens, spec.config.max_draft_tokens)
        ngram = spec.draft(ctx, k)
        best_model_case = spec.model_candidate([0] * k)  # a full-length draft: the most the model can offer
        wants_model = bool(ctx.tokens) and best_model_case is not None and better(ngram, best_model_case) is not ngram
        return DraftPlan(request_id, k, ngram, list(ctx.tokens) if wants_model else None)

    def decide(
        self,
        plan: DraftPlan,
        model_draft: list[int],
        deadline_ns: int | None = None,
        model_source: Source = Source.DRAFT_MODEL,
    ) -> Candidate | None:
        """The draft to send: the better of the plan's n-gram candidate and ``model_draft``
        (the model's tokens for ``plan.model_context``; empty when it was not asked
        or had none). None when there is nothing to propose or the deadline passed."""
        candidate = better(plan.ngram, self._spec.model_candidate(model_draft[: plan.num_tokens], model_source))
        if candidate is None or not candidate.token_ids:
            return None
        if deadline_ns is not None and time.perf_counter_ns() > deadline_ns:
            self._spec.late_drafts += 1
            return None
        self._spec._count_proposal(candidate)
        self._last_source[plan.request_id] = candidate.source
        return candidate

    def finish(self, request_id: str, learn: bool) -> None:
        """Drop a request's state; with ``learn``, add its tokens to the shared index first."""
        ctx = self._requests.pop(request_id, None)
        self._last_source.pop(request_id, None)
        if ctx is not None and learn:
            self._spec.learn(ctx.tokens)

    def close(self) -> None:
        """The stream ended: forget its unfinished requests (they taught nothing)."""
        self._requests.clear()
        self._last_source.clear()
        self._spec._discard(self)
