"""POST /v1/completions through a mesh of real processes, with the official openai client."""

from __future__ import annotations

import math

import pytest

from tests.openai.conftest import MODEL, all_full_blocks

pytestmark = pytest.mark.timeout(300)

PROMPT = "def fibonacci(n):\n    "
# Random weights reach EOS at random: these keep every length exact.
FULL_LENGTH = {"ignore_eos": True}


def test_a_completion_and_its_stream_agree(client) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, extra_body=FULL_LENGTH)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            extra_body=FULL_LENGTH,
            stream=True,
            stream_options={"include_usage": True},
        )
    )

    [choice] = whole.choices
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    *pieces, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in pieces) == choice.text
    assert pieces[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_several_prompts_each_get_n_choices(client) -> None:
    prompts = ["import os\n", "class Stack:\n", "x = [1, 2, 3]\n"]
    done = client.completions.create(
        model=MODEL, prompt=prompts, n=2, max_tokens=4, temperature=0, extra_body=FULL_LENGTH
    )

    assert [c.index for c in done.choices] == list(range(6))
    texts = [c.text for c in done.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[4] == texts[5]  # greedy: the same twice
    assert done.usage.completion_tokens == 24
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=4, temperature=0, extra_body=FULL_LENGTH)
        for p in prompts
    ]
    assert texts[::2] == [s.choices[0].text for s in singles]
    assert done.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_prompts_of_token_ids(client) -> None:
    one = client.completions.create(model=MODEL, prompt=[40, 41, 42, 43], max_tokens=4, temperature=0)
    two = client.completions.create(model=MODEL, prompt=[[40, 41, 42, 43], [50, 51]], max_tokens=4, temperature=0)

    assert one.usage.prompt_tokens == 4 and two.usage.prompt_tokens == 6
    assert two.choices[0].text == one.choices[0].text


def test_a_seed_reproduces_a_sampled_completion(client) -> None:
    def sample(seed: int, n: int = 1) -> list[str]:
        done = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed, n=n, extra_body=FULL_LENGTH
        )
        return [c.text for c in done.choices]

    first, again = sample(1234), sample(1234)
    pair = sample(1234, n=2)

    assert first == again
    assert pair[0] == first[0]  # choice 0 samples with the seed itself
    assert pair[1] != pair[0]  # choice 1 with seed + 1


def test_a_stop_string_ends_the_completion_before_it(client) -> None:
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, extra_body=FULL_LENGTH)
    text = free.choices[0].text
    at = next((i for i in range(len(text) // 3, len(text) - 2) if text[i : i + 2].isalnum()), None)
    assert at is not None, f"no usable stop string in {text!r}"
    stop = text[at : at + 2]

    stopped = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "@@@"], extra_body=FULL_LENGTH
    )

    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_logprobs_of_a_greedy_completion(client) -> None:
    done = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3, extra_body=FULL_LENGTH
    )

    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(logprob, max(top.values()), abs_tol=1e-4)
        assert token in top and math.isclose(top[token], logprob, abs_tol=1e-4)


def test_a_repeated_long_prompt_is_served_from_cache(client) -> None:
    prompt = "".join(f"value_{i} = compute({i}, cache=True)\n" for i in range(12))  # ~10 blocks, unique here

    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)

    assert first.usage.prompt_tokens == second.usage.prompt_tokens > 64
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert all_full_blocks(second.usage.prompt_tokens, second.usage.prompt_tokens_details.cached_tokens)
