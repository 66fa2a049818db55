"""A request's sampling settings: the one type every layer uses, with one validation and one resolution of defaults.

The gateway, prefill, decode and the engine all read a request's settings through ``SamplingParams``:
``from_pb``/``to_pb`` at every gRPC boundary, ``validate`` wherever a request is received (workers are
reachable without the gateway), ``resolve`` where its unset settings get their defaults. Torch-free: the gateway
imports it.

One spelling of "unset": ``None``. On the wire an unset setting is an absent ``optional`` field, or 0 for
the plain fields whose 0 is "off" (max_tokens, top_k, min_p); ``from_pb`` turns both into ``None`` and
``resolve`` gives it the default: the server's (``SamplingDefaults``: the model's generation_config.json and
the operator's flags, at the gateway) or the contract's (``CONTRACT_DEFAULTS``: temperature and top_p 1, no
top-k, min-p or penalties, no repetition guard, max_tokens to the end of the context).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.errors import InvalidField
from kvmesh.structured.spec import GrammarSpec

# OpenAI's ranges (temperature, penalties, logit_bias, top logprobs); repetition_penalty's bound keeps logits finite.
MAX_TEMPERATURE = 2.0
PENALTY_LIMIT = 2.0
LOGIT_BIAS_LIMIT = 100.0
REPETITION_PENALTY_MAX = 100.0
MAX_TOP_LOGPROBS = 20
# Temperatures below this sample greedily (as vLLM's do): dividing logits by a denormal one overflows
# them to inf, and the distribution it stands for is the argmax anyway.
MIN_SAMPLING_TEMPERATURE = 1e-5


class ContextExceeded(InvalidField):
    """The prompt, with the tokens asked for, does not fit the model's context."""

    reason = "context_length_exceeded"


@dataclass(frozen=True)
class SamplingDefaults:
    """What each unset setting becomes. The fields are those ``SamplingParams`` may leave unset."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # off
    min_p: float = 0.0  # off
    repetition_penalty: float = 1.0  # off
    max_tokens: int | None = None  # None: up to the end of the context
    repetition_limit: int = 0  # the repetition guard: off
    repetition_allow: tuple[int, ...] = ()

    def describe(self) -> dict[str, object]:
        """For a start-up log: the settings that differ from the contract's, the guard as its limit and
        allow-list size."""
        shown: dict[str, object] = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name != "repetition_allow" and getattr(self, f.name) != getattr(CONTRACT_DEFAULTS, f.name)
        }
        if self.repetition_limit:
            shown["repetition_limit"] = f"{self.repetition_limit} ({len(self.repetition_allow)} tokens exempt)"
        return shown


CONTRACT_DEFAULTS = SamplingDefaults()


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. ``None`` is unset (``resolve`` fills it in)."""

    max_tokens: int | None = None
    temperature: float | None = None  # 0 (or below MIN_SAMPLING_TEMPERATURE): greedy
    top_k: int | None = None  # 0: off
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None  # None: unseeded (not a default: it stays None)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Top-N logprobs to return per generated token (None: none; 0: the chosen token's only).
    logprobs: int | None = None
    # Finish with reason "repetition" when one token repeats more than this many times in a
    # row (0: off). Tokens in the allow-list (e.g. table rules, indentation) are exempt.
    repetition_limit: int | None = None
    repetition_allow: tuple[int, ...] = ()
    # Only tokens this grammar allows are sampled; the grammar's end finishes the request.
    grammar: GrammarSpec | None = None
    # OpenAI's penalties: subtract presence once per token already generated, frequency per occurrence of it.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers': over prompt and output tokens, divide positive logits, multiply negative ones.
    repetition_penalty: float | None = None
    # Added to a token's logit (OpenAI's logit_bias: -100 bans, +100 forces in practice).
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Until this many tokens are out, EOS and stop_token_ids are masked and stop strings do not end it.
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty not in (None, 1.0)
            or self.logit_bias
        )

    # -- validation ----------------------------------------------------------

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidField naming the first bad field (its path in the gRPC request: ``sampling.<name>``).

        Every float must be finite (NaN compares false with everything, so each range is written to fail
        on it) and a negative zero is refused where a sign could be meant (temperature, top_p, min_p).
        """
        _check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_range("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0, high_open=True)
        _check_range("presence_penalty", self.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        _check_range("frequency_penalty", self.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        _check_range("repetition_penalty", self.repetition_penalty, 0.0, REPETITION_PENALTY_MAX, low_open=True)
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise _invalid("max_tokens", f"must be > 0, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise _invalid("min_tokens", f"must be in [0, max_tokens ({self.max_tokens})], got {self.min_tokens}")
        if self.top_k is not None and self.top_k < 0:
            raise _invalid("top_k", f"must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise _invalid("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}")
        if self.repetition_limit is not None and self.repetition_limit < 0:
            raise _invalid("repetition_guard.max_repeats", f"must be >= 0, got {self.repetition_limit}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise _invalid("seed", f"must be in [0, 2**64), got {self.seed}")
        if any(not s for s in self.stop):
            raise _invalid("stop", ": stop strings must be non-empty")
        _check_ids("stop_token_ids", self.stop_token_ids, vocab_size)
        _check_ids("repetition_guard.allowed_token_ids", self.repetition_allow, vocab_size)
        _check_ids("logit_bias", list(self.logit_bias), vocab_size)
        for token, bias in self.logit_bias.items():
            _check_range(f"logit_bias[{token}]", bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)

    # -- defaults ------------------------------------------------------------

    def resolve(self, defaults: SamplingDefaults, prompt_len: int, context: int) -> SamplingParams:
        """A copy with every unset setting given its default, for a prompt of ``prompt_len`` tokens in a
        context of ``context``. ContextExceeded when the prompt leaves no room, or max_tokens more than is left."""
        room = context - prompt_len
        if room < 1:
            raise ContextExceeded(
                "prompt",
                f"prompt has {prompt_len} tokens; the model's context is {context} "
                "(room for at least one new token is needed)",
            )
        max_tokens = self.max_tokens if self.max_tokens is not None else defaults.max_tokens
        if max_tokens is None:
            max_tokens = room
        elif self.max_tokens is None:
            max_tokens = min(max_tokens, room)  # a server default never makes a request refused
        elif max_tokens > room:
            raise ContextExceeded(
                "sampling.max_tokens",
                f"prompt ({prompt_len} tokens) + sampling.max_tokens ({max_tokens}) exceeds the model's context of "
                f"{context} tokens",
            )
        guard_unset = self.repetition_limit is None
        return replace(
            self,
            max_tokens=max_tokens,
            temperature=_default(self.temperature, defaults.temperature),
            top_k=_default(self.top_k, defaults.top_k),
            top_p=_default(self.top_p, defaults.top_p),
            min_p=_default(self.min_p, defaults.min_p),
            repetition_penalty=_default(self.repetition_penalty, defaults.repetition_penalty),
            repetition_limit=defaults.repetition_limit if guard_unset else self.repetition_limit,
            repetition_allow=defaults.repetition_allow if guard_unset else self.repetition_allow,
        )

    # -- the wire ------------------------------------------------------------

    @staticmethod
    def from_pb(p: sampling_pb2.SamplingParams) -> SamplingParams:
        """The message's settings; absent optional fields and zero plain ones are unset (None)."""
        guard = p.repetition_guard if p.HasField("repetition_guard") else None
        return SamplingParams(
            max_tokens=p.max_tokens or None,
            temperature=p.temperature if p.HasField("temperature") else None,
            top_k=p.top_k or None,
            top_p=p.top_p if p.HasField("top_p") else None,
            min_p=p.min_p or None,
            seed=p.seed if p.HasField("seed") else None,
            stop=tuple(p.stop),
            stop_token_ids=tuple(p.stop_token_ids),
            ignore_eos=p.ignore_eos,
            logprobs=p.top_logprobs if p.logprobs else _no_top_logprobs(p),
            repetition_limit=guard.max_repeats if guard is not None else None,
            repetition_allow=tuple(guard.allowed_token_ids) if guard is not None else (),
            grammar=GrammarSpec.from_pb(p.structured_output) if p.HasField("structured_output") else None,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty if p.HasField("repetition_penalty") else None,
            logit_bias=dict(p.logit_bias),
            min_tokens=p.min_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens if p.HasField("skip_special_tokens") else True,
        )

    def to_pb(self) -> sampling_pb2.SamplingParams:
        """The message ``from_pb`` reads back as these settings (unset ones stay unset)."""
        out: dict[str, Any] = {
            "max_tokens": self.max_tokens or 0,
            "top_k": self.top_k or 0,
            "min_p": self.min_p or 0.0,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "logprobs": self.logprobs is not None,
            "top_logprobs": self.logprobs or 0,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias,
            "min_tokens": self.min_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        if not self.skip_special_tokens:
            out["skip_special_tokens"] = False
        for name in ("temperature", "top_p", "seed", "repetition_penalty"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.repetition_limit is not None:
            out["repetition_guard"] = sampling_pb2.RepetitionGuard(
                max_repeats=self.repetition_limit, allowed_token_ids=list(self.repetition_allow)
            )
        if self.grammar is not None:
            out["structured_output"] = self.grammar.to_pb()
        return sampling_pb2.SamplingParams(**out)


def admitted(
    params: SamplingParams,
    prompt_ids: Sequence[int],
    vocab_size: int,
    context: int,
    defaults: SamplingDefaults = CONTRACT_DEFAULTS,
) -> SamplingParams:
    """A request's prompt and settings checked and its unset settings resolved: what every receiver of a
    request (the gateway with its server's defaults; workers and the engine with the contract's) runs.
    InvalidField names the first field that is wrong."""
    check_prompt(prompt_ids, vocab_size)
    params = params.resolve(defaults, len(prompt_ids), context)
    params.validate(vocab_size)
    return params


def check_prompt(prompt_ids: Sequence[int], vocab_size: int) -> None:
    """A prompt is at least one token, each inside the vocabulary (its length against the context: ``resolve``)."""
    if not prompt_ids:
        raise InvalidField("prompt", "prompt is empty")
    bad = next((t for t in prompt_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidField("prompt", f"prompt: token id {bad} is outside the vocabulary [0, {vocab_size})")


def _no_top_logprobs(p: sampling_pb2.SamplingParams) -> None:
    if p.top_logprobs:
        raise _invalid("top_logprobs", "needs sampling.logprobs")
    return None


def _default(value: Any, default: Any) -> Any:
    return default if value is None else value


def _invalid(name: str, problem: str) -> InvalidField:
    """``problem`` reads after the field's name: "must be ..." or ": what is wrong"."""
    return InvalidField(f"sampling.{name}", f"sampling.{name}{'' if problem.startswith(':') else ' '}{problem}")


def _check_range(
    name: str, value: float | None, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> None:
    """``value`` (when set) is finite and inside [low, high], either end open; a negative zero is refused
    where 0 is the lowest value allowed."""
    if value is None:
        return
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    negative_zero = value == 0.0 and low == 0.0 and math.copysign(1.0, value) < 0
    if not (math.isfinite(value) and above and below) or negative_zero:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise _invalid(name, f"must be a finite number in {span}, got {value!r}")


def _check_ids(name: str, ids: Any, vocab_size: int) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _invalid(name, f": token id {bad} is outside the vocabulary [0, {vocab_size})")
