from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.models.bpe import train_tokenizer, write_tokenizer
from tests.engine.conftest import VOCAB


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("structured-tok")
    write_tokenizer(train_tokenizer(VOCAB, corpus_bytes=200_000), path)
    return path
