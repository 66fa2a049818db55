"""The shipped model is the default; the random-weights model is only the fallback."""

from __future__ import annotations

import logging

from kvmesh.engine import default_model
from kvmesh.engine.default_model import RANDOM_MODEL_LABEL, default_model_path, model_label

from .conftest import SMALL


def test_the_shipped_model_is_the_default(caplog):
    with caplog.at_level(logging.INFO, logger=default_model.__name__):
        assert default_model_path() == SMALL
    assert "shipped" in caplog.text
    assert model_label(SMALL).startswith("pycode-small")


def test_random_model_is_the_fallback_when_the_folder_is_missing(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(default_model, "SHIPPED_MODEL_DIR", tmp_path / "absent")
    monkeypatch.setenv("KVMESH_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger=default_model.__name__):
        path = default_model_path()
    assert path.is_relative_to(tmp_path / "cache")
    assert model_label(path) == RANDOM_MODEL_LABEL
    assert "not found" in caplog.text
