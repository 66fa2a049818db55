"""An n-gram index over a token buffer: n-gram -> where its most recent occurrence ends.

Both draft sources use it: a request's own context (prompt lookup) and the
shared suffix index over finished sequences. Keys are ``hash()`` of the
n-gram's tuple, an int, which costs far less memory than keeping the tuple;
every hit is verified against the buffer, so a hash collision costs a lookup,
never a wrong match. Indexing a range of positions runs at C speed (``zip``
builds the n-grams, ``map(hash, ...)`` hashes them, ``dict.update`` stores
them), so learning a long prompt does not stall the caller.

Positions: an entry's value is the *end* of the occurrence (exclusive), i.e.
the position of the token that followed it, which is where a draft starts.
Values may carry an ``offset`` (the shared index stores positions in a stream
whose front is dropped as it is evicted, so values outlive buffer indexes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence


class NgramIndex:
    def __init__(self, sizes: Iterable[int]) -> None:
        longest_first = sorted(set(sizes), reverse=True)
        if not longest_first or longest_first[-1] < 1:
            raise ValueError(f"n-gram sizes must be positive, got {longest_first}")
        # Longest first: lookups try the most specific n-gram before shorter ones.
        self._maps: dict[int, dict[int, int]] = {n: {} for n in longest_first}

    @property
    def min_n(self) -> int:
        return min(self._maps)

    @property
    def max_n(self) -> int:
        return max(self._maps)

    def __len__(self) -> int:
        return sum(len(m) for m in self._maps.values())

    def add(self, tokens: Sequence[int], lo: int, hi: int, start: int = 0, offset: int = 0) -> None:
        """Index the n-grams ending at buffer positions ``lo <= e < hi`` that begin at or after ``start``.

        A later occurrence of the same n-gram replaces an earlier one.
        """
        for n, m in self._maps.items():
            first = max(lo, start + n)
            if first < hi:
                m.update(zip(map(hash, _ngrams(tokens, n, first, hi)), range(first + offset, hi + offset)))

    def remove(self, tokens: Sequence[int], lo: int, hi: int, start: int = 0, offset: int = 0) -> None:
        """Undo ``add`` for the same range: drop entries that still point into it."""
        for n, m in self._maps.items():
            first = max(lo, start + n)
            if first < hi:
                keys = list(map(hash, _ngrams(tokens, n, first, hi)))
                found = map(m.get, keys)
                for key in [k for k, e, f in zip(keys, range(first + offset, hi + offset), found) if e == f]:
                    del m[key]

    def find(self, tokens: Sequence[int], tail: list[int], offset: int = 0) -> Iterator[int]:
        """For each size n, longest first: the buffer position (``offset`` taken off) where the
        most recent indexed occurrence of ``tail``'s last n tokens ends."""
        for n, m in self._maps.items():
            if len(tail) < n:
                continue
            gram = tail[-n:]
            end = m.get(hash(tuple(gram)))
            if end is None:
                continue
            end -= offset
            if list(tokens[end - n : end]) == gram:
                yield end


def _ngrams(tokens: Sequence[int], n: int, first: int, hi: int) -> Iterator[tuple[int, ...]]:
    """The n-grams ``tokens[e - n:e]`` for ``first <= e < hi``."""
    return zip(*(tokens[first - n + i : hi - n + i] for i in range(n)))


def match_length(tokens: Sequence[int], end: int, tail: Sequence[int], floor: int, cap: int) -> int:
    """How many trailing tokens of ``tail`` equal the tokens before buffer position ``end``
    (at most ``cap``, never reaching before buffer position ``floor``)."""
    limit = min(cap, len(tail), end - floor)
    n = 0
    while n < limit and tokens[end - 1 - n] == tail[-1 - n]:
        n += 1
    return n
