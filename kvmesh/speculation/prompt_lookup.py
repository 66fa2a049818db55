"""Prompt lookup: drafts copied from earlier in the request's own context.

For each configured n, the most recent earlier occurrence of the context's
last n tokens is looked up; of those, the one whose match reaches furthest
back (measured up to 32 tokens) wins, and the tokens that followed it are
the draft. The index lags the context by one position, so the context's own
final n-gram never matches itself.

A match close to the end may have fewer than k tokens after it. The copy
then runs on into the draft itself (as an LZ77 back-reference does): with
the last occurrence p tokens back, the draft repeats the context's period-p
cycle, which is what a model stuck in a loop does next.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.speculation.candidate import MAX_MATCH_TOKENS, Candidate, Source
from kvmesh.speculation.ngram import NgramIndex, match_length


class RequestContext:
    """One request's tokens as the speculator knows them, indexed incrementally."""

    def __init__(self, ngram_sizes: Iterable[int]) -> None:
        self.tokens: list[int] = []
        # The length the decode worker reports; exceeds len(tokens) when the
        # context was picked up midway (see Session.update).
        self.length = 0
        self._index = NgramIndex(ngram_sizes)

    def extend(self, new_tokens: list[int]) -> None:
        old = len(self.tokens)
        self.tokens.extend(new_tokens)
        # Ends up to len - 1: the n-gram ending at len is the one we look up.
        self._index.add(self.tokens, old, len(self.tokens))
        self.length += len(new_tokens)

    def lookup(self, k: int) -> Candidate | None:
        tokens = self.tokens
        tail = tokens[-MAX_MATCH_TOKENS:]
        best_end, best_match = -1, 0
        for end in self._index.find(tokens, tail):
            m = match_length(tokens, end, tail, 0, MAX_MATCH_TOKENS)
            if m > best_match:
                best_end, best_match = end, m
        if best_end < 0:
            return None
        draft = tokens[best_end : best_end + k]
        period = len(tokens) - best_end
        while len(draft) < k:
            draft.append(draft[len(draft) - period])
        return Candidate(draft, Source.PROMPT, best_match)
