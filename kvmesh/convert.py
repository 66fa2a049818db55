"""Protobuf <-> engine types, one definition for every service that runs the engine."""

from __future__ import annotations

import math

from kvmesh.api.common.v1 import accounting_pb2, sampling_pb2
from kvmesh.engine.sequence import TokenLogprob

_FINISH = {
    "stop": sampling_pb2.FINISH_REASON_STOP,
    "length": sampling_pb2.FINISH_REASON_LENGTH,
    "repetition": sampling_pb2.FINISH_REASON_REPETITION,
    "abort": sampling_pb2.FINISH_REASON_ABORT,
}
_FINISH_NAME = {v: k for k, v in _FINISH.items()}


def finish_to_pb(reason: str | None) -> int:
    return _FINISH.get(reason, sampling_pb2.FINISH_REASON_UNSPECIFIED) if reason else 0


def finish_from_pb(reason: int) -> str | None:
    return _FINISH_NAME.get(reason)


def logprob_to_pb(lp: TokenLogprob) -> sampling_pb2.TokenLogprob:
    return sampling_pb2.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top_logprobs=[sampling_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
    )


def logprob_from_pb(lp: sampling_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])


def timings_pb(**ns: int | float) -> accounting_pb2.Timings:
    """Timings from nanosecond values (floats rounded; NaN/negative dropped)."""
    return accounting_pb2.Timings(
        **{k: int(v) for k, v in ns.items() if v is not None and not math.isnan(v) and v >= 0}
    )
