"""Moving a stream off a decode worker that failed mid-stream, onto another one, without the client noticing.

The client already has some tokens. The new decode worker gets the prompt
and those tokens (``DecodeRequest.resume_token_ids``) and prefills both
locally, reusing whatever its cache or the kvstore holds: the dead worker's KV
is gone, and no prefill worker holds KV for the streamed tokens. The tokens
already sent count as output there (max_tokens, stop strings, the repetition
guard, and a structured output's grammar, advanced over them), so the
continuation is the one an unbroken stream would have produced:

- greedy: exactly the same tokens and text;
- sampled with a seed: a valid continuation under the same constraints,
  sampled from ``seed`` mixed with the resume point (reproducible for the
  same point, not the draws an unbroken run would have made); without a seed,
  a fresh random continuation.

The gateway's own counts make usage exact: completion tokens are what the
client received, from whichever worker; cached tokens count the prompt only.
A request migrates at most ``max_migrations`` times (then UNAVAILABLE), so a
request that kills every worker it lands on (a poison prompt) cannot take the
whole pool down one worker at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.api.decode.v1 import decode_pb2

DEFAULT_MAX_MIGRATIONS = 2


@dataclass(frozen=True)
class MigrationPolicy:
    max_migrations: int = DEFAULT_MAX_MIGRATIONS

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")


def resumed(request: decode_pb2.DecodeRequest, streamed: Sequence[int]) -> decode_pb2.DecodeRequest:
    """``request`` (a fresh local-prefill one) continuing after the ``streamed`` tokens."""
    out = decode_pb2.DecodeRequest()
    out.CopyFrom(request)
    out.resume_token_ids[:] = streamed
    return out
