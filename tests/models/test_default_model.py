"""The default model is the installed SmolLM2 folder; without an install, a clear error says what to run."""

from __future__ import annotations

import pytest

from kvmesh.engine.default_model import default_model_path, model_label
from kvmesh.errors import ModelLoadError
from kvmesh.models.catalog import DEFAULT_MODEL, models_dir

from .conftest import SMALL


def test_the_installed_smollm2_is_the_default():
    path = default_model_path()
    assert path == models_dir() / "smollm2-135m-instruct"
    assert model_label(path) == "smollm2-135m-instruct"
    assert model_label(SMALL).startswith("pycode-small")


def test_a_missing_install_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_MODELS_DIR", str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match=rf"{DEFAULT_MODEL.name} is not installed .*kvmesh models install"):
        default_model_path()
