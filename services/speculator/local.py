"""``LocalProposer``: the speculator core in the engine's own process.

For an engine with no speculator service to talk to (tests, ``kvmesh
generate --speculate``, a decode worker started without an address). It is
the engine's ``DraftProposer``, called on the engine thread; the core works
in microseconds, so drafts are always on time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.speculator.core import Speculator, SpeculatorConfig
from services.speculator.tracking import ContextTracker

if TYPE_CHECKING:
    from kvmesh.engine.sequence import Sequence


class LocalProposer:
    def __init__(self, config: SpeculatorConfig | None = None) -> None:
        self.speculator = Speculator(config)
        self._session = self.speculator.open_session()
        self._tracker = ContextTracker()

    def propose(self, wants: list[tuple[Sequence, int]]) -> dict[str, list[int]]:
        for seq in self._tracker.ended_unannounced({seq.request_id for seq, _ in wants}):
            self._session.finish(seq.request_id, learn=False)
        drafts = {}
        for seq, k in wants:
            self._apply(seq)
            candidate = self._session.propose(seq.request_id, k)
            if candidate is not None:
                drafts[seq.request_id] = candidate.token_ids
        return drafts

    def finished(self, seq: Sequence) -> None:
        self._apply(seq)
        self._tracker.forget(seq.request_id)
        # An aborted request's text was cut short, perhaps for being bad: not worth learning.
        self._session.finish(seq.request_id, learn=seq.finish_reason != "abort")

    def _apply(self, seq: Sequence) -> None:
        d = self._tracker.delta(seq, epoch=0)
        self._session.update(d.request_id, d.new_token_ids, d.context_length, d.accepted_draft_tokens)
