"""The served model: tokenizer and limits from the folder, no weights needed."""

from __future__ import annotations

import pytest

from kvmesh.errors import ModelLoadError
from services.gateway.model import ServedModel
from tests.gateway.conftest import CONTEXT


def test_defaults_come_from_the_folder(model_dir) -> None:
    model = ServedModel.load(model_dir)

    assert model.name == model_dir.name
    assert model.max_model_len == CONTEXT
    assert not list(model_dir.glob("*.safetensors"))  # the gateway never needed them


def test_max_model_len_can_only_lower_the_context(model_dir) -> None:
    assert ServedModel.load(model_dir, max_model_len=64).max_model_len == 64
    assert ServedModel.load(model_dir, max_model_len=10 * CONTEXT).max_model_len == CONTEXT


def test_a_missing_folder_fails_clearly(tmp_path) -> None:
    with pytest.raises(ModelLoadError, match="not a model folder"):
        ServedModel.load(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        ServedModel.load(tmp_path)
