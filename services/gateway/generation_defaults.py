"""What a request gets for each generation setting it leaves unset: the operator's and the model's defaults.

Filled in by the gateway before routing, so every worker sees explicit values and
the logs show what a request ran with. Sources, later ones winning:
- the contract's own defaults (temperature and top_p 1, no penalties);
- the model folder's ``generation_config.json`` (temperature, top_p, top_k, min_p,
  repetition_penalty), unless the operator turns that off (``--generation-config none``);
- the operator's flags: ``--default-max-tokens`` and the repetition guard.

The repetition guard is on by default: a sequence stops (finish reason
``repetition``) once one token occurs more than ``max_repeats`` times in a row —
how a small model's collapse ("the the the ...") ends early instead of running to
max_tokens. Tokens made only of formatting characters (spaces, newlines, ``-``,
``=``, ``|`` ...: table rules, indentation, separators) may repeat without limit.
A request states its own guard over gRPC (``SamplingParams.repetition_guard``;
``max_repeats: 0`` turns it off).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import ModelLoadError

DEFAULT_REPETITION_LIMIT = 32
DEFAULT_REPETITION_ALLOW_CHARS = " \t\r\n-=|_*.#~+:"
# generation_config.json keys that map onto a sampling field.
_FROM_GENERATION_CONFIG = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float | None = None
    max_tokens: int = 0  # 0: to the end of the context
    repetition_guard: sampling_pb2.RepetitionGuard | None = None

    @classmethod
    def for_model(
        cls,
        path: Path,
        tokenizer: Tokenizer,
        *,
        use_generation_config: bool = True,
        max_tokens: int = 0,
        repetition_limit: int = DEFAULT_REPETITION_LIMIT,
        repetition_allow_chars: str = DEFAULT_REPETITION_ALLOW_CHARS,
    ) -> GenerationDefaults:
        if max_tokens < 0 or repetition_limit < 0:
            raise ValueError("default max tokens and the repetition limit must be >= 0")
        from_model = _generation_config(path) if use_generation_config else {}
        guard = None
        if repetition_limit:
            allowed = formatting_tokens(tokenizer, repetition_allow_chars)
            guard = sampling_pb2.RepetitionGuard(max_repeats=repetition_limit, allowed_token_ids=allowed)
        return cls(**from_model, max_tokens=max_tokens, repetition_guard=guard)

    def describe(self) -> dict[str, object]:
        """For the start-up log: the set defaults, the guard as its limit and allow-list size."""
        shown: dict[str, object] = {
            k: v for k, v in vars(self).items() if k != "repetition_guard" and v not in (None, 0, 0.0)
        }
        guard = self.repetition_guard
        shown["repetition_guard"] = (
            f"{guard.max_repeats} ({len(guard.allowed_token_ids)} tokens exempt)" if guard else "off"
        )
        return shown

    def apply(self, s: sampling_pb2.SamplingParams) -> sampling_pb2.SamplingParams:
        """A copy of ``s`` with every unset field given its default (``s`` itself is left alone)."""
        out = sampling_pb2.SamplingParams()
        out.CopyFrom(s)
        if self.temperature is not None and not s.HasField("temperature"):
            out.temperature = self.temperature
        if self.top_p is not None and not s.HasField("top_p"):
            out.top_p = self.top_p
        if self.repetition_penalty is not None and not s.HasField("repetition_penalty"):
            out.repetition_penalty = self.repetition_penalty
        # Plain fields: zero is both "unset" and "off", so only zero takes the default.
        if not s.top_k:
            out.top_k = self.top_k
        if not s.min_p:
            out.min_p = self.min_p
        if not s.max_tokens:
            out.max_tokens = self.max_tokens
        if self.repetition_guard is not None and not s.HasField("repetition_guard"):
            out.repetition_guard.CopyFrom(self.repetition_guard)
        return out


def _generation_config(path: Path) -> dict:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{file}: not valid JSON ({e})") from None
    # As vLLM reads it: the sampling values count whatever do_sample says.
    found = {k: raw[k] for k in _FROM_GENERATION_CONFIG if raw.get(k) is not None}
    return {k: (int(v) if k == "top_k" else float(v)) for k, v in found.items()}


def formatting_tokens(tokenizer: Tokenizer, chars: str) -> list[int]:
    """Ids of the tokens whose text is made only of ``chars`` (empty texts, e.g. special tokens, excluded)."""
    allowed = set(chars)
    ids = sorted(tokenizer.vocab().values())
    texts = tokenizer.decode_each(ids)
    return [i for i, text in zip(ids, texts) if text and set(text) <= allowed]
