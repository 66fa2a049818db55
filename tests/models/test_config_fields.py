"""No silent config: every field transformers' config classes define for a served family is decided in
kvmesh/checkpoint/config_fields.py (honoured, without effect at inference, or served at some values
only), and a value kvmesh would compute differently is refused with the field named."""

from __future__ import annotations

import dataclasses

import pytest
import transformers

from kvmesh.checkpoint.config_fields import HONOURED, NO_EFFECT, REQUIRED, decided
from kvmesh.checkpoint.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from kvmesh.errors import ModelLoadError

BASE = {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 10, "intermediate_size": 8, "num_hidden_layers": 1}


def _config_class(architecture: str) -> type:
    # Gemma 3's causal LM is its text model, with a config of its own.
    return getattr(transformers, architecture.removesuffix("ForCausalLM").replace("Gemma3", "Gemma3Text") + "Config")


@pytest.mark.parametrize("architecture", sorted(SUPPORTED_ARCHITECTURES))
def test_every_field_of_a_served_family_s_config_class_is_decided(architecture) -> None:
    fields = {f.name for f in dataclasses.fields(_config_class(architecture))}
    undecided = sorted(name for name in fields if not decided(name))
    assert not undecided, f"{architecture}: add these to kvmesh/checkpoint/config_fields.py: {undecided}"


@pytest.mark.parametrize("architecture", sorted(SUPPORTED_ARCHITECTURES))
def test_a_config_transformers_writes_with_its_defaults_loads(architecture) -> None:
    raw = _config_class(architecture)(**BASE).to_dict()
    assert ModelConfig.from_dict(raw).architecture == architecture


@pytest.mark.parametrize(
    ("field", "value"), [("hidden_act", "gelu_pytorch_tanh"), ("mlp_bias", True), ("attention_bias", True)]
)
def test_a_value_computed_otherwise_is_refused_naming_the_field(field, value) -> None:
    with pytest.raises(ModelLoadError, match=f"{field}={value!r} is not served"):
        ModelConfig.from_dict({**BASE, "model_type": "llama", field: value})


def test_the_table_decides_each_field_once() -> None:
    assert not (
        HONOURED.keys() & NO_EFFECT.keys() or HONOURED.keys() & REQUIRED.keys() or NO_EFFECT.keys() & REQUIRED.keys()
    )
