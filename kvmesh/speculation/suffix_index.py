"""The shared suffix index: continuations learned from every finished sequence.

Agentic and coding traffic repeats itself across requests (the same tool
output quoted back, the same file rewritten with small edits), so a request
can draft from what *other* requests produced. Finished sequences (prompt +
output) are appended to one token stream, separated by a sentinel that no
real token equals, and their n-grams are indexed with positions in that
stream. A lookup finds the most recent occurrence of the context's tail and
proposes what followed it, up to the end of that sequence.

Learning is split in two so it never stalls proposals: ``learn`` only
appends the tokens (a C-speed copy); ``maintain`` evicts and indexes, about
as many token positions per call as the caller allows (~0.5 µs per token and
n-gram size either way), so a service can do it in small chunks between
requests. Until then a sequence is held but not yet found by lookups.

Memory is bounded by ``capacity_tokens``: when more are held, ``maintain``
evicts the oldest sequences (their n-grams unindexed, the front of the
stream dropped) before indexing anything new. An exact repeat of a held
sequence adds nothing and is skipped, so hot traffic cannot flood the index
with copies of itself.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.speculation.candidate import MAX_MATCH_TOKENS, Candidate, Source
from kvmesh.speculation.ngram import NgramIndex, match_length

_SEPARATOR = -1

# Drop the evicted front of the stream once it is this large (amortizes the copy).
_COMPACT_MIN_TOKENS = 1 << 16


@dataclass(slots=True)
class _Learned:
    start: int  # stream position of the sequence's first token
    end: int  # exclusive
    digest: int  # hash of the token tuple, to spot exact repeats
    indexed_end: int  # n-grams ending before this position are indexed


class SuffixIndex:
    def __init__(self, ngram_sizes: Iterable[int], capacity_tokens: int) -> None:
        self._index = NgramIndex(ngram_sizes)
        if capacity_tokens <= self._index.max_n:
            raise ValueError(
                f"suffix index capacity ({capacity_tokens}) must exceed the largest n-gram ({self._index.max_n})"
            )
        self.capacity_tokens = capacity_tokens
        # A list, not an array: slicing it for n-grams reuses its int objects
        # instead of boxing every token again (docs/measurements.md).
        self._stream: list[int] = []
        self._base = 0  # stream position of self._stream[0]
        self._sequences: deque[_Learned] = deque()  # oldest first
        self._pending: deque[_Learned] = deque()  # not fully indexed yet, oldest first
        self._digests: dict[int, _Learned] = {}
        self.held_tokens = 0  # tokens of the sequences held (indexed or pending)
        self.indexed_tokens = 0  # of which indexed
        self.evicted_sequences = 0

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    @property
    def backlog_tokens(self) -> int:
        """Held tokens not indexed yet."""
        return self.held_tokens - self.indexed_tokens

    @property
    def needs_maintenance(self) -> bool:
        return self.held_tokens > self.indexed_tokens or self.held_tokens > self.capacity_tokens

    def learn(self, tokens: list[int]) -> bool:
        """Hold a finished sequence for ``maintain``; False when too short or already held."""
        tokens = tokens[-self.capacity_tokens :]
        if len(tokens) <= self._index.min_n:
            return False
        digest = hash(tuple(tokens))
        known = self._digests.get(digest)
        if known is not None and self._stream[known.start - self._base : known.end - self._base] == tokens:
            return False
        self._stream.append(_SEPARATOR)
        start = self._base + len(self._stream)
        self._stream.extend(tokens)
        seq = _Learned(start, start + len(tokens), digest, start)
        self._sequences.append(seq)
        self._pending.append(seq)
        self._digests[digest] = seq
        self.held_tokens += len(tokens)
        return True

    def maintain(self, max_tokens: int | None = None) -> bool:
        """Evict down to capacity, then index held sequences: about ``max_tokens`` positions
        of work (all when None; a whole sequence is evicted at once). True if work is left."""
        budget = self.held_tokens if max_tokens is None else max_tokens
        while self.held_tokens > self.capacity_tokens and budget > 0:
            budget -= self._evict_oldest()
        base = self._base
        while self._pending and budget > 0:
            seq = self._pending[0]
            hi = min(seq.end, seq.indexed_end + budget)
            self._index.add(self._stream, seq.indexed_end - base, hi - base, start=seq.start - base, offset=base)
            budget -= hi - seq.indexed_end
            self.indexed_tokens += hi - seq.indexed_end
            seq.indexed_end = hi
            if hi == seq.end:
                self._pending.popleft()
        return self.needs_maintenance

    def lookup(self, tail: list[int], k: int) -> Candidate | None:
        """The continuation of the longest-matching indexed occurrence of ``tail``'s suffix."""
        stream = self._stream
        best_end, best_match = -1, 0
        for end in self._index.find(stream, tail, offset=self._base):
            m = match_length(stream, end, tail, 0, MAX_MATCH_TOKENS)
            if m > best_match:
                best_end, best_match = end, m
        if best_end < 0:
            return None
        draft = stream[best_end : best_end + k]
        if _SEPARATOR in draft:
            del draft[draft.index(_SEPARATOR) :]
        return Candidate(draft, Source.SUFFIX, best_match)

    def _evict_oldest(self) -> int:
        """Drop the oldest sequence; returns the positions unindexed."""
        seq = self._sequences.popleft()
        if self._pending and self._pending[0] is seq:
            self._pending.popleft()
        if self._digests.get(seq.digest) is seq:
            del self._digests[seq.digest]
        base = self._base
        self._index.remove(self._stream, seq.start - base, seq.indexed_end - base, start=seq.start - base, offset=base)
        self.held_tokens -= seq.end - seq.start
        self.indexed_tokens -= seq.indexed_end - seq.start
        self.evicted_sequences += 1
        # Everything before the next held sequence (its separator included) is dead.
        dead = (self._sequences[0].start - 1 if self._sequences else base + len(self._stream)) - base
        if dead >= _COMPACT_MIN_TOKENS and dead * 2 >= len(self._stream):
            del self._stream[:dead]
            self._base += dead
        return seq.indexed_end - seq.start
