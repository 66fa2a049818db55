from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.models.bpe import train_tokenizer, write_tokenizer
from services.gateway.model import ServedModel

CONTEXT = 256
LABEL = "test-model (RANDOM WEIGHTS)"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder with what the gateway reads: tokenizer files and config.json (no weights)."""
    path = tmp_path_factory.mktemp("model")
    tok = train_tokenizer(vocab_size=300, corpus_bytes=100_000)
    write_tokenizer(tok, path)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "max_position_embeddings": CONTEXT,
        "kvmesh_label": LABEL,
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def model(model_dir: Path) -> ServedModel:
    return ServedModel.load(model_dir, "tiny")
