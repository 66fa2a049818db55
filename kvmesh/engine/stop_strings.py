"""Where a stop string ends a text: the one rule the engine and the gateway's first-token path share.

Torch-free, so the gateway can cut a token that prefill finished on a stop
string exactly as the decode engine would have cut it.
"""

from __future__ import annotations

from collections.abc import Sequence


def stop_cut(text: str, stops: Sequence[str], start: int = 0, include: bool = False) -> int | None:
    """The length of ``text`` kept when a stop string occurs at or after ``start`` (None: none does).

    The earliest occurrence wins, the longest stop among those that begin there; the kept text ends
    before it, or after it with ``include`` (vLLM's include_stop_str_in_output).
    """
    hits = [(i, s) for i, s in ((text.find(s, start), s) for s in stops) if i >= 0]
    if not hits:
        return None
    at, stop = min(hits, key=lambda hit: (hit[0], -len(hit[1])))
    return at + len(stop) if include else at
