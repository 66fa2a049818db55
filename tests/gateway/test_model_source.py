"""The gateway serves a hub id from the Hugging Face cache (offline) as it serves the folder, named by the id."""

from __future__ import annotations

import pytest

from kvmesh.errors import ModelLoadError
from kvmesh.runtime import common_flags, parse_flags
from services.gateway.main import FLAGS, served_model
from services.gateway.model import ServedModel
from tests.models.hf_cache import add_snapshot

HUB_ID = "acme/gw-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _args(*argv: str, environ: dict[str, str] | None = None):
    flags = [*common_flags(0, 0), *FLAGS]
    return parse_flags("kvmesh-gateway", flags, ["--router-address", "127.0.0.1:1", *argv], environ=environ or {})


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, model_dir):
    cache = tmp_path / "hub"
    add_snapshot(cache, HUB_ID, model_dir, COMMIT, refs=("main", "v1"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


def test_a_hub_id_is_served_under_its_id_with_the_folders_tokenizer_and_config(hub_cache, model_dir):
    from_folder = ServedModel.load(model_dir, "tiny")
    for argv in (
        ["--model", HUB_ID],
        ["--model", HUB_ID, "--revision", "v1"],
        ["--model", HUB_ID, "--revision", COMMIT],
    ):
        model = served_model(_args(*argv))
        assert model.name == HUB_ID
        assert model.path == hub_cache / "models--acme--gw-tiny" / "snapshots" / COMMIT
        assert model.label == from_folder.label and model.max_model_len == from_folder.max_model_len
        text = "def f(x):\n    return x + 1"
        assert model.tokenizer.encode(text) == from_folder.tokenizer.encode(text)
    assert served_model(_args("--model", HUB_ID, "--model-name", "mine")).name == "mine"
    # the env var works as every flag's does
    assert served_model(_args(environ={"KVMESH_MODEL": HUB_ID, "KVMESH_REVISION": "v1"})).name == HUB_ID


def test_a_folder_keeps_its_name_and_a_miss_names_the_cache(hub_cache, model_dir):
    assert served_model(_args("--model", str(model_dir))).name == model_dir.name
    with pytest.raises(ModelLoadError, match=r"refs/v9: missing \(refs there: main, v1\)"):
        served_model(_args("--model", HUB_ID, "--revision", "v9"))
