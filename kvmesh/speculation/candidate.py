"""A proposed continuation and the evidence behind it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# How far back a match is measured past its n-gram: enough to tell a chance
# match from a repeated passage, cheap enough to do for every candidate.
MAX_MATCH_TOKENS = 32


class Source(StrEnum):
    PROMPT = "prompt"  # the request's own context (prompt lookup)
    SUFFIX = "suffix"  # the shared index of finished sequences
    DRAFT_MODEL = "draft_model"  # a draft model's greedy continuation (the service's --draft-model)
    EAGLE = "eagle"  # an EAGLE head's drafts from the target's own features (kvmesh/speculation/eagle.py)


@dataclass(frozen=True, slots=True)
class Candidate:
    token_ids: list[int]
    source: Source
    # Trailing context tokens that equal the tokens before the continuation (capped
    # at MAX_MATCH_TOKENS): the longer, the likelier the text repeats further.
    match_length: int


def better(a: Candidate | None, b: Candidate | None) -> Candidate | None:
    """The candidate to propose: the longer match, then the longer draft, then ``a``.

    Callers pass the request's own context as ``a``: on a full tie it is about
    this very request, so it is the safer bet.
    """
    if a is None or b is None:
        return a or b
    if (b.match_length, len(b.token_ids)) > (a.match_length, len(a.token_ids)):
        return b
    return a
