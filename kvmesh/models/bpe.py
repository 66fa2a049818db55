"""A byte-level BPE tokenizer trained on the Python source the interpreter ships.

What our own small models (models/pycode-*) and the tests' transformers-written checkpoints
use: any text round-trips, code tokenizes well, and it needs nothing but ``tokenizers``.
"""

from __future__ import annotations

import json
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvmesh.models.chatml import CHAT_TEMPLATE

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _stdlib_corpus(max_bytes: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for f in sorted(root.glob("*.py")):
        text = f.read_text(encoding="utf-8", errors="ignore")
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    return texts


def train_tokenizer(
    vocab_size: int = 1024, corpus_bytes: int = 2_000_000, texts: Iterable[str] | None = None
) -> Tokenizer:
    """A byte-level BPE tokenizer (lossless on any UTF-8) trained on stdlib Python source.

    ``texts`` replaces the default corpus (the stdlib's top-level modules, up to
    ``corpus_bytes``), e.g. a training split that leaves held-out files unseen.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_stdlib_corpus(corpus_bytes) if texts is None else texts, trainer)
    return tok


def write_tokenizer(tok: Tokenizer, path: Path, model_max_length: int = 2048) -> None:
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": model_max_length,
            },
            indent=2,
        )
    )
