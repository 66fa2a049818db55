"""``LocalProposer``: the speculator core in the engine's own process.

For an engine with no speculator service to talk to (tests, ``kvmesh
generate --speculate``, a decode worker started without an address). It is
a ``DraftProposer`` (kvmesh.speculation.drafter), called on the engine thread; the core works
in microseconds, so drafts are always on time.

With an EAGLE head (``kvmesh.speculation.eagle``) it merges three sources per
step under the core's rule: the request's own context, the shared suffix
index, and the head, whose drafts count as a match of
``draft_model_match_tokens`` (``EAGLE_MATCH_TOKENS`` unless configured): a
long n-gram match (a passage being repeated) wins, the head otherwise. The
head is run, batched, only for the requests where it could win.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvmesh.speculation.candidate import Source
from kvmesh.speculation.speculator import Speculator, SpeculatorConfig
from kvmesh.speculation.tracking import ContextTracker

if TYPE_CHECKING:
    from kvmesh.engine.model import CausalLM
    from kvmesh.engine.sequence import Sequence
    from kvmesh.speculation.eagle import EagleProposer

# The n-gram match length an EAGLE draft counts as: shorter matches are likelier chance
# than a repeated passage. Not tuned yet: on bench/speculation.py's held-out prompts
# (SmolLM2-135M-Instruct, models/smollm2-eagle) the head won every step at 8, and its
# tokens per step beat prompt lookup's on code, chat and prose alike.
EAGLE_MATCH_TOKENS = 8


class LocalProposer:
    def __init__(self, config: SpeculatorConfig | None = None, head: EagleProposer | None = None) -> None:
        config = config or SpeculatorConfig()
        if head is not None and config.draft_model_match_tokens is None:
            config = dataclasses.replace(config, draft_model_match_tokens=EAGLE_MATCH_TOKENS)
        self.speculator = Speculator(config)
        self.head = head
        self.wants_features = head is not None
        self._session = self.speculator.open_session()
        self._tracker = ContextTracker()

    def bind(self, model: CausalLM) -> None:
        if self.head is not None:
            self.head.bind(model)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers if self.head is not None else ()

    def draft_seconds(self, k: int) -> float:
        """The head's drafting time (the core's n-gram sources take microseconds)."""
        return self.head.draft_seconds(k) if self.head is not None else 0.0

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        for seq in self._tracker.ended_unannounced({seq.request_id for seq, _ in wants}):
            self._session.finish(seq.request_id, learn=False)
        plans = []
        for seq, k in wants:
            self._apply(seq)
            plan = self._session.plan(seq.request_id, k)
            if plan is not None:
                plans.append((seq, plan))
        asked = [(seq, plan.num_tokens) for seq, plan in plans if plan.model_context is not None]
        head_drafts = self.head.draft(asked) if self.head is not None and asked else {}
        drafts = {}
        for seq, plan in plans:
            head_draft = head_drafts.get(seq.request_id, [])
            candidate = self._session.decide(plan, head_draft, model_source=Source.EAGLE)
            if candidate is not None:
                # The head's own list when it won: sampled drafts carry their distributions.
                drafts[seq.request_id] = head_draft if candidate.source is Source.EAGLE else candidate.token_ids
        return drafts

    def finished(self, seq: Sequence) -> None:
        self._apply(seq)
        self._tracker.forget(seq.request_id)
        # An aborted request's text was cut short, perhaps for being bad: not worth learning.
        self._session.finish(seq.request_id, learn=seq.finish_reason != "abort")

    def _apply(self, seq: Sequence) -> None:
        d = self._tracker.delta(seq, epoch=0)
        self._session.update(d.request_id, d.new_token_ids, d.context_length, d.accepted_draft_tokens)
