"""Text-level behaviour: tokenizer round trip, streaming deltas, stop strings, chat template."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.engine.config import EngineConfig
from kvmesh.engine.detokenizer import IncrementalDetokenizer
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.tokenizer import Tokenizer
from kvmesh.errors import InvalidField
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


def test_include_stop_str_in_output_keeps_the_stop_at_the_end(engine):
    prompt = engine.tokenizer.encode("def main():\n")
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop = free.text[3:6]
    params = SamplingParams(
        temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    res = engine.generate([prompt], params)[0]
    assert res.finish_reason == "stop"
    assert res.text == free.text[: free.text.index(stop) + len(stop)]


def _eos(engine) -> int:
    return min(engine.eos_token_ids)


def test_min_tokens_masks_eos_until_that_many_tokens(engine):
    prompt = engine.tokenizer.encode("hello")
    forced = {_eos(engine): 100.0}  # EOS would win every step
    alone = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, logit_bias=forced))[0]
    assert alone.token_ids == [_eos(engine)] and alone.finish_reason == "stop"
    held = SamplingParams(temperature=0.0, max_tokens=10, logit_bias=forced, min_tokens=3)
    res = engine.generate([prompt], held)[0]
    assert res.finish_reason == "stop"
    assert len(res.token_ids) == 4 and res.token_ids[-1] == _eos(engine) and _eos(engine) not in res.token_ids[:3]


def test_min_tokens_holds_stop_tokens_and_stop_strings_too(engine):
    prompt = engine.tokenizer.encode("class A:\n")
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    by_token = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=(free.token_ids[1],))
    assert len(engine.generate([prompt], by_token)[0].token_ids) == 2
    held = engine.generate([prompt], replace(by_token, min_tokens=6))[0]
    assert len(held.token_ids) >= 6 and free.token_ids[1] not in held.token_ids[:6]
    stop = free.text[:2]
    by_text = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    assert len(engine.generate([prompt], by_text)[0].token_ids) < 5
    # Stop strings are looked for only once 5 tokens are out.
    assert len(engine.generate([prompt], replace(by_text, min_tokens=5))[0].token_ids) >= 5


def test_skip_special_tokens_false_shows_them(engine):
    prompt = engine.tokenizer.encode("hello")
    eos = _eos(engine)
    special = engine.tokenizer.decode([eos], skip_special_tokens=False)
    assert special and engine.tokenizer.decode([eos]) == ""
    forced = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    assert engine.generate([prompt], forced)[0].text == ""
    shown = engine.generate([prompt], replace(forced, skip_special_tokens=False))[0]
    assert shown.text == special * 3


def test_chat_template_from_tokenizer_config_and_jinja_file(tokenizer_files, tmp_path):
    tok = Tokenizer(tokenizer_files)
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    for f in tokenizer_files.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] | upper }}")
    assert Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "HI"


def test_chat_template_kwargs_reach_the_template_but_not_its_own_variables(tokenizer_files, tmp_path):
    for f in tokenizer_files.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{{ messages[0]['content'] }}{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}"
    )
    tok = Tokenizer(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "hi"
    assert tok.apply_chat_template(messages, extra={"enable_thinking": False}) == "hi /no_think"
    with pytest.raises(InvalidField, match="may not set add_generation_prompt, messages"):
        tok.apply_chat_template(messages, extra={"messages": [], "add_generation_prompt": False})
