"""A shipped model folder's README: what it is, how it was made, how well it does."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.engine import LLMEngine
from kvmesh.sampling import SamplingParams

SAMPLE_PROMPT = "def fibonacci(n):"


def save_bf16(model: LlamaForCausalLM, path: Path) -> None:
    """Save as a Hugging Face folder with bfloat16 weights, readable by old and new transformers."""
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(path)
    # transformers 5 writes "dtype"; 4.x readers (and other tools) look for "torch_dtype".
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["torch_dtype"] = config["dtype"]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def greedy_completion(path: Path, prompt: str = SAMPLE_PROMPT, max_tokens: int = 64) -> str:
    """What ``kvmesh generate --model path --prompt ...`` prints (greedy, float32 on CPU)."""
    engine = LLMEngine(path, EngineConfig(num_blocks=64))
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    return engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].text


def write_readme(path: Path, title: str, intro: str, facts: dict[str, str], command: str, sample: str) -> None:
    rows = "\n".join(f"| {k} | {v} |" for k, v in facts.items())
    env = f"Python {platform.python_version()}, torch {torch.__version__}, {platform.machine()}"
    (path / "README.md").write_text(
        f"# {title}\n\n{intro}\n\n"
        f"| | |\n|---|---|\n{rows}\n\n"
        f"## How it was made\n\n```\n{command}\n```\n\n"
        f"Trained with {env}. The run is seeded; it reproduces exactly when it is step-bound "
        "(a machine fast enough to finish its step budget before its time budget).\n\n"
        f"## Greedy completion of `{SAMPLE_PROMPT}` (64 tokens)\n\n"
        f"```python\n{SAMPLE_PROMPT}{sample}\n```\n"
    )


def param_count(model: torch.nn.Module) -> int:
    # Tied embeddings are one tensor; parameters() already yields it once.
    return sum(p.numel() for p in model.parameters())
