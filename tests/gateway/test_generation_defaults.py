"""Server-wide generation defaults: what a request that leaves a setting unset runs with."""

from __future__ import annotations

import json
import shutil

import pytest

from kvmesh.api.common.v1 import sampling_pb2
from kvmesh.errors import ModelLoadError
from kvmesh.sampling import SamplingParams
from services.gateway.generation_defaults import formatting_tokens, generation_defaults
from services.gateway.model import ServedModel
from tests.gateway.fakes import FakeMesh
from tests.gateway.test_http_api import http_gateway

GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "eos_token_id": 0}


@pytest.fixture(scope="module")
def tuned_dir(model_dir, tmp_path_factory):
    """The test model folder with a generation_config.json carrying sampling defaults."""
    path = tmp_path_factory.mktemp("tuned")
    shutil.copytree(model_dir, path, dirs_exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return path


def test_unset_fields_take_the_model_defaults_and_set_ones_stay(tuned_dir):
    served = ServedModel.load(tuned_dir, "tiny", use_generation_config=True, max_tokens=77, repetition_limit=9)
    d = served.defaults
    filled = SamplingParams.from_pb(sampling_pb2.SamplingParams()).resolve(d, 10, 200)
    assert round(filled.temperature, 6) == 0.6 and round(filled.top_p, 6) == 0.9 and filled.top_k == 40
    assert round(filled.repetition_penalty, 6) == 1.1 and filled.max_tokens == 77
    assert filled.repetition_limit == 9 and len(filled.repetition_allow) > 0
    # A server default never asks for more than the prompt leaves room for.
    assert SamplingParams().resolve(d, 150, 200).max_tokens == 50

    asked = sampling_pb2.SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=3,
        max_tokens=5,
        repetition_penalty=1.0,
        repetition_guard=sampling_pb2.RepetitionGuard(max_repeats=0),
    )
    kept = SamplingParams.from_pb(asked).resolve(d, 10, 200)
    assert (kept.temperature, kept.top_p, kept.top_k, kept.max_tokens, kept.repetition_penalty) == (0.0, 1.0, 3, 5, 1.0)
    assert kept.repetition_limit == 0  # the request turned the guard off


def test_generation_config_can_be_ignored_and_the_guard_turned_off(tuned_dir):
    d = ServedModel.load(tuned_dir, "tiny", use_generation_config=False, repetition_limit=0).defaults
    filled = SamplingParams().resolve(d, 10, 200)
    assert (filled.temperature, filled.top_p, filled.repetition_penalty) == (1.0, 1.0, 1.0)  # the API's defaults
    assert filled.repetition_limit == 0 and filled.max_tokens == 190  # up to the context


def test_formatting_tokens_are_only_those_made_of_the_allowed_characters(model):
    tok = model.tokenizer
    ids = formatting_tokens(tok, " \n-=|")
    texts = [tok.decode([i]) for i in ids]
    assert texts and all(set(t) <= set(" \n-=|") for t in texts)
    assert " " in texts and "\n" in texts
    assert tok.token_to_id("<|im_end|>") not in ids  # special tokens decode to nothing: never exempt


async def test_http_requests_reach_the_mesh_with_the_defaults(tuned_dir):
    served = ServedModel.load(tuned_dir, "tiny", max_tokens=12, repetition_limit=20)
    mesh = FakeMesh()
    async with http_gateway(served, mesh) as gw:
        client = gw.client()
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
        await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            temperature=0,
            max_tokens=3,
            extra_body={"repetition_penalty": 1.0},
        )
    (_, defaulted), (_, explicit) = mesh.prefills
    s = defaulted.sampling
    assert round(s.temperature, 6) == 0.6 and s.max_tokens == 12 and s.repetition_guard.max_repeats == 20
    e = explicit.sampling
    assert e.temperature == 0.0 and e.max_tokens == 3 and e.repetition_penalty == 1.0
    assert e.repetition_guard.max_repeats == 20


def test_bad_generation_config_is_a_load_error(tuned_dir, tmp_path):
    shutil.copytree(tuned_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text("{not json")
    with pytest.raises(Exception, match="generation_config.json: not valid JSON"):
        generation_defaults(tmp_path / "m", ServedModel.load(tuned_dir).tokenizer)


def test_a_generation_config_no_request_could_run_with_is_a_load_error(tuned_dir, tmp_path):
    shutil.copytree(tuned_dir, tmp_path / "m")
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"temperature": float("nan")}))
    with pytest.raises(ModelLoadError, match="sampling.temperature must be a finite number"):
        generation_defaults(tmp_path / "m", ServedModel.load(tuned_dir).tokenizer)
