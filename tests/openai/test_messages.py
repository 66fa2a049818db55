"""POST /v1/messages through a mesh of real processes (random weights), with the official anthropic client.

Greedy replies are compared with what /v1/chat/completions gives for the same conversation: both run
the same chat through the same core, so the text, the stop and the token counts must agree.
"""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.openai.conftest import MODEL, all_full_blocks

pytestmark = pytest.mark.timeout(300)

SYSTEM = "Be brief."
ASK = [{"role": "user", "content": "Hi"}]
GREEDY = {"temperature": 0}  # the 2.17 client has no temperature argument: it goes in the body
MAX_TOKENS = 16
# The smallest tool: its call, markup and all, is 51 tokens of the nearly character-level test tokenizer.
TOOL = {"name": "f", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}
CALL_TOKENS = 64
STOPS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


@pytest.fixture
def messages(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_greedy_message_is_the_greedy_chat_completion(messages, client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": SYSTEM}, *ASK],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    message = messages.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, system=SYSTEM, messages=ASK, extra_body=GREEDY
    )

    [choice] = chat.choices
    assert text_of(message) == choice.message.content
    assert message.stop_reason == STOPS[choice.finish_reason] and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
    # The chat completion had just computed the same prompt: its full blocks came from cache.
    assert all_full_blocks(chat.usage.prompt_tokens, usage.cache_read_input_tokens)


def test_a_streamed_message_is_the_message(messages) -> None:
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "system": SYSTEM, "messages": ASK, "extra_body": GREEDY}
    whole = messages.messages.create(**request)
    with messages.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()

    assert streamed == text_of(whole) == text_of(final)
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_the_stop_sequence_that_ended_the_reply_is_named(messages) -> None:
    request = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": ASK, "extra_body": GREEDY}
    whole = text_of(messages.messages.create(**request))
    # Two printable characters from the middle of the greedy reply: it will stop where they first occur.
    stop = next(whole[i : i + 2] for i in range(1, len(whole) - 1) if whole[i : i + 2].isprintable())
    stopped = messages.messages.create(**request, stop_sequences=["never there", stop])
    with messages.messages.stream(**request, stop_sequences=[stop]) as stream:
        streamed = stream.get_final_message()

    assert text_of(stopped) == text_of(streamed) == whole[: whole.index(stop)]
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", stop)
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_a_tool_use_and_its_result(messages, client: openai.OpenAI) -> None:
    call = messages.messages.create(
        model=MODEL, max_tokens=CALL_TOKENS, messages=ASK, tools=[TOOL], tool_choice={"type": "any"}, extra_body=GREEDY
    )

    uses = [block for block in call.content if block.type == "tool_use"]
    assert call.stop_reason == "tool_use" and uses
    assert all(use.name == "f" and use.input == {} and use.id for use in uses)

    results = [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"} for use in uses]
    conversation = [*ASK, {"role": "assistant", "content": call.content}, {"role": "user", "content": results}]
    reply = messages.messages.create(
        model=MODEL, max_tokens=MAX_TOKENS, messages=conversation, tools=[TOOL], extra_body=GREEDY
    )
    # The same turns as chat messages: the assistant's calls, one tool message per result.
    calls = [{"id": u.id, "type": "function", "function": {"name": "f", "arguments": "{}"}} for u in uses]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            *ASK,
            {"role": "assistant", "content": text_of(call), "tool_calls": calls},
            *({"role": "tool", "tool_call_id": u.id, "content": "sunny"} for u in uses),
        ],
        tools=[{"type": "function", "function": {"name": "f", "parameters": TOOL["input_schema"]}}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )

    [choice] = chat.choices
    assert text_of(reply) == (choice.message.content or "")
    assert reply.stop_reason == STOPS[choice.finish_reason]
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == chat.usage.prompt_tokens
