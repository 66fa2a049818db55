"""Phi-3 beyond the per-family fidelity test (tests/engine/test_fidelity.py runs it against transformers):
its fused checkpoint tensors slice for tensor-parallel ranks like any Llama's, and the 128k variants'
``longrope`` is refused by name when the config is read."""

from __future__ import annotations

import json
import shutil

import pytest

from kvmesh.checkpoint.model_config import ModelConfig
from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import ModelLoadError
from kvmesh.sampling import SamplingParams

from .conftest import PROMPTS


@pytest.mark.slow  # starts a rank process
def test_two_ranks_slice_the_fused_tensors_and_give_one_rank_s_tokens(checkpoints) -> None:
    path = checkpoints["phi3"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = LLMEngine(path, EngineConfig(num_blocks=64)).generate(PROMPTS, params)
    two = LLMEngine(path, EngineConfig(num_blocks=64, tensor_parallel_size=2))
    try:
        assert [c.token_ids for c in two.generate(PROMPTS, params)] == [c.token_ids for c in one]
    finally:
        two.close()


@pytest.mark.parametrize(
    ("rope", "named"),
    [
        ({"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0], "long_factor": [4.0]}, "longrope"),
        ({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_a_rope_we_do_not_compute_is_refused_by_name(checkpoints, tmp_path, rope, named) -> None:
    path = tmp_path / "phi3"
    shutil.copytree(checkpoints["phi3"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "rope_parameters": rope}))
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_dir(path)
