"""A transformers-written model in a fake Hugging Face cache (as huggingface_hub lays it out: blobs, snapshot
symlinks, refs) is served by its hub id, offline, with the tokens it gives from its own folder."""

from __future__ import annotations

import json

import pytest

from kvmesh.cli import main
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.flags import ENGINE_FLAGS, model_path, served_model_name
from kvmesh.errors import ModelLoadError
from kvmesh.runtime import parse_flags
from kvmesh.sampling import SamplingParams
from tests.models.hf_cache import add_snapshot

from .conftest import PROMPTS, write_checkpoint

HUB_ID = "acme/tiny-llama"
MAIN = "1" * 40
OTHER = "2" * 40


@pytest.fixture
def hub(tmp_path, monkeypatch, llama_with_tokenizer):
    """HF_HOME/hub holding the test llama at main, and other weights (another seed) at the branch 'other'."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cache = tmp_path / "hf" / "hub"
    add_snapshot(cache, HUB_ID, llama_with_tokenizer, MAIN)
    other = write_checkpoint(tmp_path / "other", "llama-gqa", seed=7, eos_token_id=0)
    add_snapshot(cache, HUB_ID, other, OTHER, refs=("other",))
    return cache


def _greedy(path) -> list[list[int]]:
    engine = LLMEngine(path, EngineConfig(num_blocks=64))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return [r.token_ids for r in engine.generate(PROMPTS[:2], params)]


def _args(*argv: str, environ=None):
    return parse_flags("kvmesh-decode", ENGINE_FLAGS, list(argv), environ=environ or {})


def test_a_hub_id_serves_the_folders_tokens(hub, llama_with_tokenizer, tmp_path):
    args = _args("--model", HUB_ID)
    assert model_path(args) == str(hub / "models--acme--tiny-llama" / "snapshots" / MAIN)
    assert served_model_name(args) == HUB_ID
    assert served_model_name(_args("--model", str(llama_with_tokenizer))) == llama_with_tokenizer.name
    want = _greedy(llama_with_tokenizer)
    assert _greedy(model_path(args)) == want
    # --revision (or KVMESH_REVISION) picks the other weights: the test can tell them apart
    other = _greedy(model_path(_args(environ={"KVMESH_MODEL": HUB_ID, "KVMESH_REVISION": "other"})))
    assert other == _greedy(tmp_path / "other") != want
    assert _greedy(model_path(_args("--model", HUB_ID, "--revision", OTHER))) == other


def test_kvmesh_generate_takes_a_hub_id_and_a_revision(hub, llama_with_tokenizer, capsys):
    def run(*model: str) -> dict:
        assert main(["generate", *model, "--prompt", "def f(x):", "--max-tokens", "6", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    assert run("--model", HUB_ID) == run("--model", str(llama_with_tokenizer))
    assert run("--model", HUB_ID, "--revision", MAIN) == run("--model", HUB_ID)
    assert main(["generate", "--model", HUB_ID, "--revision", "nope", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "refs/nope: missing (refs there: main, other)" in err and "looked at the folder" in err


def test_a_miss_raises_before_any_engine_is_built(hub):
    with pytest.raises(ModelLoadError, match="no models--acme--absent in it"):
        model_path(_args("--model", "acme/absent"))
