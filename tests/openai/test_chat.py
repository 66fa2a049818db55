"""POST /v1/chat/completions through a mesh of real processes, with the official openai client."""

from __future__ import annotations

import math

import pytest

from kvmesh.engine.tokenizer import Tokenizer
from tests.openai.conftest import MODEL, all_full_blocks

pytestmark = pytest.mark.timeout(300)

FULL_LENGTH = {"ignore_eos": True}
CONVERSATION = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": [{"type": "text", "text": "Sort a list."}, {"type": "text", "text": "Briefly."}]},
    {"role": "assistant", "content": "sorted(xs)"},
    {"role": "tool", "content": "[1, 2, 3]", "tool_call_id": "call-1"},
    {"role": "user", "content": "And reversed?", "name": "alice"},
]


def _prompt_tokens(model_dir, messages: list[dict]) -> int:
    """What the gateway should count: the chat template rendered, then tokenized."""
    tok = Tokenizer(model_dir)
    return len(tok.encode(tok.apply_chat_template(messages), add_special_tokens=False))


def test_a_chat_completion_renders_the_template_and_counts_usage(client, openai_model) -> None:
    done = client.chat.completions.create(
        model=MODEL, messages=CONVERSATION, max_completion_tokens=10, temperature=0, extra_body=FULL_LENGTH
    )

    [choice] = done.choices
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    rendered = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION]
    rendered[1]["content"] = "Sort a list.\nBriefly."
    rendered[4]["name"] = "alice"
    assert done.usage.prompt_tokens == _prompt_tokens(openai_model, rendered)
    assert done.usage.completion_tokens == 10


def test_a_streamed_chat_equals_the_whole_one(client) -> None:
    messages = [{"role": "user", "content": "Write a loop."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, extra_body=FULL_LENGTH
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body=FULL_LENGTH,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    *pieces, usage_chunk = chunks
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == whole.choices[0].message.content
    assert [p.choices[0].finish_reason for p in pieces][-1] == "length"
    assert usage_chunk.choices == []
    counted = (usage_chunk.usage.prompt_tokens, usage_chunk.usage.completion_tokens)
    assert counted == (whole.usage.prompt_tokens, whole.usage.completion_tokens)


def test_n_streamed_choices_with_a_seed(client) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Name a variable."}],
            n=2,
            seed=7,
            temperature=1.0,
            max_tokens=8,
            extra_body=FULL_LENGTH,
            stream=True,
        )
    )

    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] and texts[1] and texts[0] != texts[1]
    finished = [c.choices[0] for c in chunks if c.choices[0].finish_reason]
    assert sorted(c.index for c in finished) == [0, 1]


def test_chat_logprobs(client) -> None:
    done = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=FULL_LENGTH,
    )

    content = done.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        alternatives = [t.logprob for t in entry.top_logprobs]
        assert len(alternatives) == 3 and alternatives == sorted(alternatives, reverse=True)
        assert math.isclose(entry.logprob, alternatives[0], abs_tol=1e-4)  # greedy picks the most likely
        assert entry.token == entry.top_logprobs[0].token
        assert entry.bytes is None or bytes(entry.bytes).decode() == entry.token


def test_a_repeated_conversation_is_served_from_cache(client) -> None:
    history = [{"role": "system", "content": "Cache check " + "lorem ipsum dolor " * 20}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=2)
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=2)

    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens > 64
    assert all_full_blocks(second.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens)
