"""What a request gets for each generation setting it leaves unset: the operator's and the model's defaults.

The gateway resolves a request's unset settings with these before routing
(``kvmesh.sampling.SamplingParams.resolve``), so every worker sees explicit values
and the logs show what a request ran with. Sources, later ones winning:
- the contract's own defaults (temperature and top_p 1, no penalties);
- the model folder's ``generation_config.json`` (temperature, top_p, top_k, min_p,
  repetition_penalty), unless the operator turns that off (``--generation-config none``);
- the operator's flags: ``--default-max-tokens`` (0: up to the context; never more than a
  prompt leaves room for) and the repetition guard.

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
from dataclasses import replace
from pathlib import Path

from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidField, ModelLoadError
from kvmesh.sampling import CONTRACT_DEFAULTS, SamplingDefaults, SamplingParams

DEFAULT_REPETITION_LIMIT = 32
DEFAULT_REPETITION_ALLOW_CHARS = " \t\r\n-=|_*.#~+:"
# generation_config.json keys that map onto a sampling field.
_FROM_GENERATION_CONFIG = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(
    path: Path,
    tokenizer: Tokenizer,
    *,
    use_generation_config: bool = True,
    max_tokens: int = 0,
    repetition_limit: int = DEFAULT_REPETITION_LIMIT,
    repetition_allow_chars: str = DEFAULT_REPETITION_ALLOW_CHARS,
) -> SamplingDefaults:
    """The defaults of the model folder at ``path``; ModelLoadError where its generation_config.json holds
    a value no request could be served with."""
    if max_tokens < 0 or repetition_limit < 0:
        raise ValueError("default max tokens and the repetition limit must be >= 0")
    from_model = _generation_config(path) if use_generation_config else {}
    allowed = formatting_tokens(tokenizer, repetition_allow_chars) if repetition_limit else []
    defaults = replace(
        CONTRACT_DEFAULTS,
        **from_model,
        max_tokens=max_tokens or None,
        repetition_limit=repetition_limit,
        repetition_allow=tuple(allowed),
    )
    try:  # a request that sets nothing runs with exactly these
        SamplingParams().resolve(defaults, 1, 2).validate(tokenizer.vocab_size)
    except InvalidField as e:
        raise ModelLoadError(f"{path / 'generation_config.json'}: {e.message}") from None
    return defaults


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
