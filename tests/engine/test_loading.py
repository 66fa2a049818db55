"""Model folders: sharded weights, and clear errors naming the bad file."""

from __future__ import annotations

import json
import shutil

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.errors import ModelLoadError
from kvmesh.sampling import SamplingParams

from .conftest import write_checkpoint
from .hf_reference import hf_greedy


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    from transformers import AutoModelForCausalLM

    single = write_checkpoint(tmp_path / "single", "qwen2-bias")
    model = AutoModelForCausalLM.from_pretrained(single)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    engine = LLMEngine(tmp_path / "sharded", EngineConfig(num_blocks=32))
    out = engine.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(single, [3, 4, 5], 8)[0]


def test_unsupported_architecture_names_the_config(checkpoints, tmp_path):
    path = _copy(checkpoints["llama-gqa"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json: unsupported architecture 'GPT2LMHeadModel'"):
        LLMEngine(path)


def test_missing_config_and_weights_are_named(checkpoints, tmp_path):
    path = _copy(checkpoints["llama-gqa"], tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLMEngine(path)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        LLMEngine(path)


def test_corrupt_weights_file_is_named(checkpoints, tmp_path):
    path = _copy(checkpoints["llama-gqa"], tmp_path / "m")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt"):
        LLMEngine(path)


def test_dynamic_rope_is_refused_clearly(checkpoints, tmp_path):
    path = _copy(checkpoints["llama-gqa"], tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope_type 'dynamic' is not served"):
        LLMEngine(path)


def test_fp8_quantization_needs_a_gpu(checkpoints):
    from kvmesh.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match="CUDA"):
        LLMEngine(checkpoints["llama-gqa"], EngineConfig(num_blocks=8, quantization="fp8"))
