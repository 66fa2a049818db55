"""Checks on a request before any worker sees it, each failing with a message that names the field.

The workers check again (they are reachable without the gateway); checking
here answers bad input at once, without routing or tokenizing twice.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.engine.sampling_params import LOGIT_BIAS_LIMIT, PENALTY_LIMIT, REPETITION_PENALTY_MAX
from kvmesh.errors import InvalidArgument
from kvmesh.structured.spec import GrammarSpec

# The most alternatives per token a request may ask for (OpenAI's limit too).
MAX_TOP_LOGPROBS = 20


class PromptTooLong(InvalidArgument):
    """The prompt (with the tokens asked for) does not fit the model's context."""

    reason = "context_length_exceeded"


class InvalidField(InvalidArgument):
    """A request field is wrong. ``field`` is its path in the gRPC request (e.g. "tools[1].parameters_json"),
    which the HTTP API reports as the OpenAI parameter it came from."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def validate_structured_output(s: sampling_pb2.SamplingParams) -> None:
    """A constraint the workers could not compile or enforce is refused here, saying what is wrong with it."""
    spec = GrammarSpec.from_pb(s.structured_output) if s.HasField("structured_output") else None
    if spec is None:
        return
    try:
        check_grammar(spec)
    except InvalidArgument as e:
        raise InvalidField("sampling.structured_output", f"structured output: {e.message}") from None


@functools.lru_cache(maxsize=1024)
def check_grammar(spec: GrammarSpec) -> None:
    """``spec.check()``, cached when it passes: clients repeat their schemas and tools, and a check
    takes milliseconds on the event loop."""
    spec.check()


def validate_sampling(s: sampling_pb2.SamplingParams, vocab_size: int) -> None:
    if s.HasField("temperature") and not (math.isfinite(s.temperature) and s.temperature >= 0):
        raise InvalidArgument(f"sampling.temperature must be >= 0, got {s.temperature}")
    if s.HasField("top_p") and not 0.0 < s.top_p <= 1.0:  # also refuses NaN
        raise InvalidArgument(f"sampling.top_p must be in (0, 1], got {s.top_p}")
    if not 0.0 <= s.min_p < 1.0:
        raise InvalidArgument(f"sampling.min_p must be in [0, 1), got {s.min_p}")
    if s.top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidArgument(f"sampling.top_logprobs must be <= {MAX_TOP_LOGPROBS}, got {s.top_logprobs}")
    if s.top_logprobs and not s.logprobs:
        raise InvalidArgument("sampling.top_logprobs needs sampling.logprobs")
    if any(not stop for stop in s.stop):
        raise InvalidArgument("sampling.stop: stop strings must be non-empty")
    _check_ids("sampling.stop_token_ids", s.stop_token_ids, vocab_size)
    _check_ids("sampling.repetition_guard.allowed_token_ids", s.repetition_guard.allowed_token_ids, vocab_size)
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:  # also refuses NaN
            raise InvalidArgument(f"sampling.{name} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], got {value}")
    if s.HasField("repetition_penalty") and not 0.0 < s.repetition_penalty <= REPETITION_PENALTY_MAX:
        raise InvalidArgument(
            f"sampling.repetition_penalty must be in (0, {REPETITION_PENALTY_MAX}], got {s.repetition_penalty}"
        )
    _check_ids("sampling.logit_bias", list(s.logit_bias), vocab_size)
    bad = next((t for t, b in s.logit_bias.items() if not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT), None)
    if bad is not None:
        raise InvalidArgument(
            f"sampling.logit_bias[{bad}] must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}], got {s.logit_bias[bad]}"
        )


def validate_prompt(prompt_ids: Sequence[int], max_tokens: int, vocab_size: int, max_model_len: int) -> None:
    if not prompt_ids:
        raise InvalidArgument("prompt is empty")
    _check_ids("prompt", prompt_ids, vocab_size)
    if len(prompt_ids) >= max_model_len:
        raise PromptTooLong(
            f"prompt has {len(prompt_ids)} tokens; the model's context is {max_model_len} "
            "(room for at least one new token is needed)"
        )
    if max_tokens and len(prompt_ids) + max_tokens > max_model_len:
        raise PromptTooLong(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
            f"context of {max_model_len} tokens"
        )


def _check_ids(field: str, ids: Sequence[int], vocab_size: int) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{field}: token id {bad} is outside the vocabulary [0, {vocab_size})")
