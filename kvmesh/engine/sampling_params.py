"""What a request asks of the sampler and when it stops."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.errors import InvalidArgument
from kvmesh.structured.spec import GrammarSpec


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

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
