"""What a speculator already knows of each engine sequence, so updates carry only news.

Used on the engine thread by both proposers (``client.SpeculatorProposer``,
``local.LocalProposer``). A sequence only ever grows (drafts live outside its
token list until accepted), so "what is new" is the tail past the tokens
already sent. The ``epoch`` names the speculator-side state the counts refer
to: a reconnected stream starts a new one, and every sequence is then sent
whole again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the engine pulls in torch; the speculator service must not
    from kvmesh.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class Delta:
    request_id: str
    new_token_ids: list[int]
    context_length: int
    # Draft tokens accepted since the last report.
    accepted_draft_tokens: int


@dataclass(slots=True)
class _Known:
    seq: Sequence
    epoch: int
    sent_tokens: int
    reported_accepted: int


class ContextTracker:
    def __init__(self) -> None:
        self._known: dict[str, _Known] = {}

    def __len__(self) -> int:
        return len(self._known)

    def delta(self, seq: Sequence, epoch: int) -> Delta:
        """The update that brings the speculator up to date with ``seq``; marks it sent."""
        known = self._known.get(seq.request_id)
        if known is None or known.seq is not seq:
            known = self._known[seq.request_id] = _Known(seq, epoch, 0, 0)
        elif known.epoch != epoch:
            known.epoch, known.sent_tokens = epoch, 0
        n_prompt = len(seq.prompt_ids)
        start = known.sent_tokens
        if start < n_prompt:
            new = seq.prompt_ids[start:] + seq.output_ids
        else:
            new = seq.output_ids[start - n_prompt :]
        known.sent_tokens = start + len(new)
        accepted = seq.num_draft_accepted - known.reported_accepted
        known.reported_accepted = seq.num_draft_accepted
        return Delta(seq.request_id, new, known.sent_tokens, accepted)

    def forget(self, request_id: str) -> None:
        self._known.pop(request_id, None)

    def ended_unannounced(self, wanted: set[str]) -> list[Sequence]:
        """Sequences that finished without ``finished`` being called (an engine abort),
        forgotten here: their speculator state must be dropped too."""
        gone = [k.seq for rid, k in self._known.items() if rid not in wanted and k.seq.is_finished]
        for seq in gone:
            del self._known[seq.request_id]
        return gone
