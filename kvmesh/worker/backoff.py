"""Exponential backoff with jitter, for retrying calls to a peer that is down."""

from __future__ import annotations

import random


class Backoff:
    """``next()`` doubles from ``initial_s`` up to ``max_s``; jitter keeps a fleet of
    workers from retrying in lockstep after a shared peer comes back."""

    def __init__(self, initial_s: float, max_s: float) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {initial_s}, {max_s}")
        self._initial_s = initial_s
        self._max_s = max_s
        self._attempt = 0

    def next(self) -> float:
        delay = min(self._max_s, self._initial_s * 2**self._attempt)
        self._attempt = min(self._attempt + 1, 62)
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self._attempt = 0
