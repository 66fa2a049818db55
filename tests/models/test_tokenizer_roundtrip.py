"""The shipped tokenizer is byte-level: any text comes back byte for byte, in kvmesh and
in transformers."""

from __future__ import annotations

import random

import pytest

from kvmesh.engine.tokenizer import Tokenizer

from .conftest import SMALL

SAMPLES = [
    "def f(x):\n\treturn x  # tab-indented\r\n",
    "line one\r\nline two\rline three\n\n\n",
    "naïve café — 日本語のテキスト, Ελληνικά, русский, עברית, العربية",
    "emoji 🐍🚀👩‍👩‍👧‍👦 flags 🇫🇷 skin 👍🏽 and a lone ZWJ \u200d",
    "combining e\u0301 vs é; NFC/NFD stay as written",
    "\x00\x01\x7f control bytes \u2028 line separator \ufeff BOM",
    "   leading and trailing spaces   ",
    "",
    " ",
    "x" * 3000,
]


def random_texts(n: int, seed: int = 0) -> list[str]:
    """Seeded random strings over all of Unicode (surrogates excluded: not encodable)."""
    rng = random.Random(seed)

    def char() -> str:
        while True:
            cp = rng.choice([rng.randrange(0x80), rng.randrange(0x800), rng.randrange(0x110000)])
            if not 0xD800 <= cp <= 0xDFFF:
                return chr(cp)

    return ["".join(char() for _ in range(rng.randrange(1, 80))) for _ in range(n)]


@pytest.fixture(scope="module")
def kvmesh_tok() -> Tokenizer:
    return Tokenizer(SMALL)


@pytest.fixture(scope="module")
def hf_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SMALL)


@pytest.mark.parametrize("text", SAMPLES + random_texts(200))
def test_roundtrip_is_byte_exact(text: str, kvmesh_tok: Tokenizer, hf_tok):
    ids = kvmesh_tok.encode(text)
    assert kvmesh_tok.decode(ids).encode() == text.encode()
    assert hf_tok.encode(text, add_special_tokens=False) == ids
    assert hf_tok.decode(ids).encode() == text.encode()


def test_special_tokens_are_single_ids_and_survive_decoding_when_kept(kvmesh_tok: Tokenizer):
    text = "a<|im_start|>user\nhi<|im_end|>\n<|endoftext|>b"
    ids = kvmesh_tok.encode(text)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert kvmesh_tok.token_to_id(special) in ids
    assert kvmesh_tok.decode(ids, skip_special_tokens=False) == text
    assert kvmesh_tok.decode(ids) == "auser\nhi\nb"


def test_chat_template_and_eos(kvmesh_tok: Tokenizer):
    assert kvmesh_tok.eos_token == "<|endoftext|>"
    assert kvmesh_tok.eos_token_id == kvmesh_tok.token_to_id("<|endoftext|>")
    prompt = kvmesh_tok.apply_chat_template([{"role": "user", "content": "Write a sort function."}])
    assert prompt == "<|im_start|>user\nWrite a sort function.<|im_end|>\n<|im_start|>assistant\n"


def test_code_tokenizes_compactly(kvmesh_tok: Tokenizer):
    source = (SMALL.parents[1] / "kvmesh" / "engine" / "engine.py").read_text()
    assert len(source.encode()) / len(kvmesh_tok.encode(source)) > 2.5  # bytes per token
