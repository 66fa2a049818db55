"""Text-level behaviour: tokenizer round trip, streaming deltas, stop strings, chat template."""

from __future__ import annotations

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(llama_with_tokenizer):
    return LLMEngine(llama_with_tokenizer, EngineConfig(num_blocks=128))


@pytest.mark.parametrize("text", ["def f(x):\n    return x", "naïve café 日本語 😀 \t\r\n", "  leading spaces"])
def test_tokenizer_round_trips_bytes_exactly(tokenizer_files, text):
    tok = Tokenizer(tokenizer_files)
    assert tok.decode(tok.encode(text)) == text


def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer_files):
    tok = Tokenizer(tokenizer_files)
    ids = tok.encode("héllo 😀 wörld, 日本")
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.add(t) for t in ids)
    assert streamed == tok.decode(ids)


def test_stop_string_is_cut_and_not_emitted(engine):
    prompt = engine.tokenizer.encode("def main():\n")
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    assert len(free.text) > 6
    stop = free.text[3:6]
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert res.finish_reason == "stop"
    assert res.text == free.text[: free.text.index(stop)]


def test_streaming_never_leaks_part_of_a_stop_string(engine):
    prompt = engine.tokenizer.encode("class A:\n")
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop = free.text[4:9]
    rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))
    streamed = ""
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            streamed += out.text_delta
            assert stop not in streamed
    assert streamed == free.text[: free.text.index(stop)]


def test_chat_template_from_tokenizer_config_and_jinja_file(tokenizer_files, tmp_path):
    tok = Tokenizer(tokenizer_files)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for f in tokenizer_files.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    assert Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "HI"
