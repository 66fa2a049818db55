"""Protobuf <-> engine types, one definition for every service that runs the engine."""

from __future__ import annotations

import math

from kvmesh.api.common.v1 import accounting_pb2, sampling_pb2
from kvmesh.engine.sampling_params import SamplingParams
from kvmesh.engine.sequence import TokenLogprob
from kvmesh.structured.spec import GrammarSpec

_FINISH = {
    "stop": sampling_pb2.FINISH_REASON_STOP,
    "length": sampling_pb2.FINISH_REASON_LENGTH,
    "repetition": sampling_pb2.FINISH_REASON_REPETITION,
    "abort": sampling_pb2.FINISH_REASON_ABORT,
}
_FINISH_NAME = {v: k for k, v in _FINISH.items()}


def sampling_from_pb(p: sampling_pb2.SamplingParams, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The contract's defaults: unset temperature/top_p/repetition_penalty mean 1.0; max_tokens 0 = to the
    context end."""
    return SamplingParams(
        max_tokens=p.max_tokens or max(max_model_len - prompt_len, 1),
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_k=p.top_k,
        top_p=p.top_p if p.HasField("top_p") else 1.0,
        min_p=p.min_p,
        seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.top_logprobs if p.logprobs else None,
        repetition_limit=p.repetition_guard.max_repeats,
        repetition_allow=list(p.repetition_guard.allowed_token_ids),
        grammar=GrammarSpec.from_pb(p.structured_output) if p.HasField("structured_output") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else 1.0,
        logit_bias=dict(p.logit_bias),
    )


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
