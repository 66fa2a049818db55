"""A Hugging Face tokenizer folder: tokenizer.json, special tokens and the chat template.

Read with the ``tokenizers`` library (no transformers at run time). The chat
template is rendered with jinja2 the way transformers does it: a sandboxed
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``tojson`` without ASCII escaping and ``strftime_now``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from kvmesh.errors import InvalidArgument, InvalidField, ModelLoadError


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens as a string or an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: Path) -> None:
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"{tok_file}: missing (kvmesh reads fast tokenizers only)")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises a bare Exception on parse errors
            raise ModelLoadError(f"{tok_file}: corrupt tokenizer ({e})") from None
        cfg_file = path / "tokenizer_config.json"
        self.config: dict[str, Any] = {}
        if cfg_file.is_file():
            try:
                self.config = json.loads(cfg_file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ModelLoadError(f"{cfg_file}: not valid JSON ({e})") from None
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.chat_template = self._load_chat_template(path)

    def _load_chat_template(self, path: Path) -> str | None:
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():
            return jinja_file.read_text()
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            by_name = {t["name"]: t["template"] for t in template}
            template = by_name.get("default") or next(iter(by_name.values()), None)
        return template

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab(self) -> dict[str, int]:
        """Every token's string (as tokenizer.json spells it) to its id, added tokens included."""
        return self._tok.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """The tokenizer.json this tokenizer was read from (normalized by ``tokenizers``)."""
        return self._tok.to_str()

    @cached_property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_each(self, ids: list[int]) -> list[str]:
        """Each token's own text (special tokens: empty)."""
        return self._tok.decode_batch([[i] for i in ids], skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """``extra``: more variables for the template (a request's chat_template_kwargs); they may not
        replace the ones set here."""
        if not self.chat_template:
            raise InvalidArgument("this model has no chat template; use the completions API")
        variables = {
            "messages": messages,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        taken = sorted(set(extra or ()) & set(variables))
        if taken:
            raise InvalidField("chat_template_kwargs", f"chat_template_kwargs may not set {', '.join(taken)}")
        try:
            return _compiled(self.chat_template).render({**(extra or {}), **variables})
        except jinja2.TemplateError as e:
            raise InvalidArgument(f"chat template failed: {e}") from None


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


_TEMPLATES: dict[str, jinja2.Template] = {}


def _compiled(source: str) -> jinja2.Template:
    if source not in _TEMPLATES:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False: json.dumps(
            x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
        )
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
