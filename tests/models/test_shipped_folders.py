"""The shipped folders are standard Hugging Face folders: kvmesh and transformers load them
and agree token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams

from .conftest import CODE_PROMPTS, DRAFT, SMALL

REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md")


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(n):
        nxt = model(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("path", [SMALL, DRAFT], ids=lambda p: p.name)
def test_folder_is_complete_small_and_bf16(path: Path):
    for name in REQUIRED:
        assert (path / name).is_file(), name
    assert sum(f.stat().st_size for f in path.iterdir()) <= 30 * 2**20
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("path", [SMALL, DRAFT], ids=lambda p: p.name)
def test_kvmesh_and_transformers_greedy_outputs_match(path: Path):
    from transformers import AutoModelForCausalLM

    engine = LLMEngine(path, EngineConfig(dtype="float32", num_blocks=64))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [engine.tokenizer.encode(p, add_special_tokens=False) for p in CODE_PROMPTS]
    ours = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    for prompt, got in zip(prompts, ours):
        assert got.token_ids == hf_greedy(hf, prompt, 32)
    assert engine.blocks.num_free == 64


def test_draft_shares_the_target_tokenizer():
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (SMALL / name).read_bytes() == (DRAFT / name).read_bytes()
