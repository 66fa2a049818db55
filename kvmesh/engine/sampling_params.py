"""What a request asks of the sampler and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument
from kvmesh.structured.spec import GrammarSpec

# OpenAI's ranges (penalties and logit_bias); repetition_penalty's bound keeps logits finite.
PENALTY_LIMIT = 2.0
LOGIT_BIAS_LIMIT = 100.0
REPETITION_PENALTY_MAX = 100.0


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Top-N logprobs to return per generated token (None: none; 0: the chosen token's only).
    logprobs: int | None = None
    # Finish with reason "repetition" when one token repeats more than this many times in a
    # row (0 = off). Tokens in the allow-list (e.g. table rules, indentation) are exempt.
    repetition_limit: int = 0
    repetition_allow: list[int] = field(default_factory=list)
    # Only tokens this grammar allows are sampled; the grammar's end finishes the request.
    grammar: GrammarSpec | None = None
    # Logit adjustments before sampling (kvmesh.engine.penalties), greedy included. OpenAI's:
    # subtract presence once per token already generated, frequency per occurrence of it.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers': over prompt and output tokens, divide positive logits, multiply negative ones.
    repetition_penalty: float = 1.0
    # Added to a token's logit (OpenAI's logit_bias: -100 bans, +100 forces in practice).
    logit_bias: dict[int, float] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0 or self.logit_bias
        )

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidArgument naming the first bad field."""
        if self.max_tokens <= 0:
            raise InvalidArgument(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1), got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidArgument(f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.repetition_limit < 0:
            raise InvalidArgument(f"repetition_limit must be >= 0, got {self.repetition_limit}")
        for t in self.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise InvalidArgument(f"stop_token_ids: {t} is outside the vocabulary")
        if any(not s for s in self.stop):
            raise InvalidArgument("stop strings must be non-empty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise InvalidArgument(f"{name} must be in [-{PENALTY_LIMIT}, {PENALTY_LIMIT}], got {value}")
        if not 0.0 < self.repetition_penalty <= REPETITION_PENALTY_MAX:
            raise InvalidArgument(
                f"repetition_penalty must be in (0, {REPETITION_PENALTY_MAX}], got {self.repetition_penalty}"
            )
        for t, bias in self.logit_bias.items():
            if not 0 <= t < vocab_size:
                raise InvalidArgument(f"logit_bias: {t} is outside the vocabulary")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise InvalidArgument(
                    f"logit_bias[{t}] must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}], got {bias}"
                )
