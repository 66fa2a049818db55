"""The model the gateway serves: its tokenizer and limits, never its weights.

The gateway tokenizes, applies the chat template and checks lengths; workers
load the weights. Everything here comes from the model folder's
tokenizer.json, tokenizer_config.json and config.json.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import ModelLoadError, NotFound
from kvmesh.sampling import CONTRACT_DEFAULTS, SamplingDefaults
from services.gateway.generation_defaults import generation_defaults


class UnknownModel(NotFound):
    """A request named a model this gateway does not serve."""

    reason = "model_not_found"


@dataclass(frozen=True)
class ServedModel:
    name: str
    path: Path
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    # Set for checkpoints kvmesh wrote itself (config.json "kvmesh_label"),
    # e.g. a random-weights test model: clients must be able to see it.
    label: str | None
    created: int  # unix seconds, when loaded
    # What requests get for the settings they leave unset.
    defaults: SamplingDefaults = CONTRACT_DEFAULTS

    @classmethod
    def load(
        cls, path: Path, name: str | None = None, max_model_len: int | None = None, **defaults: object
    ) -> ServedModel:
        """Read the folder's tokenizer and config; ``max_model_len`` may only lower the model's context.
        ``defaults``: generation_defaults' options (none: the model's generation_config.json,
        no default max tokens, no repetition guard)."""
        if not path.is_dir():
            raise ModelLoadError(f"{path}: not a model folder")
        config = ModelConfig.from_dir(path)
        context = config.max_position_embeddings
        if max_model_len is not None:
            if max_model_len <= 0:
                raise ModelLoadError(f"max_model_len must be > 0, got {max_model_len}")
            context = min(context, max_model_len)
        tokenizer = Tokenizer(path)
        defaults.setdefault("repetition_limit", 0)
        return cls(
            name=name or path.resolve().name,
            path=path,
            tokenizer=tokenizer,
            vocab_size=config.vocab_size,
            max_model_len=context,
            label=config.raw.get("kvmesh_label"),
            created=int(time.time()),
            defaults=generation_defaults(path, tokenizer, **defaults),
        )
